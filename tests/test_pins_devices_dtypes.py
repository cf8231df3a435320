"""Pins of where tensors live and what dtype they keep (issue 27, session 13): a GPU user's batch is on the GPU,
so every tensor a function creates must be created on its inputs' device, and a float64 or bfloat16 input must
not be silently computed in float32. Without a GPU, two stand-ins: torch's default device set to "meta" (a tensor
created without ``device=`` lands there, and mixing it with the CPU inputs raises, as a CPU tensor mixed with CUDA
ones does), and inputs on the meta device itself where the ops have meta kernels. Fast: no model, no subprocess."""

from __future__ import annotations

import pytest
import torch

from stppo_agent.algorithms.advantages import estimate_advantages
from stppo_agent.algorithms.config import AlgorithmConfig
from stppo_agent.rollouts.batch import Trajectory, left_pad, to_batch
from stppo_agent.rollouts.hf_generation import StopOnStrings
from stppo_agent.rollouts.sampling import SamplingSettings, sampling_logits
from stppo_agent.rollouts.turn_cache import ChunkCache, after_generate, extend_inputs

F64 = torch.float64


def _outcome_batch():
    """Two groups (one of three, one of two) and a trajectory alone, float64, with per-token KL penalties."""
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, -1.0, 3.0], dtype=F64)
    values = torch.linspace(-1.0, 1.0, 24, dtype=F64).reshape(6, 4)
    loss_mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 1, 1], [1, 0, 1, 0], [1, 1, 0, 0], [0, 1, 1, 1]],
                             dtype=torch.bool)
    group_ids = torch.tensor([7, 7, 7, 2, 2, 9])
    kl_penalty = torch.linspace(0.0, 0.23, 24, dtype=F64).reshape(6, 4)
    turn_ids = torch.where(loss_mask, torch.tensor([0, 0, 1, 1]).expand(6, 4), -1)
    return dict(rewards=rewards, values=values, loss_mask=loss_mask, group_ids=group_ids, kl_penalty=kl_penalty,
                turn_ids=turn_ids)


# -- advantages ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["grpo", "rloo", "gae", "turn_gae"])
def test_advantages_are_computed_on_the_inputs_device_whatever_the_default_device(name):
    batch = _outcome_batch()
    config = AlgorithmConfig(gamma=0.9, lam=0.8, whiten_advantages=False)
    expected = estimate_advantages(name, config=config, **batch)
    assert expected[0].abs().sum() > 0  # a batch where the estimator has something to say
    with torch.device("meta"):
        advantages, returns = estimate_advantages(name, config=config, **batch)
    for got, want in zip((advantages, returns), expected):
        assert got.device.type == "cpu" and got.dtype == F64
        torch.testing.assert_close(got, want, rtol=0, atol=0)


# -- turn_cache ------------------------------------------------------------------------------------------------


class IndexSelectCache:
    """A cache whose rows are selected with ``index_select``, which needs the index on the cache's device."""

    def __init__(self, rows):
        self.rows = rows

    def get_seq_length(self):
        return self.rows.shape[1]

    def batch_select_indices(self, index):
        self.rows = torch.index_select(self.rows, 0, index)


def _state(device=None):
    ids = torch.tensor([[5, 6], [0, 7], [8, 9]], device=device)
    mask = torch.tensor([[1, 1], [0, 1], [1, 0]], dtype=torch.int32, device=device)
    cache = IndexSelectCache(torch.arange(6.0, device=device).reshape(3, 2))
    return ChunkCache(["a", "b", "c"], ids, mask, cache, [[6], [7], []], [[5, 6], [7], [8, 9]])


def test_turn_cache_extend_inputs_builds_the_new_columns_on_the_cache_device():
    state = _state()
    with torch.device("meta"):
        ids, mask = extend_inputs(state, [[40], [41, 42], []], pad_id=3)
    assert ids.device.type == "cpu" and mask.device.type == "cpu"
    assert ids.tolist() == [[5, 6, 3, 40], [0, 7, 41, 42], [8, 9, 3, 3]]
    assert mask.tolist() == [[1, 1, 0, 1], [0, 1, 1, 1], [1, 0, 0, 0]]
    assert ids.dtype == torch.long and mask.dtype == torch.int32  # the cached mask's dtype, not the default


