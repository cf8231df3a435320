"""``stppo_agent.algorithms.second_moment``: M2PO's keep mask -- segment ids per
level, the cut strictly below the threshold with stable ties, segments weighed by their tokens, the statistic over
ranks and over micro-batches of different lengths, on the inputs' device."""

from __future__ import annotations

import pytest
import torch

from stppo_agent.algorithms import second_moment as second_moment_module
from stppo_agent.algorithms.config import AlgorithmConfig
from stppo_agent.algorithms.second_moment import keep_items, m2po_keep_mask, m2po_keep_masks, segment_ids
from stppo_agent.algorithms.stabilizers import m2po_whole_batch
from tests.support.batches import F64, t64
from tests.support.devices import _policy_batch


def test_m2po_segment_ids_per_level():
    mask = torch.tensor([[True, False, True], [False, True, True]])
    turns = torch.tensor([[0, -1, 2], [-1, 1, 1]])
    ids, count = segment_ids(mask, turns, "token")
    assert (ids.tolist(), count) == ([[0, 0, 2], [0, 4, 5]], 6)
    ids, count = segment_ids(mask, turns, "turn")
    assert (ids.tolist(), count) == ([[0, 0, 2], [0, 4, 4]], 6)
    ids, count = segment_ids(mask, turns, "sequence")
    assert (ids.tolist(), count) == ([[0, 0, 0], [0, 1, 1]], 2)
    with pytest.raises(ValueError, match="^unknown ratio level 'row'; known: token, turn, sequence$"):
        segment_ids(mask, turns, "row")


def test_keep_items_cuts_strictly_below_the_threshold_with_weights_and_stable_ties():
    assert keep_items(t64([0.5, 0.1]), t64([1.0, 1.0]), 0.3).tolist() == [False, True]  # 0.3 is not below 0.3
    assert keep_items(t64([0.5, 0.1]), t64([1.0, 1.0]), 0.30001).tolist() == [True, True]
    assert keep_items(t64([0.0, 1.0]), t64([3.0, 1.0]), 0.3).tolist() == [True, True]  # (0 * 3 + 1) / 4
    assert keep_items(t64([0.0, 1.0]), t64([1.0, 1.0]), 0.3).tolist() == [True, False]
    assert keep_items(t64([1.0, 2.0, 3.0]), t64([1.0, 1.0, 1.0]), 0.1).tolist() == [True, False, False]
    # ties: the first in order goes first (tail means 0.6, 0.5, 0.33)
    assert keep_items(t64([1.0, 1.0, 1.0, 0.0, 0.0]), torch.ones(5, dtype=F64), 0.45).tolist() == \
        [False, False, True, True, True]
    assert keep_items(t64([0.2]), t64([1.0]), 0.1).tolist() == [True]
    # fractional weights: (0.25 + 0.2) / 0.5 = 0.9 is not below 0.85, 0.8 is
    assert keep_items(t64([1.0, 0.8]), t64([0.25, 0.25]), 0.85).tolist() == [False, True]
    empty = keep_items(t64([]), t64([]), 0.1)
    assert empty.tolist() == [] and empty.dtype == torch.bool


def test_m2po_keep_mask_weighs_turn_segments_by_their_tokens():
    mask = torch.tensor([[True, True, False, True]])
    turns = torch.tensor([[0, 0, -1, 1]])
    log_ratio = t64([[0.4, 0.4, 9.0, 0.1]])  # level log-ratios: turn 0 (2 tokens) at 0.4, turn 1 at 0.1
    keep, moment = m2po_keep_mask(log_ratio, mask, turns, "turn", threshold=0.1)
    assert moment.item() == pytest.approx((2 * 0.16 + 0.01) / 3)
    assert keep.tolist() == [[False, False, False, True]]
    keep, _ = m2po_keep_mask(log_ratio, mask, turns, "turn", threshold=0.12)  # 0.11 is below
    assert keep.tolist() == [[True, True, False, True]]


