"""``stppo_agent.rollouts.statistics``: a rollout batch's share of the statistics, and the shares combined over
ranks (the rules in ``stppo_agent.algorithms.metrics``), each statistic weighted by its own population."""

from __future__ import annotations

import math
import types
from types import SimpleNamespace

import pytest
import torch

from stppo_agent.algorithms.metrics import combine_rollout_statistics
from stppo_agent.distributed import process_group
from stppo_agent.rollouts import statistics
from stppo_agent.rollouts.batch import RolloutBatch
from stppo_agent.rollouts.statistics import rollout_parts, rollout_statistics, rollout_weights


def two_ranks(monkeypatch, others):
    """This process plays rank 0 of a world whose other ranks gathered ``others``."""
    monkeypatch.setattr(process_group, "world_size", lambda: 1 + len(others))
    monkeypatch.setattr(process_group, "all_gather_objects", lambda local: [local, *others])


# -- statistics ----------------------------------------------------------------------------------------------------

def scored(stats, loss_mask, old=None, sample=None, turn_ids=None):
    rows, width = loss_mask.shape
    zeros = torch.zeros(rows, width)
    return RolloutBatch(
        input_ids=torch.zeros(rows, width + 1, dtype=torch.long), attention_mask=torch.ones(rows, width + 1),
        prompt_width=1, response_ids=torch.zeros(rows, width, dtype=torch.long), loss_mask=loss_mask,
        turn_ids=turn_ids if turn_ids is not None else torch.zeros(rows, width, dtype=torch.long),
        sample_logprobs=sample if sample is not None else zeros, rewards=torch.zeros(rows),
        group_ids=torch.arange(rows), terminated=torch.zeros(rows, dtype=torch.bool),
        truncated=torch.zeros(rows, dtype=torch.bool), stats=stats, old_logprobs=old)


def test_statistics_one_process_reports_its_own_stats_as_a_copy():
    stats = {"reward": 0.5, "turns": 2.0}
    batch = scored(stats, torch.ones(2, 3, dtype=torch.bool))
    out = rollout_statistics(batch, None)
    assert out == stats and out is not stats