def test_turn_cache_select_passes_the_row_index_on_the_rows_device():
    state = _state()
    with torch.device("meta"):
        state.select(["c", "a"])
    assert state.cache.rows.tolist() == [[4.0, 5.0], [0.0, 1.0]]
    assert state.ids.tolist() == [[8, 9], [5, 6]] and state.mask.tolist() == [[1, 0], [1, 1]]
    meta = _state("meta")
    meta.select(["b"])
    assert meta.ids.device.type == "meta" and meta.cache.rows.shape == (1, 2)


def test_turn_cache_after_generate_keeps_the_attention_masks_dtype():
    input_ids = torch.tensor([[5, 6], [0, 7]])
    attention_mask = torch.tensor([[1, 1], [0, 1]], dtype=torch.int32)
    sequences = torch.tensor([[5, 6, 11, 12], [0, 7, 21, 0]])
    state = after_generate(["a", "b"], [[5, 6], [7]], input_ids, attention_mask, sequences, [2, 1],
                           IndexSelectCache(torch.zeros(2, 3)))
    assert state.mask.dtype == torch.int32
    assert state.mask.tolist() == [[1, 1, 1], [0, 1, 0]]
    _, mask = extend_inputs(state, state.pending, pad_id=0)
    assert mask.dtype == torch.int32 and mask.tolist() == [[1, 1, 1, 1], [0, 1, 0, 1]]


# -- policy losses, the KL reward penalty and the segment reductions under them ---------------------------------


def _policy_batch():
    generator = torch.Generator().manual_seed(3)
    loss_mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 1, 1], [0, 0, 1, 1, 1]], dtype=torch.bool)
    turn_ids = torch.where(loss_mask, torch.tensor([[0, 0, 0, 1, 1]]).expand(3, 5), -1)
    old = -torch.rand(3, 5, generator=generator, dtype=F64) - 0.5
    logprobs = (old + 0.6 * torch.randn(3, 5, generator=generator, dtype=F64)).requires_grad_()
    advantages = torch.randn(3, 5, generator=generator, dtype=F64)
    ref = old - 0.1 * torch.rand(3, 5, generator=generator, dtype=F64)
    return dict(logprobs=logprobs, old_logprobs=old, advantages=advantages, loss_mask=loss_mask, turn_ids=turn_ids,
                ref_logprobs=ref)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("level", ["token", "turn", "sequence"])
@pytest.mark.parametrize("name", ["ppo_clip", "cispo", "sapo", "gmpo", "dppo_tv", "dppo_kl", "m2po"])
def test_losses_are_computed_on_the_inputs_device_whatever_the_default_device(name, level, loss_agg):
    from stppo_agent.algorithms.losses import get_policy_loss

    config = AlgorithmConfig(ratio_level=level, loss_agg=loss_agg, kl_loss_coef=0.1)
    batch = _policy_batch()
    loss, _, metrics = get_policy_loss(name)(config=config, **batch)
    with torch.device("meta"):
        got, _, got_metrics = get_policy_loss(name)(config=config, **batch)
    assert got.device.type == "cpu" and got.dtype == F64
    torch.testing.assert_close(got, loss, rtol=0, atol=0)
    assert repr(got_metrics) == repr(metrics)


def test_losses_kl_reward_penalty_and_log_ratio_stay_on_the_inputs_device():
    from stppo_agent.algorithms.losses import kl_reward_penalty, log_ratio_at_level

    batch = _policy_batch()
    config = AlgorithmConfig(kl_in_reward=0.5)
    old, ref, mask = batch["old_logprobs"], batch["ref_logprobs"], batch["loss_mask"]
    with torch.device("meta"):
        penalty = kl_reward_penalty(old, ref, mask, config)
        log_ratio = log_ratio_at_level(batch["logprobs"], old, mask, batch["turn_ids"], "turn")
    torch.testing.assert_close(penalty, torch.where(mask, 0.5 * (old - ref), 0.0), rtol=0, atol=0)
    assert penalty.dtype == F64 and log_ratio.device.type == "cpu" and log_ratio.dtype == F64
    assert log_ratio[0, 0] == 0 and log_ratio[0, 1] == log_ratio[0, 2] != 0


