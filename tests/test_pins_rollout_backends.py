"""Pins of the rollout backends (issue 27, slice G): sampling settings and the scoring distribution, behaviour
log-probs of exactly the generated tokens, KV-cache reuse across turns, batching and padding, per-turn and
cross-rank statistics, the global batch. Test names start with the module they guard (``-k statistics``).

Tiny models only (a 2-layer random Llama over a 9-word vocabulary, built in memory once), no subprocess."""

from __future__ import annotations

import math
import types
import warnings

import pytest
import torch

from stppo_agent.algorithms.metrics import LossMetrics, StepMetrics, combine_rollout_statistics
from stppo_agent.algorithms.registry import accepts_keyword
from stppo_agent.distributed import process_group
from stppo_agent.models.tiny import tiny_generation_model
from stppo_agent.rollouts import append_cache, hf_generation, statistics
from stppo_agent.rollouts import sampling as sampling_module
from stppo_agent.rollouts.append_cache import AppendLayer, new_cache
from stppo_agent.rollouts.batch import RolloutBatch, Trajectory, left_pad, to_batch
from stppo_agent.rollouts.episode_stats import episode_rates
from stppo_agent.rollouts.generation import generated_length
from stppo_agent.rollouts.global_batch import gather_global_batch, merge_shares, mini_batch_rows
from stppo_agent.rollouts.hf_generation import HFGenerationBackend, StopOnStrings, _eos_ids, stop_candidate_ids
from stppo_agent.rollouts.sampling import (
    PROCESSOR_DEFAULTS,
    SamplingSettings,
    generation_config,
    ignored_checkpoint_settings,
    project_generation,
    sampling_logits,
    support_threshold,
    warn_ignored_checkpoint_settings,
)
from stppo_agent.rollouts.statistics import rollout_parts, rollout_statistics, rollout_weights
from stppo_agent.rollouts.turn_cache import ChunkCache, TurnCaches, after_generate, extend_inputs


def two_ranks(monkeypatch, others):
    """This process plays rank 0 of a world whose other ranks gathered ``others``."""
    monkeypatch.setattr(process_group, "world_size", lambda: 1 + len(others))
    monkeypatch.setattr(process_group, "all_gather_objects", lambda local: [local, *others])


# -- episode_stats -------------------------------------------------------------------------------------------------

def episode(turns=0, invalid_actions=0, search_calls=0, search_errors=0, answered=False):
    return dict(turns=turns, invalid_actions=invalid_actions, search_calls=search_calls,
                search_errors=search_errors, answered=answered)


def test_episode_stats_rates_are_per_episode_turn_and_attempted_search():
    rates = episode_rates([episode(3, 1, 2, 1, True), episode(5, 2, 0, 3, False), episode(2, 0, 4, 0, 1)])
    assert rates == pytest.approx({"answer_rate": 2 / 3, "invalid_action_rate": 3 / 10,
                                   "search_error_rate": 4 / 10})
    assert episode_rates([]) == {"answer_rate": 0.0, "invalid_action_rate": 0.0, "search_error_rate": 0.0}
    # no turn, no search: the rates are 0, not a division by zero
    assert episode_rates([episode()]) == {"answer_rate": 0.0, "invalid_action_rate": 0.0, "search_error_rate": 0.0}
    one = episode_rates([episode(1, 1, 0, 1, True)])
    assert one == {"answer_rate": 1.0, "invalid_action_rate": 1.0, "search_error_rate": 1.0}


# -- batch ---------------------------------------------------------------------------------------------------------

def test_batch_left_pad_puts_the_padding_on_the_left():
    ids, mask = left_pad([[5, 6, 7], [8], []], 0, "cpu")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]
    assert ids.dtype == torch.long and mask.dtype == torch.long
    ids, mask = left_pad([[4], [3, 2]], 9, "cpu")
    assert ids.tolist() == [[9, 4], [3, 2]] and mask.tolist() == [[0, 1], [1, 1]]


def test_batch_trajectory_append_records_roles_turns_and_logprobs():
    t = Trajectory(env=None, group_id=3, prompt_ids=[1, 2])
    assert (t.response_ids, t.policy_mask, t.turn_ids, t.sample_logprobs) == ([], [], [], [])
    assert (t.reward, t.done, t.terminated, t.truncated, t.finish_reason) == (0.0, False, False, False, "")
    assert (t.turns, t.search_calls, t.invalid_actions, t.search_errors, t.answered, t.info) == (0, 0, 0, 0, False, {})
    t.append([7, 8], policy=True, turn=0, logprobs=[-0.5, -1.5])
    t.append([9], policy=False, turn=0)
    t.append([4], policy=True, turn=1)
    assert t.response_ids == [7, 8, 9, 4]
    assert t.policy_mask == [True, True, False, True]
    assert t.turn_ids == [0, 0, -1, 1]
    assert t.sample_logprobs == [-0.5, -1.5, 0.0, 0.0]
    t.turns, t.invalid_actions, t.search_calls, t.search_errors, t.answered = 2, 1, 3, 4, True
    assert t.counters() == {"turns": 2, "invalid_actions": 1, "search_calls": 3, "search_errors": 4, "answered": True}
    other = Trajectory(env=None, group_id=0, prompt_ids=[])
    assert other.response_ids == [] and other.info == {}  # fresh lists, not shared with ``t``


def trajectories():
    a = Trajectory(env=None, group_id=1, prompt_ids=[11, 12, 13], info={"example_id": "a"})
    a.append([21, 22], policy=True, turn=0, logprobs=[-0.25, -0.75])
    a.append([31], policy=False, turn=0)
    a.append([23], policy=True, turn=1, logprobs=[-2.0])
    a.reward, a.turns, a.search_calls, a.search_errors, a.invalid_actions = 1.0, 2, 1, 0, 0
    a.answered, a.terminated, a.finish_reason = True, True, "answer"
    a.observations, a.observations_cut = 1, 1
    b = Trajectory(env=None, group_id=0, prompt_ids=[14], info={"example_id": "b"})
    b.append([24], policy=True, turn=0, logprobs=[-1.0])
    b.reward, b.turns, b.search_calls, b.search_errors, b.invalid_actions = -0.5, 3, 0, 2, 1
    b.truncated, b.finish_reason = True, "max_total_tokens"
    b.observations, b.observations_cut = 3, 0
    return [a, b]