def test_m2po_keep_mask_over_two_ranks_with_the_collective_faked(monkeypatch):
    """This process is rank 1; rank 0 holds two segments (0.04, 1 token) and (0.0, 2 tokens)."""
    rank0 = t64([[0.04, 1.0], [0.0, 2.0]])
    sent = []

    def all_reduce_sum(value):
        sent.append(value.clone())
        value = value.clone()
        if value.ndim == 1:
            value[0] += rank0.shape[0]
        else:
            value[:rank0.shape[0]] += rank0
        return value

    monkeypatch.setattr(second_moment_module, "world_size", lambda: 2)
    monkeypatch.setattr(second_moment_module, "rank", lambda: 1)
    monkeypatch.setattr(second_moment_module, "all_reduce_sum", all_reduce_sum)
    mask = torch.tensor([[True, True, True]])
    keep, moment = m2po_keep_mask(t64([[0.1, 0.5, 0.0]]), mask, torch.zeros(1, 3, dtype=torch.long), "token", 0.045)
    # all five: 0.04, 0 (weights 1, 2) and 0.01, 0.25, 0: mean 0.05; without 0.25: 0.01
    assert moment.item() == pytest.approx(0.05)
    assert keep.tolist() == [[True, False, True]]
    assert sent[0].tolist() == [0.0, 3.0]  # this rank's row count at its own index
    torch.testing.assert_close(sent[1], t64([[0.0, 0.0], [0.0, 0.0], [0.01, 1.0], [0.25, 1.0], [0.0, 1.0]]))


def test_m2po_keep_masks_over_micro_batches_of_different_lengths_cut_as_one_batch():
    first = (t64([[0.6, 0.1, 0.0]]), torch.tensor([[True, True, False]]), torch.tensor([[0, 0, -1]]))
    second = (t64([[0.2, 0.3], [0.0, 0.05]]), torch.tensor([[True, True], [False, True]]),
              torch.tensor([[0, 1], [-1, 0]]))
    masks, moment = m2po_keep_masks([first[0], second[0]], [first[1], second[1]], [first[2], second[2]], "token",
                                    0.04)
    # squares 0.36, 0.01, 0.04, 0.09, 0.0025: mean 0.1005; without 0.36: 0.0356 < 0.04
    assert moment.item() == pytest.approx(0.5025 / 5)
    assert [m.shape for m in masks] == [(1, 3), (2, 2)]
    assert masks[0].tolist() == [[False, True, False]]
    assert masks[1].tolist() == [[True, True], [False, True]]
    whole = m2po_whole_batch(logprobs=[first[0], second[0]], old_logprobs=[torch.zeros(1, 3, dtype=F64),
                                                                            torch.zeros(2, 2, dtype=F64)],
                             loss_mask=[first[1], second[1]], turn_ids=[first[2], second[2]],
                             config=AlgorithmConfig(m2_threshold=0.04))
    assert [w["keep"].tolist() for w in whole] == [m.tolist() for m in masks]
    assert whole[1]["second_moment"].item() == pytest.approx(0.5025 / 5)


@pytest.mark.parametrize("level", ["token", "turn", "sequence"])
def test_second_moment_keep_mask_stays_on_the_inputs_device(level, monkeypatch):
    from stppo_agent.algorithms import second_moment

    batch = _policy_batch()
    log_ratio = torch.where(batch["loss_mask"], (batch["logprobs"] - batch["old_logprobs"]).detach(), 0.0)
    args = (log_ratio, batch["loss_mask"], batch["turn_ids"], level, 0.05)
    keep, moment = second_moment.m2po_keep_mask(*args)
    assert 0 < int(keep.sum()) < int(batch["loss_mask"].sum())  # the cut binds: some kept, some dropped
    # as rank 0 of 2 whose peer has no rows: the concatenation's buffers are built too
    monkeypatch.setattr(second_moment, "world_size", lambda: 2)
    monkeypatch.setattr(second_moment, "rank", lambda: 0)
    nothing = torch.zeros(0, dtype=F64)
    with torch.device("meta"):
        got_keep, got_moment = second_moment.m2po_keep_mask(*args)
        empty = second_moment.keep_items(nothing, nothing, 0.05)
    assert got_keep.device.type == "cpu" and got_keep.tolist() == keep.tolist()
    torch.testing.assert_close(got_moment, moment, rtol=0, atol=0)
    assert empty.device.type == "cpu" and empty.dtype == torch.bool and empty.numel() == 0