def test_statistics_rollout_parts_count_populations():
    stats = {"reward": 0.5, "turns": 2.5, "search_calls": 1.0, "search_errors": 0.5,
             "rollout_correction/weight_p99": 3.0}
    mask = torch.tensor([[True, True, False], [True, False, False]])
    old = torch.tensor([[0.0, -1.0, 0.0], [30.0, 0.0, 0.0]])
    sample = torch.tensor([[-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    batch = scored(stats, mask, old, sample)
    parts = rollout_parts(batch, types.SimpleNamespace(rollout_correction_level="token"))
    assert parts["stats"] == stats and parts["stats"] is not stats
    assert parts["trajectories"] == 2.0 and parts["policy_tokens"] == 3.0 and parts["turns"] == 5.0
    assert parts["searches"] == 3.0
    assert parts["weights"].tolist() == pytest.approx([math.e, math.exp(-1), math.exp(20)], rel=1e-5)
    # sequence level: one geometric-mean weight per row, repeated on each of its tokens
    seq = rollout_weights(batch, "sequence")
    assert seq.tolist() == pytest.approx([1.0, 1.0, math.exp(20)], rel=1e-5)
    assert rollout_weights(scored({}, mask, -old, sample * 0), "token").tolist() == pytest.approx(
        [1.0, math.e, math.exp(-20)], rel=1e-5)
    # no p99 statistic, or no old log-probs: no weights
    assert "weights" not in rollout_parts(scored({"reward": 1.0}, mask, old, sample), None)
    assert "weights" not in rollout_parts(scored(stats, mask, None, sample), None)
    assert rollout_parts(scored({}, mask), None)["turns"] == 0.0


def test_statistics_search_attempts_from_new_and_old_statistics():
    attempts = statistics._search_attempts
    assert attempts({"search_calls": 1.5, "search_errors": 0.5}, 4) == 8.0
    assert attempts({"search_calls": 1.5}, 4) == 6.0  # an old batch without failures
    assert attempts({"search_calls": 1.5, "search_error_rate": 0.25}, 4) == pytest.approx(8.0)
    # every search failed: bounded by the turns that were neither invalid nor an answer
    bound = attempts({"search_calls": 0.0, "search_error_rate": 1.0, "turns": 3.0, "invalid_action_rate": 0.25,
                      "answer_rate": 0.5}, 4)
    assert bound == pytest.approx(12 * 0.75 - 2)
    assert attempts({"search_error_rate": 1.0, "turns": 0.5}, 2) == 1.0  # at least one
    assert attempts({"search_error_rate": 1.0, "turns": 2.0}, 2) == 4.0
    assert attempts({}, 3) == 0.0
    assert attempts({"search_error_rate": 1.0}, 2) == 1.0  # no turns recorded: still at least one


def test_statistics_combine_weights_each_statistic_by_its_population():
    def share(stats, trajectories, policy_tokens, turns, searches, **extra):
        return dict(stats=stats, trajectories=trajectories, policy_tokens=policy_tokens, turns=turns,
                    searches=searches, **extra)

    shares = [
        share({"reward": 1.0, "invalid_action_rate": 0.5, "search_error_rate": 0.0, "kl_to_reference": 0.2,
               "rollout_correction/weight_max": 2.0, "custom": 4.0}, 2.0, 10.0, 4.0, 1.0),
        share({"reward": 0.0, "invalid_action_rate": 0.0, "search_error_rate": 1.0, "kl_to_reference": 0.8,
               "rollout_correction/weight_max": 5.0, "custom": 1.0}, 6.0, 30.0, 12.0, 3.0),
        share({"reward": 0.5}, 0.0, 0.0, 0.0, 0.0),  # an empty share
    ]
    out = combine_rollout_statistics(shares)
    assert out == pytest.approx({"reward": 0.25, "invalid_action_rate": 0.125, "search_error_rate": 0.75,
                                 "kl_to_reference": 0.65, "rollout_correction/weight_max": 5.0, "custom": 1.75})
    # a statistic only some shares have is weighted by theirs; nobody's population: 0
    out = combine_rollout_statistics([share({"kl_to_reference": 0.4}, 1.0, 5.0, 1.0, 0.0),
                                      share({}, 1.0, 15.0, 1.0, 0.0)])
    assert out == {"kl_to_reference": pytest.approx(0.4)}
    assert combine_rollout_statistics([share({"kl_to_reference": 0.4}, 1.0, 0.0, 1.0, 0.0)]) == {
        "kl_to_reference": 0.0}
    assert combine_rollout_statistics([share({"reward": 0.5}, 1.0, 0.0, 0.0, 0.0)]) == {"reward": 0.5}


def test_statistics_p99_of_the_weights_and_the_max_without_them():
    weights = [torch.arange(1.0, 101.0), torch.arange(101.0, 201.0)]
    shares = [dict(stats={"rollout_correction/weight_p99": 1.0}, weights=w) for w in weights]
    out = combine_rollout_statistics(shares)["rollout_correction/weight_p99"]
    assert out == pytest.approx(float(torch.quantile(torch.arange(1.0, 201.0).double(), 0.99)))
    no_weights = [dict(stats={"rollout_correction/weight_p99": v}) for v in (3.0, 7.0, 5.0)]
    assert combine_rollout_statistics(no_weights)["rollout_correction/weight_p99"] == 7.0


def test_statistics_pooled_std_equals_the_std_over_all_tokens():
    parts = [torch.tensor([1.0, 2.0, 4.0]), torch.tensor([-3.0, 0.5]), torch.tensor([7.0])]

    def share(x):
        std = float(x.std()) if x.numel() > 1 else 0.0
        return dict(stats={"advantage/mean": float(x.mean()), "advantage/std": std}, policy_tokens=float(x.numel()))

    out = combine_rollout_statistics([share(x) for x in parts])
    assert out["advantage/std"] == pytest.approx(float(torch.cat(parts).std()), rel=1e-6)
    assert out["advantage/mean"] == pytest.approx(float(torch.cat(parts).mean()), rel=1e-6)
    # an empty share (no policy tokens, nan std) adds nothing; a single token has no spread
    empty = dict(stats={"advantage/std": 5.0}, policy_tokens=0.0)
    assert combine_rollout_statistics([share(parts[0]), empty])["advantage/std"] == pytest.approx(
        float(parts[0].std()), rel=1e-6)
    assert combine_rollout_statistics([share(parts[2])])["advantage/std"] == 0.0
    two = [dict(stats={"advantage/std": 0.0, "advantage/mean": 1.0}, policy_tokens=1.0),
           dict(stats={"advantage/std": 0.0, "advantage/mean": 3.0}, policy_tokens=1.0)]
    assert combine_rollout_statistics(two)["advantage/std"] == pytest.approx(math.sqrt(2.0))
    close = [dict(stats={"advantage/std": 0.0, "advantage/mean": 1.0}, policy_tokens=1.0),
             dict(stats={"advantage/std": 0.0, "advantage/mean": 1.2}, policy_tokens=1.0)]
    assert combine_rollout_statistics(close)["advantage/std"] == pytest.approx(math.sqrt(0.02))
    # a share without a mean counts as mean 0
    nomean = [dict(stats={"advantage/std": 1.0}, policy_tokens=2.0),
              dict(stats={"advantage/std": 1.0, "advantage/mean": 2.0}, policy_tokens=2.0)]
    assert combine_rollout_statistics(nomean)["advantage/std"] == pytest.approx(math.sqrt((1 + 1 + 8 - 4) / 3))


def test_statistics_rollout_statistics_over_ranks(monkeypatch):
    mask = torch.tensor([[True, True], [True, False]])
    mine = scored({"reward": 1.0, "turns": 1.0, "search_calls": 1.0, "search_errors": 0.0,
                   "search_error_rate": 0.0}, mask)
    other = rollout_parts(scored({"reward": 0.0, "turns": 3.0, "search_calls": 0.0, "search_errors": 2.0,
                                  "search_error_rate": 1.0}, torch.ones(2, 2, dtype=torch.bool)), None)
    two_ranks(monkeypatch, [other])
    out = rollout_statistics(mine, None)
    assert out == pytest.approx({"reward": 0.5, "turns": 2.0, "search_calls": 0.5, "search_errors": 1.0,
                                 "search_error_rate": 4 / 6})
    # the 99th percentile of the weights at the algorithm's level, over both ranks' tokens
    weighted = scored({"rollout_correction/weight_p99": 0.0}, mask, torch.zeros(2, 2), torch.full((2, 2), -1.0))
    other = dict(stats={"rollout_correction/weight_p99": 0.0}, weights=torch.ones(3))
    two_ranks(monkeypatch, [other])
    out = rollout_statistics(weighted, types.SimpleNamespace(rollout_correction_level="token"))
    assert out["rollout_correction/weight_p99"] == pytest.approx(math.e, rel=1e-5)


def _share(**stats) -> SimpleNamespace:
    return SimpleNamespace(stats=stats, batch_size=4, loss_mask=torch.ones(4, 3, dtype=torch.bool), old_logprobs=None)


def test_turns_and_observations_are_totals_and_zero_when_unrecorded():
    parts = rollout_parts(_share(turns=2.5, observations=1.5), None)
    assert parts["trajectories"] == 4.0 and parts["policy_tokens"] == 12.0
    assert parts["turns"] == 10.0 and parts["observations"] == 6.0
    old = rollout_parts(_share(), None)
    assert old["turns"] == 0.0 and old["observations"] == 0.0 and old["searches"] == 0.0