def test_batch_to_batch_left_pads_prompts_right_pads_responses_and_averages_the_stats():
    batch = to_batch(trajectories(), pad_id=0)
    assert batch.prompt_width == 3 and batch.batch_size == 2
    assert batch.input_ids.tolist() == [[11, 12, 13, 21, 22, 31, 23], [0, 0, 14, 24, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0, 0]]
    assert batch.response_ids.tolist() == [[21, 22, 31, 23], [24, 0, 0, 0]]
    assert batch.loss_mask.tolist() == [[True, True, False, True], [True, False, False, False]]
    assert batch.turn_ids.tolist() == [[0, 0, -1, 1], [0, -1, -1, -1]]
    assert batch.sample_logprobs.tolist() == [[-0.25, -0.75, 0.0, -2.0], [-1.0, 0.0, 0.0, 0.0]]
    assert batch.sample_logprobs.dtype == torch.float32 and batch.loss_mask.dtype == torch.bool
    assert batch.input_ids.dtype == batch.attention_mask.dtype == batch.turn_ids.dtype == torch.long
    assert batch.rewards.tolist() == [1.0, -0.5] and batch.rewards.dtype == torch.float32
    assert batch.group_ids.tolist() == [1, 0] and batch.group_ids.dtype == torch.long
    assert batch.terminated.tolist() == [True, False] and batch.truncated.tolist() == [False, True]
    assert batch.episode_info == [{"example_id": "a", "finish_reason": "answer"},
                                  {"example_id": "b", "finish_reason": "max_total_tokens"}]
    assert batch.stats == pytest.approx({
        "reward": 0.25, "response_tokens": 2.0, "turns": 2.5, "search_calls": 0.5, "search_errors": 1.0,
        "answer_rate": 0.5, "invalid_action_rate": 0.2, "search_error_rate": 2 / 3,
        "truncated_max_total_tokens": 0.5, "observations": 2.0,
        "observation_cut_rate": 0.25})  # cut observations over all observations, not a mean of per-row shares
    assert batch.old_logprobs is None and batch.ref_logprobs is None and batch.values is None
    assert batch.lengths().tolist() == [7, 2]


def test_batch_to_batch_of_empty_responses_keeps_one_column():
    t = Trajectory(env=None, group_id=0, prompt_ids=[5, 6])
    batch = to_batch([t], pad_id=3)
    assert batch.response_ids.tolist() == [[3]] and batch.loss_mask.tolist() == [[False]]
    assert batch.turn_ids.tolist() == [[-1]] and batch.input_ids.tolist() == [[5, 6, 3]]
    assert batch.attention_mask.tolist() == [[1, 1, 0]] and batch.attention_mask.dtype == torch.long
    assert batch.stats["truncated_max_total_tokens"] == 0.0 and batch.stats["response_tokens"] == 0.0
    t.reward = 1  # an env that pays whole numbers: the rewards are still float
    assert to_batch([t], pad_id=3).rewards.dtype == torch.float32


def test_batch_select_indexes_tensors_and_lists_and_keeps_the_stats():
    batch = to_batch(trajectories(), pad_id=0)
    batch.old_logprobs = torch.tensor([[1.0, 2, 3, 4], [5, 6, 7, 8]])
    one = batch.select([1])
    assert one.response_ids.tolist() == [[24, 0, 0, 0]] and one.rewards.tolist() == [-0.5]
    assert one.old_logprobs.tolist() == [[5, 6, 7, 8]] and one.episode_info == [batch.episode_info[1]]
    assert one.stats is batch.stats and one.prompt_width == 3 and one.ref_logprobs is None
    swapped = batch.select(torch.tensor([1, 0]))
    assert swapped.group_ids.tolist() == [0, 1] and swapped.episode_info[0]["example_id"] == "b"
    moved = batch.to("cpu")
    assert torch.equal(moved.input_ids, batch.input_ids) and moved.stats == batch.stats


def test_batch_trimmed_drops_only_the_columns_no_row_uses():
    batch = to_batch(trajectories(), pad_id=0)
    assert batch.trimmed() is batch  # every column used
    short = batch.select([1]).trimmed()  # prompt [14], response [24]
    assert short.prompt_width == 1
    assert short.input_ids.tolist() == [[14, 24]] and short.attention_mask.tolist() == [[1, 1]]
    assert short.response_ids.tolist() == [[24]] and short.loss_mask.tolist() == [[True]]
    assert short.turn_ids.tolist() == [[0]] and short.sample_logprobs.tolist() == [[-1.0]]
    assert short.rewards.tolist() == [-0.5] and short.stats == batch.stats
    # a prompt-less row: the last prompt column stays (it predicts the first response token)
    empty = to_batch([Trajectory(env=None, group_id=0, prompt_ids=[5, 6])], 0)
    empty.attention_mask[:, :2] = 0
    cut = empty.trimmed()
    assert cut.prompt_width == 1 and cut.input_ids.shape == (1, 2)
    # wider prompt than response: left cut only
    b = Trajectory(env=None, group_id=0, prompt_ids=[7, 8])
    b.append([9, 10], policy=True, turn=0)
    c = Trajectory(env=None, group_id=0, prompt_ids=[7])
    c.append([9], policy=True, turn=0)
    both = to_batch([b, c], 0).select([1]).trimmed()
    assert both.prompt_width == 1 and both.input_ids.tolist() == [[7, 9]] and both.response_ids.tolist() == [[9]]
    right_only = to_batch([b, c], 0)
    right_only.attention_mask[:, 3] = 0
    right = right_only.trimmed()
    assert right.prompt_width == 2 and right.input_ids.tolist() == [[7, 8, 9], [0, 7, 9]]


# -- statistics ----------------------------------------------------------------------------------------------------

def test_statistics_step_metrics_weight_plain_values_by_policy_tokens():
    step = StepMetrics()
    step.add({"pg_loss": torch.tensor(1.0)}, torch.tensor(2))
    step.add({"pg_loss": torch.tensor(4.0)}, torch.tensor(1))
    assert step.reduce() == {"pg_loss": pytest.approx(2.0)}


def test_statistics_step_metrics_add_sums_and_keep_extremes():
    def micro(total, count, high, low):
        m = LossMetrics()
        m.mean("clip_frac", torch.tensor(total), torch.tensor(count))
        m.extreme("ratio_max", torch.tensor(high), "max")
        m.extreme("ratio_min", torch.tensor(low), "min")
        m.summed("double", torch.tensor(0.0), torch.tensor([total, count]), lambda s: 2 * s[0] / s[1])
        return m

    step = StepMetrics()
    step.add(micro(1.0, 4.0, 1.5, 0.5), torch.tensor(4))
    step.add(micro(3.0, 4.0, 1.2, 0.8), torch.tensor(4))
    step.add(micro(0.0, 2.0, 2.5, 0.1), torch.tensor(2))
    out = step.reduce()
    assert list(out) == sorted(out)
    assert out == pytest.approx({"clip_frac": 0.4, "ratio_max": 2.5, "ratio_min": 0.1, "double": 0.8})


def test_statistics_step_metrics_combine_ranks_in_order(monkeypatch):
    # value_loss: a metric only the other rank reported (its finish: the ratio of the sums)
    other_sums = {"clip_frac": torch.tensor([3.0, 4.0], dtype=torch.float64),
                  "value_loss": torch.tensor([3.0, 2.0], dtype=torch.float64)}
    other_extremes = {"ratio_max": torch.tensor(9.0, dtype=torch.float64),
                      "ratio_min": torch.tensor(-1.0, dtype=torch.float64)}
    two_ranks(monkeypatch, [(other_sums, other_extremes, {"ratio_max": "max", "ratio_min": "min"})])
    m = LossMetrics()
    m.mean("clip_frac", torch.tensor(1.0), torch.tensor(2.0))
    m.extreme("ratio_max", torch.tensor(3.0), "max")
    m.extreme("ratio_min", torch.tensor(0.5), "min")
    step = StepMetrics()
    step.add(m, torch.tensor(2))
    assert step.reduce() == pytest.approx({"clip_frac": 4 / 6, "ratio_max": 9.0, "ratio_min": -1.0,
                                           "value_loss": 1.5})
    # the other way round: this rank holds the extremes
    two_ranks(monkeypatch, [({}, {"ratio_max": torch.tensor(1.0, dtype=torch.float64),
                                  "ratio_min": torch.tensor(2.0, dtype=torch.float64)},
                             {"ratio_max": "max", "ratio_min": "min"})])
    assert step.reduce() == pytest.approx({"clip_frac": 0.5, "ratio_max": 3.0, "ratio_min": 0.5})


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