def test_segments_reductions_stay_on_the_inputs_device():
    from stppo_agent.algorithms.segments import (
        masked_mean,
        masked_sum,
        segment_counts,
        segment_sum,
        turn_segment_ids,
        whiten,
    )

    batch = _policy_batch()
    x, mask, turns = batch["advantages"], batch["loss_mask"], batch["turn_ids"]
    with torch.device("meta"):
        ids, num = turn_segment_ids(turns, mask)
        sums = segment_sum(x, ids, num)
        counts = segment_counts(ids, num, mask, F64)
        results = [masked_sum(x, mask), masked_mean(x, mask), whiten(x, mask)]
    want_ids, want_num = turn_segment_ids(turns, mask)
    assert ids.device.type == "cpu" and num == want_num and ids.tolist() == want_ids.tolist()
    torch.testing.assert_close(sums, segment_sum(x, want_ids, want_num), rtol=0, atol=0)
    assert counts.dtype == F64 and counts.sum() == mask.sum() and counts.device.type == "cpu"
    torch.testing.assert_close(results[0], x[mask].sum(), rtol=0, atol=0)
    torch.testing.assert_close(results[1], x[mask].mean(), rtol=0, atol=0)
    for result in results:
        assert result.device.type == "cpu" and result.dtype == F64
    assert results[2][~mask].abs().sum() == 0 and abs(float(results[2][mask].mean())) < 1e-12


def test_dynamic_sampling_informative_groups_stays_on_the_inputs_device():
    from stppo_agent.algorithms.dynamic_sampling import informative_groups

    rewards, group_ids = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0], dtype=F64), torch.tensor([4, 4, 9, 9, 1])
    with torch.device("meta"):
        keep = informative_groups(rewards, group_ids)
    assert keep.device.type == "cpu" and keep.tolist() == [False, False, True, True, False]


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


def test_clip_bias_apply_and_accumulate_stay_on_the_parameters_device():
    from stppo_agent.algorithms.clip_bias import ClipBiasCorrector

    a = torch.nn.Parameter(torch.tensor([3.0, 4.0], dtype=F64))
    a.grad = torch.tensor([6.0, 8.0], dtype=F64)
    unclipped = torch.tensor(1.0, dtype=F64)  # no grad: nothing clipped on this rank
    with torch.device("meta"):
        ClipBiasCorrector([a], through_grad=True).accumulate(unclipped)
        metrics = ClipBiasCorrector([a], kappa=0.5).apply()  # nothing accumulated: ||C|| = 0, scale 1
        empty = ClipBiasCorrector([]).apply()
    assert metrics["clip_bias_norm"].device.type == "cpu" and float(metrics["clip_bias_norm"]) == 0.0
    assert float(metrics["pg_grad_norm"]) == 10.0 and float(metrics["clip_bias_scale"]) == 1.0
    assert a.grad.tolist() == [6.0, 8.0]
    assert all(value.device.type == "cpu" for value in empty.values())


def test_clip_bias_apply_reports_an_empty_bias_norm_on_the_parameters_device():
    from stppo_agent.algorithms.clip_bias import ClipBiasCorrector

    a = torch.nn.Parameter(torch.ones(3, device="meta"))
    a.grad = torch.ones(3, device="meta")
    metrics = ClipBiasCorrector([a]).apply()  # nothing accumulated: ||C|| is a created zero
    assert {name: value.device.type for name, value in metrics.items()} == {
        "clip_bias_norm": "meta", "pg_grad_norm": "meta", "clip_bias_scale": "meta"}


# -- rollout batches, sampling and the stop criterion --------------------------------------------------------


def _trajectories():
    a = Trajectory(env=None, group_id=1, prompt_ids=[11, 12, 13])
    a.append([21, 22], policy=True, turn=0, logprobs=[-0.25, -0.75])
    b = Trajectory(env=None, group_id=0, prompt_ids=[14])
    b.append([24], policy=True, turn=0, logprobs=[-1.0])
    a.reward, b.reward = 1.0, 0.0
    return [a, b]


def test_batch_left_pad_and_to_move_every_tensor_to_the_device_asked_for():
    ids, mask = left_pad([[5, 6], [7]], 0, "meta")
    assert ids.device.type == mask.device.type == "meta" and ids.dtype == mask.dtype == torch.long
    moved = to_batch(_trajectories(), pad_id=0).to("meta")
    tensors = {name: value.device.type for name, value in vars(moved).items() if isinstance(value, torch.Tensor)}
    assert len(tensors) >= 9 and set(tensors.values()) == {"meta"}


