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