# -- global_batch --------------------------------------------------------------------------------------------------

def share_batch(groups, prompts, responses, pad=0, **extra):
    ts = []
    for g, p, r in zip(groups, prompts, responses):
        t = Trajectory(env=None, group_id=g, prompt_ids=p)
        t.append(r, policy=True, turn=0, logprobs=[-1.0] * len(r))
        ts.append(t)
    batch = to_batch(ts, pad)
    for key, value in extra.items():
        setattr(batch, key, value)
    return batch


def test_global_batch_merge_pads_prompts_left_responses_right_and_sorts_by_group():
    a = share_batch([0, 2], [[5, 6], [7]], [[8], [9, 9]], pad=1)
    b = share_batch([1], [[4, 4, 4]], [[3, 3, 3]], pad=1)
    stats = {"reward": 0.0}
    merged = merge_shares([a, b], 1, stats)
    assert merged.stats is stats and merged.prompt_width == 3
    assert merged.group_ids.tolist() == [0, 1, 2]
    assert merged.input_ids.tolist() == [[1, 5, 6, 8, 1, 1], [4, 4, 4, 3, 3, 3], [1, 1, 7, 9, 9, 1]]
    assert merged.attention_mask.tolist() == [[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0]]
    assert merged.response_ids.tolist() == [[8, 1, 1], [3, 3, 3], [9, 9, 1]]
    assert merged.turn_ids.tolist() == [[0, -1, -1], [0, 0, 0], [0, 0, -1]]
    assert merged.loss_mask.tolist() == [[True, False, False], [True, True, True], [True, True, False]]
    assert merged.sample_logprobs.tolist() == [[-1.0, 0.0, 0.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, 0.0]]
    assert merged.old_logprobs is None and merged.episode_info == [{"finish_reason": ""}] * 3
    assert merged.rewards.tolist() == [0.0, 0.0, 0.0]
    assert merged.loss_mask.dtype == torch.bool and merged.turn_ids.dtype == torch.long  # padding keeps dtypes
    assert merged.sample_logprobs.dtype == torch.float32 and merged.input_ids.dtype == torch.long
    # more rows than response columns; a single share (replay of a one-process recording)
    wide = merge_shares([share_batch([0, 1, 2], [[5]] * 3, [[7]] * 3), share_batch([3], [[5]], [[7, 7, 7]])], 0, {})
    assert wide.response_ids.tolist() == [[7, 0, 0]] * 3 + [[7, 7, 7]]
    alone = merge_shares([b], 1, {})
    assert torch.equal(alone.input_ids, b.input_ids) and torch.equal(alone.loss_mask, b.loss_mask)


def test_global_batch_merge_keeps_rank_order_within_a_group_and_refuses_half_set_fields():
    a = share_batch([0, 0], [[5], [6]], [[1], [2]])
    b = share_batch([0], [[7]], [[3]])
    merged = merge_shares([a, b], 0, {})
    assert merged.response_ids[:, 0].tolist() == [1, 2, 3]  # stable: the shares' order
    groups = [(3 * i) % 4 for i in range(24)]  # enough rows for an unstable sort to reorder equal keys
    first = share_batch(groups[:14], [[5]] * 14, [[i] for i in range(14)])
    second = share_batch(groups[14:], [[5]] * 10, [[i] for i in range(14, 24)])
    order = merge_shares([first, second], 0, {}).response_ids[:, 0].tolist()
    assert order == sorted(range(24), key=lambda i: groups[i])
    a.old_logprobs = torch.zeros(2, 1)
    with pytest.raises(ValueError, match="old_logprobs is set on some ranks' batches and not on others"):
        merge_shares([a, b], 0, {})
    b.old_logprobs = torch.ones(1, 1)
    assert merge_shares([a, b], 0, {}).old_logprobs.tolist() == [[0.0], [0.0], [1.0]]


def test_global_batch_gather_runs_one_collective_and_returns_this_ranks_stats(monkeypatch):
    a = share_batch([1], [[5]], [[6]])
    a.stats = {"reward": 1.0}
    b = share_batch([0], [[7, 7]], [[8, 8]])
    monkeypatch.setattr(process_group, "all_gather_objects", lambda local: [local, b])
    merged = gather_global_batch(a, pad_id=0)
    assert merged.group_ids.tolist() == [0, 1] and merged.stats == {"reward": 1.0}
    assert merged.stats is not a.stats
    assert merged.input_ids.tolist() == [[7, 7, 8, 8], [0, 5, 6, 0]]


def test_global_batch_mini_batch_rows_are_every_world_th_row():
    order = torch.tensor([9, 8, 7, 6, 5, 4, 3, 2])
    assert mini_batch_rows(order, 2, 4, 0, 2).tolist() == [7, 5]
    assert mini_batch_rows(order, 2, 4, 1, 2).tolist() == [6, 4]
    assert mini_batch_rows(order, 0, 8, 2, 4).tolist() == [7, 3]
    assert mini_batch_rows(order, 4, 4, 0, 1).tolist() == [5, 4, 3, 2]


# -- generation ----------------------------------------------------------------------------------------------------

class CharTokenizer:
    """One character per token id (decode joins them); ids >= 100 are special and hidden when asked."""

    def decode(self, ids, skip_special_tokens):
        return "".join("" if (skip_special_tokens and i >= 100) else chr(i % 100 + 32) for i in ids)


def chars(text):
    return [ord(c) - 32 for c in text]


def test_generation_length_ends_at_eos_or_at_the_token_that_completes_a_stop_string():
    tok = CharTokenizer()
    ids = chars("ab</answer>cd")
    assert generated_length(ids, tok, ("</answer>",), []) == 11
    assert generated_length(ids, tok, ("</search>", "</answer>"), []) == 11
    assert generated_length(ids, tok, ("</search>",), []) == 13  # no stop string: all of it
    assert generated_length(ids, tok, (), [ord("c") - 32]) == 12  # through the EOS
    assert generated_length(ids, tok, ("</answer>",), [ord("b") - 32]) == 2  # EOS first
    assert generated_length(ids, tok, (), []) == 13
    assert generated_length(chars(">"), tok, (">",), []) == 1
    assert generated_length(chars("x>y"), tok, (">",), []) == 2
    assert generated_length(chars("xy>"), tok, (">",), []) == 3
    # a stop string made with a special token still counts (the text is decoded with special tokens)
    assert generated_length([ord("<") - 32, 100 + ord("/") - 32, ord(">") - 32, 5], tok, ("</>",), []) == 3