def test_batch_is_built_on_the_host_whatever_the_default_device():
    # a GPU user may set torch's default device; the batch is assembled on the host (one copy to the device later,
    # by .to), so no part of it may follow the default while the prompt is built on "cpu"
    with torch.device("meta"):
        batch = to_batch(_trajectories(), pad_id=0)
    tensors = {name: value.device.type for name, value in vars(batch).items() if isinstance(value, torch.Tensor)}
    assert len(tensors) >= 9 and set(tensors.values()) == {"cpu"}
    assert batch.input_ids.tolist() == [[11, 12, 13, 21, 22], [0, 0, 14, 24, 0]]


def test_batch_keeps_its_dtypes_whatever_the_default_dtype():
    default = torch.get_default_dtype()
    torch.set_default_dtype(F64)
    try:
        batch = to_batch(_trajectories(), pad_id=0)
    finally:
        torch.set_default_dtype(default)
    assert batch.sample_logprobs.dtype == torch.float32 and batch.rewards.dtype == torch.float32
    assert batch.sample_logprobs.tolist() == [[-0.25, -0.75], [-1.0, 0.0]]


def test_batch_select_of_no_rows_is_an_empty_batch():
    empty = to_batch(_trajectories(), pad_id=0).select([])
    assert empty.input_ids.shape == (0, 5) and empty.rewards.shape == (0,) and empty.episode_info == []


@pytest.mark.parametrize("where", [None, torch.tensor([[True, False, True]])])
def test_sampling_logits_truncates_on_the_logits_device(where):
    logits = torch.tensor([[[0.0, 1.0, 2.0, 3.0]] * 3], dtype=F64)
    tokens = torch.tensor([[0, 1, 2]])
    sampling = SamplingSettings(temperature=0.5, top_k=2)
    expected = sampling_logits(logits, tokens, sampling, where)
    with torch.device("meta"):
        got = sampling_logits(logits, tokens, sampling, where)
    assert got.device.type == "cpu" and got.dtype == F64
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert got[0, 0].tolist() == [0.0, -torch.inf, 4.0, 6.0]  # top-2 kept, and the sampled token 0


class _Tokenizer:
    def batch_decode(self, rows, skip_special_tokens=False):
        return ["".join(chr(96 + int(t)) for t in row) for row in rows]


def test_stop_on_strings_answers_on_the_input_device():
    stop = StopOnStrings(_Tokenizer(), ["cd"], prompt_width=1, candidate_ids=torch.tensor([4]))
    input_ids = torch.tensor([[1, 3, 4], [1, 2, 4], [1, 3, 3]])
    prompt_only = input_ids[:, :1]
    with torch.device("meta"):
        done = stop(input_ids, None)
        early = stop(prompt_only, None)
    assert done.device.type == "cpu" and done.tolist() == [True, False, False]
    assert early.device.type == "cpu" and early.tolist() == [False, False, False]


def test_stop_on_strings_builds_its_candidate_table_on_the_input_device_once():
    stop = StopOnStrings(_Tokenizer(), ["cd"], prompt_width=1, candidate_ids=torch.tensor([4]))
    on_meta = torch.tensor([[1, 3, 4]], device="meta")
    with pytest.raises(NotImplementedError, match="meta"):  # meta has no data to pick the candidate rows from
        stop(on_meta, None)
    table = stop._is_candidate  # ids 0..4 and one past the table, on the input's device
    assert table.device.type == "meta" and table.shape == (6,)
    with pytest.raises(NotImplementedError, match="meta"):
        stop(on_meta, None)
    assert stop._is_candidate is table  # built once, not at every step


def test_hf_generation_feeds_generate_on_the_models_device():
    from transformers import LlamaConfig, LlamaForCausalLM

    from stppo_agent.models.tiny import word_tokenizer
    from stppo_agent.rollouts.hf_generation import HFGenerationBackend

    tokenizer = word_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, pad_token_id=0, eos_token_id=1)
    with torch.device("meta"):  # no weights allocated: generate is stopped at its door
        model = LlamaForCausalLM(config)
    seen = {}

    class Called(Exception):
        pass

    def generate(input_ids, attention_mask, **kwargs):
        seen.update(ids=input_ids.device.type, mask=attention_mask.device.type, shape=tuple(input_ids.shape))
        raise Called

    model.generate = generate
    backend = HFGenerationBackend(model, tokenizer, SamplingSettings(), stop_strings=())
    with pytest.raises(Called):
        backend.generate([[3, 4, 5], [6]], 2)
    assert seen == {"ids": "meta", "mask": "meta", "shape": (2, 3)}
