"""``stppo_agent.algorithms.dynamic_sampling``: which groups DAPO keeps as
informative (spread and tolerance), on the inputs' device."""

from __future__ import annotations

import torch

from stppo_agent.algorithms.dynamic_sampling import dropped_group_count, informative_groups
from tests.support.batches import t64
from tests.support.devices import F64


def test_informative_groups_by_spread_and_tolerance():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.7, 2.0])
    groups = torch.tensor([3, 3, 8, 8, 5, 5, 6])
    assert informative_groups(rewards, groups).tolist() == [False, False, True, True, True, True, False]
    assert informative_groups(rewards, groups, tolerance=0.2).tolist() == [False] * 2 + [True] * 2 + [False] * 3
    assert informative_groups(rewards, groups, tolerance=0.19).tolist()[4:6] == [True, True]
    exact = informative_groups(t64([0.0, 0.5, 0.0, 0.25]), torch.tensor([0, 0, 1, 1]), tolerance=0.25)
    assert exact.tolist() == [True, True, False, False]  # a spread equal to the tolerance is not above it
    keep = informative_groups(rewards, groups)
    assert dropped_group_count(keep, groups) == 2
    assert dropped_group_count(torch.ones(7, dtype=torch.bool), groups) == 0
    ints = informative_groups(torch.tensor([1, 2, 2, 2]), torch.tensor([0, 0, 1, 1]))
    assert ints.tolist() == [True, True, False, False]
    empty = informative_groups(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert empty.shape == (0,)
    # float64 spreads below float32's resolution still count
    assert informative_groups(t64([1.0, 1.0 + 1e-12]), torch.tensor([0, 0])).tolist() == [True, True]


def test_dynamic_sampling_informative_groups_stays_on_the_inputs_device():
    from stppo_agent.algorithms.dynamic_sampling import informative_groups

    rewards, group_ids = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0], dtype=F64), torch.tensor([4, 4, 9, 9, 1])
    with torch.device("meta"):
        keep = informative_groups(rewards, group_ids)
    assert keep.device.type == "cpu" and keep.tolist() == [False, False, True, True, False]