def test_generation_accepts_keyword_names_or_kwargs():
    def named(contexts, max_new_tokens, keys=None):
        pass

    def wrapper(*args, **kwargs):
        pass

    def positional(*args):
        pass

    assert accepts_keyword(named, "keys") and accepts_keyword(wrapper, "keys")
    assert not accepts_keyword(positional, "keys") and not accepts_keyword(named, "key")


# -- sampling ------------------------------------------------------------------------------------------------------


INF = float("inf")


def test_sampling_settings_defaults_and_what_they_reshape():
    plain = SamplingSettings()
    assert (plain.temperature, plain.top_p, plain.greedy, plain.top_k) == (1.0, 1.0, False, 0)
    assert not plain.truncates and not plain.reshapes
    assert SamplingSettings(top_p=0.9).truncates and SamplingSettings(top_p=0.9).reshapes
    assert SamplingSettings(top_k=1).truncates and SamplingSettings(top_k=1).reshapes
    assert not SamplingSettings(temperature=0.5).truncates and SamplingSettings(temperature=0.5).reshapes
    assert SamplingSettings(temperature=1.5).reshapes
    greedy = SamplingSettings(greedy=True, temperature=0.5, top_p=0.5, top_k=3)
    assert not greedy.truncates and not greedy.reshapes


def test_sampling_settings_refuse_what_sampling_cannot_mean():
    with pytest.raises(ValueError, match=r"temperature must be > 0 when sampling, got 0 \(0 means greedy\)"):
        SamplingSettings(temperature=0)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        SamplingSettings(temperature=-1.0)
    SamplingSettings(temperature=0, greedy=True)  # greedy needs no temperature
    SamplingSettings(temperature=1e-3)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0"):
        SamplingSettings(top_p=0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.01"):
        SamplingSettings(top_p=1.01)
    SamplingSettings(top_p=1.0)
    SamplingSettings(top_p=1e-6)
    with pytest.raises(ValueError, match=r"top_k must be >= 0 \(0: off\), got -1"):
        SamplingSettings(top_k=-1)
    SamplingSettings(top_k=0)


def kept(logits: torch.Tensor) -> list[int]:
    return torch.isfinite(logits).nonzero().flatten().tolist()


def test_sampling_logits_are_the_raw_ones_without_reshaping_and_divided_by_the_temperature_once():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    tokens = torch.tensor([0])
    assert sampling_logits(logits, tokens, None) is logits
    assert sampling_logits(logits, tokens, SamplingSettings()) is logits
    assert sampling_logits(logits, tokens, SamplingSettings(greedy=True, temperature=0.5)) is logits
    assert torch.equal(sampling_logits(logits, tokens, SamplingSettings(temperature=0.5)), logits * 2)
    assert torch.equal(sampling_logits(logits, tokens, SamplingSettings(temperature=2.0)), logits / 2)
    # temperature and top-p: the nucleus of the *scaled* distribution, kept logits scaled once
    out = sampling_logits(logits, torch.tensor([3]), SamplingSettings(temperature=0.5, top_p=0.9))
    assert kept(out[0]) == [2, 3] and out[0, 2:].tolist() == [4.0, 6.0]
    # at temperature 1 the nucleus of 0.9 holds three tokens
    assert kept(sampling_logits(logits, torch.tensor([3]), SamplingSettings(top_p=0.9))[0]) == [1, 2, 3]


def test_sampling_nucleus_is_the_smallest_set_above_top_p_and_the_sampled_token_stays():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])  # probabilities .032 .087 .237 .644
    top = torch.tensor([3])
    assert kept(sampling_logits(logits, top, SamplingSettings(top_p=0.7))[0]) == [2, 3]
    assert kept(sampling_logits(logits, top, SamplingSettings(top_p=0.5))[0]) == [3]
    assert kept(sampling_logits(logits, top, SamplingSettings(top_p=0.99))[0]) == [0, 1, 2, 3]
    out = sampling_logits(logits, torch.tensor([0]), SamplingSettings(top_p=0.5))
    assert out[0].tolist() == [0.0, -INF, -INF, 3.0]  # the sampled token keeps its logit
    # a cumulative probability exactly 1 - top_p is outside the nucleus (transformers' and vLLM's <=)
    ascending = torch.sort(logits[0]).values.softmax(-1).cumsum(-1)
    top_p = 1 - float(ascending[1])
    assert bool(ascending[1] <= 1 - top_p)
    assert support_threshold(logits, SamplingSettings(top_p=top_p)).tolist() == [2.0]
    assert kept(sampling_logits(logits, top, SamplingSettings(top_p=top_p))[0]) == [2, 3]


def test_sampling_top_k_keeps_the_k_largest_and_ties_with_the_kth():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    top = torch.tensor([3])
    assert kept(sampling_logits(logits, top, SamplingSettings(top_k=2))[0]) == [2, 3]
    assert kept(sampling_logits(logits, top, SamplingSettings(top_k=1))[0]) == [3]
    assert kept(sampling_logits(logits, top, SamplingSettings(top_k=10))[0]) == [0, 1, 2, 3]  # k > vocabulary
    assert kept(sampling_logits(logits, top, SamplingSettings(top_k=4))[0]) == [0, 1, 2, 3]
    tied = torch.tensor([[3.0, 2.0, 2.0, 1.0]])
    assert kept(sampling_logits(tied, torch.tensor([0]), SamplingSettings(top_k=2))[0]) == [0, 1, 2]
    assert support_threshold(tied, SamplingSettings(top_k=3)).tolist() == [2.0]
    rows = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0], [5.0, 5.0, 4.0, 6.0]])
    assert support_threshold(rows, SamplingSettings(top_k=2)).tolist() == [2.0, 2.0, 5.0]
    # top-k alone keeps the k-th token even where its probability underflows to 0 in float32
    far = torch.tensor([[100.0, -100.0, -1000.0]])
    assert kept(sampling_logits(far, torch.tensor([0]), SamplingSettings(top_k=2))[0]) == [0, 1]
    # top-k and top-p: the nucleus of what top-k kept, renormalised (over all five: tokens 3 and 4)
    five = torch.tensor([[0.0, 1.0, 2.0, 3.0, 3.5]])
    assert kept(sampling_logits(five, torch.tensor([4]), SamplingSettings(top_k=3, top_p=0.53))[0]) == [4]
    assert kept(sampling_logits(five, torch.tensor([4]), SamplingSettings(top_p=0.53))[0]) == [3, 4]
    # ties with the k-th largest stay in what top-p sees
    tie5 = torch.tensor([[0.0, 2.0, 2.0, 3.0, 1.0]])
    assert kept(sampling_logits(tie5, torch.tensor([3]), SamplingSettings(top_k=2, top_p=0.99))[0]) == [1, 2, 3]


def test_sampling_truncates_double_precision_logits_at_their_own_precision():
    # 0.2 is not a float32: a threshold held in float32 would drop the k-th token itself
    logits = torch.tensor([[0.1, 0.2, 0.3]], dtype=torch.float64)
    out = sampling_logits(logits, torch.tensor([2]), SamplingSettings(top_k=2))
    assert kept(out[0]) == [1, 2] and out.dtype == torch.float64


def test_sampling_keeps_the_most_likely_token_at_a_tiny_top_p():
    # float32 probabilities that sum to just under 1: the largest must still be kept
    row = torch.tensor([[1.5409960746765137, -0.293428897857666, -2.1787893772125244, 0.5684312582015991,
                         -1.0845223665237427, -1.3985954523086548, 0.40334683656692505]])
    assert float(torch.sort(row[0]).values.softmax(-1).cumsum(-1)[-1]) < 1.0
    out = sampling_logits(row, torch.tensor([0]), SamplingSettings(top_p=1e-9))
    assert kept(out[0]) == [0]


def test_sampling_truncates_only_where_asked_and_in_chunks_of_rows():
    torch.manual_seed(0)
    logits = torch.randn(2, 300, 6)
    tokens = torch.randint(0, 6, (2, 300))
    settings = SamplingSettings(temperature=0.8, top_p=0.6, top_k=4)
    where = torch.rand(2, 300) < 0.5
    out = sampling_logits(logits, tokens, settings, where)
    scaled = logits / 0.8
    assert torch.equal(out[~where], scaled[~where])  # the other positions: scaled, not truncated
    for b, t in where.nonzero().tolist():
        one = sampling_logits(logits[b, t:t + 1], tokens[b, t:t + 1], settings)[0]
        assert torch.equal(out[b, t], one)
    assert bool(torch.isinf(out[where]).any())
    everywhere = sampling_logits(logits, tokens, settings)
    assert torch.equal(everywhere[where], out[where]) and bool(torch.isinf(everywhere[~where]).any())
    assert sampling_module.ROWS_PER_CHUNK == 256


def test_sampling_gradient_flows_through_the_kept_logits_only():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]], requires_grad=True)
    out = sampling_logits(logits, torch.tensor([1]), SamplingSettings(top_p=0.3, temperature=2.0))
    torch.log_softmax(out, -1)[0, 1].backward()
    grad = logits.grad[0]
    assert grad[0] == 0 and grad[2] == 0 and grad[1] > 0 and grad[3] < 0


def test_sampling_generation_config_states_every_setting_and_turns_every_other_processor_off():
    sampled = generation_config(SamplingSettings(temperature=0.7, top_p=0.9, top_k=5), max_new_tokens=12,
                                pad_token_id=0, eos_token_id=[1, 4])
    assert (sampled.do_sample, sampled.temperature, sampled.top_p, sampled.top_k) == (True, 0.7, 0.9, 5)
    assert (sampled.max_new_tokens, sampled.pad_token_id, sampled.eos_token_id) == (12, 0, [1, 4])
    assert sampled.output_scores and sampled.return_dict_in_generate and sampled.use_cache
    assert sampled.num_return_sequences == 1 and sampled.num_beams == 1 and sampled.min_new_tokens == 0
    assert sampled.min_length is None  # min_new_tokens already says "no minimum"
    assert (sampled.repetition_penalty, sampled.no_repeat_ngram_size, sampled.typical_p) == (1.0, 0, 1.0)
    assert sampled.min_p is None  # unset: transformers runs a warper for any min_p set, 0 included
    assert (sampled.epsilon_cutoff, sampled.eta_cutoff, sampled.guidance_scale, sampled.renormalize_logits) == (
        0.0, 0.0, 1.0, False)
    greedy = generation_config(SamplingSettings(greedy=True, temperature=0.7), max_new_tokens=3, pad_token_id=2,
                               eos_token_id=[1])
    assert greedy.do_sample is False and greedy.temperature is None and greedy.top_p is None
    assert greedy.typical_p is None and greedy.min_p is None and greedy.epsilon_cutoff is None
    assert greedy.eta_cutoff is None and greedy.repetition_penalty == 1.0


# a checkpoint value that asks for each processor, beside the value that leaves sampling alone
CHECKPOINT_PROCESSORS = {
    "repetition_penalty": (1.0, 1.3), "encoder_repetition_penalty": (1.0, 1.1), "no_repeat_ngram_size": (0, 2),
    "encoder_no_repeat_ngram_size": (0, 3), "min_p": (0.0, 0.05), "top_h": (None, 0.5), "typical_p": (1.0, 0.9),
    "epsilon_cutoff": (0.0, 3e-4), "eta_cutoff": (0.0, 3e-4), "bad_words_ids": (None, [[3]]),
    "sequence_bias": (None, {(3,): 1.0}), "suppress_tokens": (None, [4]), "begin_suppress_tokens": (None, [5]),
    "forced_bos_token_id": (None, 3), "forced_eos_token_id": (None, 1), "min_length": (0, 5),
    "min_new_tokens": (0, 2), "exponential_decay_length_penalty": (None, (4, 1.5)),
    "renormalize_logits": (False, True), "guidance_scale": (1.0, 1.5), "watermarking_config": (None, {"bias": 2}),
    "remove_invalid_values": (False, True), "num_beams": (1, 4), "penalty_alpha": (None, 0.6),
    "dola_layers": (None, "high"), "diversity_penalty": (0.0, 0.5), "num_beam_groups": (1, 2),
    "constraints": (None, ["c"]), "force_words_ids": (None, [[3]]), "token_healing": (False, True),
}


def test_sampling_names_every_checkpoint_processor_it_does_not_apply():
    assert set(PROCESSOR_DEFAULTS) == set(CHECKPOINT_PROCESSORS)
    neutral = types.SimpleNamespace(**{k: v[0] for k, v in CHECKPOINT_PROCESSORS.items()})
    assert ignored_checkpoint_settings(types.SimpleNamespace(generation_config=neutral)) == {}
    asking = types.SimpleNamespace(**{k: v[1] for k, v in CHECKPOINT_PROCESSORS.items()})
    assert ignored_checkpoint_settings(types.SimpleNamespace(generation_config=asking)) == {
        k: v[1] for k, v in CHECKPOINT_PROCESSORS.items()}
    for key, (_, value) in CHECKPOINT_PROCESSORS.items():
        one = types.SimpleNamespace(**{key: value})
        assert ignored_checkpoint_settings(types.SimpleNamespace(generation_config=one)) == {key: value}
    assert ignored_checkpoint_settings(types.SimpleNamespace()) == {}
    assert ignored_checkpoint_settings(types.SimpleNamespace(generation_config=None)) == {}


def warn_from_here(model):
    warn_ignored_checkpoint_settings(model)


def test_sampling_warns_once_per_checkpoint_and_setting(monkeypatch):
    monkeypatch.setattr(sampling_module, "_WARNED", set())
    config = types.SimpleNamespace(repetition_penalty=1.3, no_repeat_ngram_size=2)
    model = types.SimpleNamespace(generation_config=config, config=types.SimpleNamespace(name_or_path="org/ckpt"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_from_here(model)
        warn_from_here(model)
    assert len(caught) == 1 and caught[0].category is UserWarning
    assert str(caught[0].message) == (
        "org/ckpt: its generation_config sets no_repeat_ngram_size=2, repetition_penalty=1.3; not applied -- "
        "rollouts sample with the run's temperature / top_k / top_p only, the distribution the trainer scores")
    assert "rollouts" not in caught[0].filename  # it points at the caller's code, not at the library
    config.repetition_penalty = 1.2  # another setting of the same checkpoint: said again
    unnamed = types.SimpleNamespace(generation_config=types.SimpleNamespace(min_p=0.1),
                                    config=types.SimpleNamespace(name_or_path=""))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_from_here(model)
        warn_from_here(unnamed)
        warn_from_here(types.SimpleNamespace(generation_config=types.SimpleNamespace()))
        # a model without a config, or whose config has no name: named by its class
        warn_from_here(types.SimpleNamespace(generation_config=types.SimpleNamespace(min_p=0.2)))
        warn_from_here(types.SimpleNamespace(generation_config=types.SimpleNamespace(min_p=0.3),
                                             config=types.SimpleNamespace()))
    assert [str(w.message).split(":")[0] for w in caught] == ["org/ckpt"] + ["SimpleNamespace"] * 3


def test_sampling_project_generation_swaps_the_config_for_the_call_only():
    own, ours = object(), object()
    model = types.SimpleNamespace(generation_config=own)
    with project_generation(model, ours) as config:
        assert config is ours and model.generation_config is ours
    assert model.generation_config is own
    with pytest.raises(RuntimeError):
        with project_generation(model, ours):
            raise RuntimeError("generate failed")
    assert model.generation_config is own


# -- turn_cache ----------------------------------------------------------------------------------------------------


class FakeCache:
    def __init__(self, length):
        self.length, self.selected = length, []

    def get_seq_length(self):
        return self.length

    def batch_select_indices(self, index):
        self.selected.append(index.tolist())


def test_turn_cache_after_generate_hides_the_cached_copy_of_each_rows_last_token():
    input_ids = torch.tensor([[5, 6], [0, 7], [8, 9]])
    attention_mask = torch.tensor([[1, 1], [0, 1], [1, 1]])
    sequences = torch.tensor([[5, 6, 11, 12, 13], [0, 7, 21, 1, 0], [8, 9, 1, 0, 0]])
    state = after_generate(["a", "b", "c"], [[5, 6], [7], [8, 9]], input_ids, attention_mask, sequences, [3, 1, 0],
                           FakeCache(4))
    assert state.keys == ["a", "b", "c"]
    assert state.ids.tolist() == [[5, 6, 11, 12], [0, 7, 21, 1], [8, 9, 1, 0]]
    # a: its last token (13) was never cached; b: 21 is cached and fed again, so hidden; c generated nothing
    assert state.mask.tolist() == [[1, 1, 1, 1], [0, 1, 0, 0], [1, 1, 0, 0]]
    assert state.pending == [[13], [21], []]
    assert state.covered == [[5, 6, 11, 12, 13], [7, 21], [8, 9]]
    assert attention_mask.tolist() == [[1, 1], [0, 1], [1, 1]]  # the caller's mask is not written to


def test_turn_cache_continuation_is_the_pending_and_new_tokens_or_none():
    state = ChunkCache(["a", "b"], torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long),
                       FakeCache(3), pending=[[13], []], covered=[[5, 6, 13], [8, 9]])
    assert state.continuation(["a", "b"], [[5, 6, 13, 40, 41], [8, 9, 42]]) == [[13, 40, 41], [42]]
    assert state.continuation(["b"], [[8, 9]]) == [[]]
    assert state.continuation(["a", "z"], [[5, 6, 13], [1]]) is None  # a trajectory the cache never saw
    assert state.continuation(["a"], [[5, 6]]) is None  # shorter than what the cache holds
    assert state.continuation(["a"], [[5, 7, 13, 1]]) is None  # changed under the cache
    assert state.continuation(["b"], [(8, 9, 3)]) == [[3]]


def test_turn_cache_select_keeps_the_rows_of_the_keys_in_their_order():
    cache = FakeCache(2)
    state = ChunkCache(["a", "b", "c"], torch.tensor([[1, 2], [3, 4], [5, 6]]), torch.tensor([[1, 1], [0, 1], [1, 0]]),
                       cache, pending=[[2], [4], [6]], covered=[[1, 2], [4], [5, 6]])
    state.select(["a", "b", "c"])
    assert cache.selected == []  # nothing to do
    state.select(["c", "a"])
    assert cache.selected == [[2, 0]]
    assert state.ids.tolist() == [[5, 6], [1, 2]] and state.mask.tolist() == [[1, 0], [1, 1]]
    assert state.pending == [[6], [2]] and state.covered == [[5, 6], [1, 2]] and state.keys == ["c", "a"]
    state.select(["a"])
    assert cache.selected[-1] == [1] and state.keys == ["a"] and state.ids.tolist() == [[1, 2]]


def test_turn_cache_extend_inputs_left_pads_the_new_tokens_after_the_cached_layout():
    state = ChunkCache(["a", "b", "c"], torch.tensor([[5, 6], [0, 7], [8, 9]]),
                       torch.tensor([[1, 1], [0, 1], [1, 0]]), FakeCache(2), [[], [], []], [[], [], []])
    ids, mask = extend_inputs(state, [[40], [41, 42], []], pad_id=0)
    assert ids.tolist() == [[5, 6, 0, 40], [0, 7, 41, 42], [8, 9, 0, 0]]
    assert mask.tolist() == [[1, 1, 0, 1], [0, 1, 1, 1], [1, 0, 0, 0]]
    assert ids.dtype == torch.long and mask.dtype == state.mask.dtype
    ids, _ = extend_inputs(state, [[40], [41], [43]], pad_id=3)
    assert ids[:, 2:].tolist() == [[40], [41], [43]]
    ids, _ = extend_inputs(state, [[40], [], []], pad_id=3)
    assert ids[:, 2:].tolist() == [[40], [3], [3]]


def test_turn_cache_chunks_are_fixed_at_first_sight_and_fill_the_newest_one():
    turns = TurnCaches(2)
    assert turns.groups(["a", "b", "c"]) == [(0, [0, 1]), (1, [2])]
    assert turns.groups(["c", "d", "b"]) == [(0, [2]), (1, [0, 1])]  # d joins c's chunk, which had room
    assert turns.groups(["e"]) == [(2, [0])]
    assert turns.members == [["a", "b"], ["c", "d"], ["e"]]
    turns.states[0] = "state"
    turns.clear()
    assert (turns.chunk_of, turns.members, turns.states) == ({}, [], {})
    assert TurnCaches(1).groups(["x", "y"]) == [(0, [0]), (1, [1])]
    assert TurnCaches(3).groups(["x", "y", "z", "w"]) == [(0, [0, 1, 2]), (1, [3])]


# -- append_cache --------------------------------------------------------------------------------------------------


def test_append_cache_grows_by_whole_blocks_and_adopts_replaced_keys():
    assert append_cache.BLOCK_POSITIONS == 256
    layer = AppendLayer()
    k, v = torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 5)
    keys, values = layer.update(k, v)
    assert torch.equal(keys, k) and torch.equal(values, v) and layer._key_buffer.shape == (2, 1, 256, 4)
    assert layer._value_buffer.shape == (2, 1, 256, 5)
    k2, v2 = torch.randn(2, 1, 253, 4), torch.randn(2, 1, 253, 5)
    keys, values = layer.update(k2, v2)  # exactly one block: no new buffer
    assert layer._key_buffer.shape[-2] == 256 and keys.data_ptr() == layer._key_buffer.data_ptr()
    assert torch.equal(keys, torch.cat([k, k2], -2)) and torch.equal(values, torch.cat([v, v2], -2))
    k3, v3 = torch.randn(2, 1, 1, 4), torch.randn(2, 1, 1, 5)
    keys, values = layer.update(k3, v3)  # 257 positions: a second block, the old ones copied over
    assert layer._key_buffer.shape[-2] == 512 and torch.equal(keys, torch.cat([k, k2, k3], -2))
    assert torch.equal(values, torch.cat([v, v2, v3], -2))
    layer.keys, layer.values = layer.keys[[1]], layer.values[[1]]  # a row selection replaced the tensors
    k4, v4 = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 5)
    keys, values = layer.update(k4, v4)
    assert keys.shape == (1, 1, 259, 4) and torch.equal(keys[0, :, :257], torch.cat([k, k2, k3], -2)[1])
    assert torch.equal(values[0, :, 257:], v4[0]) and layer._key_buffer.shape[0] == 1
    layer.keys, layer.values = layer.keys[..., :100, :], layer.values[..., :100, :]  # a crop: a view, same start
    keys, _ = layer.update(k4, v4)
    assert keys.shape[-2] == 102 and torch.equal(keys[..., 100:, :], k4)


def test_append_cache_new_cache_replaces_only_full_attention_layers():
    from transformers import LlamaConfig
    from transformers.cache_utils import DynamicLayer

    config = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2)
    cache = new_cache(config)
    assert [type(layer) for layer in cache.layers] == [AppendLayer, AppendLayer]
    assert issubclass(AppendLayer, DynamicLayer)
    config.layer_types, config.sliding_window = ["sliding_attention", "full_attention"], 4
    kinds = [type(layer) for layer in new_cache(config).layers]
    assert kinds[0] is not AppendLayer and kinds[1] is AppendLayer
    # a config that names no layers: the cache makes them lazily, one per layer index, and they append in place
    lazy = new_cache(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=0,
                                 num_attention_heads=2, num_key_value_heads=2))
    assert lazy.layers == [] and lazy.layer_class_to_replicate is AppendLayer
    lazy.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 0)
    assert type(lazy.layers[0]) is AppendLayer


# -- hf_generation -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    """A random 2-layer Llama over the word tokenizer (<pad>=0 <eos>=1 <unk>=2 say ok red green blue gold)."""
    return tiny_generation_model()


def forward_logprobs(model, context, tokens, sampling):
    """Log-probs of ``tokens`` after ``context`` from one fresh forward, under the sampling distribution."""
    full = torch.tensor([list(context) + list(tokens)])
    with torch.no_grad():
        logits = model(input_ids=full).logits[0, len(context) - 1:-1]
    if sampling is not None:
        logits = sampling_logits(logits, torch.tensor(tokens), sampling)
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


CONTEXTS = [[3, 4, 5, 6, 7], [8], [5, 6, 3]]


@pytest.mark.parametrize("settings", [SamplingSettings(), SamplingSettings(temperature=0.6, top_k=5, top_p=0.8),
                                      SamplingSettings(greedy=True)])
def test_hf_generation_records_the_logprobs_of_exactly_the_generated_tokens(tiny, settings):
    model, tok = tiny
    backend = HFGenerationBackend(model, tok, settings, stop_strings=(), batch_size=2)
    torch.manual_seed(3)
    out = backend.generate(CONTEXTS, 6)
    assert len(out) == 3 and not backend.turns.states  # no keys: nothing kept
    for context, generation in zip(CONTEXTS, out):
        ids = generation.token_ids
        assert len(generation.logprobs) == len(ids) >= 1
        assert 1 not in ids[:-1] and (ids[-1] == 1 or len(ids) == 6)  # through the first EOS, or the budget
        expected = forward_logprobs(model, context, ids, None if settings.greedy else settings)
        assert torch.allclose(torch.tensor(generation.logprobs), expected, atol=2e-5), (generation, expected)
    if not settings.greedy:
        assert any(g.token_ids[-1] == 1 and len(g.token_ids) < 6 for g in out)  # a row stopped early
        assert any(len(g.token_ids) == 6 for g in out)


def test_hf_generation_applies_none_of_the_checkpoints_processors(tiny, monkeypatch):
    monkeypatch.setattr(sampling_module, "_WARNED", set())  # said once per process: whatever ran before
    model, tok = tiny
    own = model.generation_config
    asking = own.__class__(**{**own.to_dict(), "repetition_penalty": 3.0, "no_repeat_ngram_size": 1,
                              "min_new_tokens": 4})
    model.generation_config = asking
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            backend = HFGenerationBackend(model, tok, SamplingSettings(), stop_strings=())
        assert any("repetition_penalty=3.0" in str(w.message) for w in caught)
        torch.manual_seed(3)
        out = backend.generate(CONTEXTS, 6)
        assert model.generation_config is asking
    finally:
        model.generation_config = own
    for context, generation in zip(CONTEXTS, out):
        expected = forward_logprobs(model, context, generation.token_ids, None)
        assert torch.allclose(torch.tensor(generation.logprobs), expected, atol=2e-5)


def test_hf_generation_defaults_and_training_mode(tiny):
    model, tok = tiny
    backend = HFGenerationBackend(model, tok)
    assert backend.batch_size == 64 and backend.reuse_cache is True and backend.turns.chunk_size == 64
    assert backend.stop_strings == ("</search>", "</answer>") and backend.sampling == SamplingSettings()
    assert backend.eos_ids == [1]
    # a checkpoint with several end-of-turn ids (Llama 3's): all of them end a generation
    several = types.SimpleNamespace(generation_config=types.SimpleNamespace(eos_token_id=[7, 1]))
    assert HFGenerationBackend(several, tok).eos_ids == [7, 1]
    modes = []
    handle = model.register_forward_pre_hook(lambda module, args: modes.append(module.training))
    try:
        model.train()
        backend.generate([[3, 4]], 2)
        assert model.training and modes and not any(modes)  # generated in eval mode, training mode restored
        model.eval()
        backend.generate([[3, 4]], 2)
        assert not model.training
    finally:
        handle.remove()


def test_hf_generation_stops_a_row_at_its_stop_string(tiny):
    model, tok = tiny
    # "red" (5) completes the stop string; "gold" (8) and <pad> (0) share its last character
    backend = HFGenerationBackend(model, tok, SamplingSettings(temperature=2.0), stop_strings=("red",),
                                  batch_size=8)
    assert stop_candidate_ids(tok, ("red",)).tolist() == [0, 5, 8]
    steps = []
    handle = model.register_forward_pre_hook(lambda module, args: steps.append(1))
    torch.manual_seed(1)
    try:
        out = backend.generate([[3, 4]] * 6, 20)
        torch.manual_seed(4)
        first, alone = len(steps), backend.generate([[3, 4]], 20)[0]
        # one row that says "red" at its third token: generate stops there, it does not run on to an EOS
        assert alone.token_ids[-1] == 5 and len(steps) - first == len(alone.token_ids) < 20
        del steps[first:]
    finally:
        handle.remove()
    lengths = [len(g.token_ids) for g in out]
    for g in out:
        ids = g.token_ids
        assert 5 not in ids[:-1] and 1 not in ids[:-1] and len(g.logprobs) == len(ids)
    assert sum(g.token_ids[-1] == 5 for g in out) >= 2, lengths
    assert all(g.token_ids[-1] in (1, 5) for g in out)
    assert len(steps) == max(lengths)  # generate stopped when the last row had stopped


def test_hf_generation_stop_on_strings_reads_only_the_generated_tail():
    from stppo_agent.models.tiny import word_tokenizer

    tok = word_tokenizer()
    candidates = stop_candidate_ids(tok, ("ok red",))
    assert stop_candidate_ids(tok, ("ok red",)) is candidates
    assert stop_candidate_ids(tok, ("ok",)).tolist() == [2, 4]  # "<unk>" and "ok": cached per stop strings
    criterion = StopOnStrings(tok, ("ok red",), prompt_width=2, candidate_ids=candidates)
    # prompt "say ok"; generated: "red" / "ok red" / "ok gold" / "red blue"
    rows = torch.tensor([[3, 4, 0, 5], [3, 4, 4, 5], [3, 4, 4, 8], [3, 4, 5, 7]])
    assert criterion(rows, None).tolist() == [False, True, False, False]
    assert criterion(rows[:, :2], None).tolist() == [False] * 4
    narrow = StopOnStrings(tok, ("say ok red",), prompt_width=1, candidate_ids=stop_candidate_ids(tok, ("d",)),
                           window=2)
    assert narrow(torch.tensor([[6, 3, 4, 5]]), None).tolist() == [False]  # "say ok red" needs three tokens
    wide = StopOnStrings(tok, ("say ok red",), prompt_width=1, candidate_ids=stop_candidate_ids(tok, ("d",)))
    assert wide.window == 24 and wide(torch.tensor([[6, 3, 4, 5]]), None).tolist() == [True]


def test_hf_generation_eos_ids_from_the_model_and_the_tokenizer():
    tok = types.SimpleNamespace(eos_token_id=1)
    assert _eos_ids(types.SimpleNamespace(generation_config=types.SimpleNamespace(eos_token_id=[7, 8])), tok) == [
        7, 8, 1]
    assert _eos_ids(types.SimpleNamespace(generation_config=types.SimpleNamespace(eos_token_id=[1, 8])), tok) == [
        1, 8]
    assert _eos_ids(types.SimpleNamespace(generation_config=types.SimpleNamespace(eos_token_id=7)), tok) == [7, 1]
    assert _eos_ids(types.SimpleNamespace(generation_config=types.SimpleNamespace(eos_token_id=None)), tok) == [1]
    assert _eos_ids(types.SimpleNamespace(generation_config=None), tok) == [1]
    assert _eos_ids(types.SimpleNamespace(), types.SimpleNamespace(eos_token_id=None)) == []
    assert _eos_ids(types.SimpleNamespace(generation_config=types.SimpleNamespace(eos_token_id=3)),
                    types.SimpleNamespace(eos_token_id=None)) == [3]


def test_hf_generation_reusing_caches_gives_a_fresh_prefills_tokens_and_logprobs(tiny):
    model, tok = tiny
    seen = []
    handle = model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(int(kwargs["input_ids"].numel())),
                                             with_kwargs=True)
    runs = {}
    try:
        for reuse in (False, True):
            backend = HFGenerationBackend(model, tok, SamplingSettings(temperature=1.5), stop_strings=("red",),
                                          batch_size=2, reuse_cache=reuse)
            torch.manual_seed(6)
            contexts = {key: list(c) for key, c in zip("abc", CONTEXTS)}
            turns, seen[:] = [], []
            for turn in range(3):
                keys = [k for k in "abc" if not (turn == 2 and k == "b")]  # b is done after two turns
                out = backend.generate([contexts[k] for k in keys], 4, keys=keys)
                turns.append([(g.token_ids, g.logprobs) for g in out])
                for k, g in zip(keys, out):
                    contexts[k] += g.token_ids + [6, 7][: 1 + turn % 2]  # an observation of one or two tokens
                if reuse:
                    assert sorted(backend.turns.states) == [0, 1]
            runs[reuse] = (turns, sum(seen))
            backend.end_rollout()
            assert not backend.turns.states and not backend.turns.chunk_of
    finally:
        handle.remove()
    # a turn where one row of chunk {a, b} stopped before the other: its last token is in the cache, hidden
    assert any(0 < min(len(t[0][0]), len(t[1][0])) < max(len(t[0][0]), len(t[1][0])) for t in runs[False][0][:2])
    for fresh, cached in zip(runs[False][0], runs[True][0]):
        for (ids_a, lp_a), (ids_b, lp_b) in zip(fresh, cached):
            assert ids_a == ids_b
            assert torch.allclose(torch.tensor(lp_a), torch.tensor(lp_b), atol=1e-5)
    assert runs[True][1] < runs[False][1]  # fewer positions fed: the transcripts were not re-encoded


def test_hf_generation_without_reuse_keeps_no_state_and_a_changed_context_is_re_encoded(tiny):
    model, tok = tiny
    backend = HFGenerationBackend(model, tok, SamplingSettings(greedy=True), stop_strings=(), batch_size=2,
                                  reuse_cache=False)
    backend.generate([[3, 4], [5]], 2, keys=["a", "b"])
    assert not backend.turns.states and backend.turns.chunk_of == {"a": 0, "b": 0}
    reuse = HFGenerationBackend(model, tok, SamplingSettings(greedy=True), stop_strings=(), batch_size=1)
    first = reuse.generate([[3, 4], [5]], 3, keys=["a", "b"])
    assert sorted(reuse.turns.states) == [0, 1]
    assert reuse.turns.states[0].covered == [[3, 4] + first[0].token_ids]
    # a's context cut short (not what the cache holds): re-encoded, same answer as a fresh backend
    changed = [[3, 4, first[0].token_ids[0], 6]]
    again = reuse.generate(changed, 3, keys=["a"])
    fresh = HFGenerationBackend(model, tok, SamplingSettings(greedy=True), stop_strings=()).generate(changed, 3)
    assert again[0].token_ids == fresh[0].token_ids
    assert sorted(reuse.turns.states) == [0]  # b's chunk did not play: freed
    assert hf_generation.CACHE_ARGUMENT in ("cache", "past_key_values")
    assert isinstance(reuse.turns.states[0].cache.layers[0], AppendLayer)
