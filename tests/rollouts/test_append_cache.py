"""``stppo_agent.rollouts.append_cache``: the in-place key/value cache holds
what transformers' DynamicCache holds, without a copy per token."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from stppo_agent.models.loading import load_actor
from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer
from stppo_agent.rollouts import append_cache
from stppo_agent.rollouts.append_cache import AppendLayer, new_cache
from stppo_agent.rollouts.batch import left_pad
from stppo_agent.rollouts.hf_generation import CACHE_ARGUMENT


def states(rows: int, positions: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 2, positions, 4, generator=generator),
            torch.randn(rows, 2, positions, 4, generator=generator))


def assert_same_layer(ours: AppendLayer, reference: DynamicLayer) -> None:
    assert ours.get_seq_length() == reference.get_seq_length()
    assert torch.equal(ours.keys, reference.keys) and torch.equal(ours.values, reference.values)


def test_updates_selection_and_cropping_hold_what_a_dynamic_layer_holds():
    # the operations a rollout puts a cache through: a prefill, token-by-token decoding past a block boundary,
    # dropping finished trajectories between turns, the next turn's prefill, and a crop
    ours, reference = AppendLayer(), DynamicLayer()

    def both(operation, *args):
        getattr(ours, operation)(*args)
        getattr(reference, operation)(*args)
        assert_same_layer(ours, reference)

    both("update", *states(4, 200, seed=0))
    for step in range(100):
        both("update", *states(4, 1, seed=step + 1))
    both("batch_select_indices", torch.tensor([3, 1]))
    both("update", *states(2, 1, seed=150))
    both("batch_select_indices", torch.tensor([1, 0]))  # as many rows as the buffer: only its address tells
    both("update", *states(2, 37, seed=200))
    both("update", *states(2, 1, seed=201))
    both("crop", -5)
    both("update", *states(2, 3, seed=202))  # writes over the cropped positions
    both("batch_repeat_interleave", 2)
    both("update", *states(4, 1, seed=203))


def test_decoding_writes_in_place_and_grows_by_blocks(monkeypatch):
    monkeypatch.setattr(append_cache, "BLOCK_POSITIONS", 64)
    layer = AppendLayer()
    layer.update(*states(3, 10, seed=0))
    # every buffer is held alive, so the allocator cannot hand a freed one's address to its successor and
    # distinct addresses count distinct allocations
    held = [layer._key_buffer]
    for step in range(200):
        keys, _ = layer.update(*states(3, 1, seed=step + 1))
        held.append(layer._key_buffer)
        assert keys.data_ptr() == layer._key_buffer.data_ptr()  # a view of the buffer, not a copy
    assert layer.get_seq_length() == 210
    assert layer._key_buffer.shape[-2] == 256  # under one block of room to spare
    # 64 -> 128 -> 192 -> 256 positions: one copy per block, not one per token
    assert len({buffer.data_ptr() for buffer in held}) == 4


def test_new_cache_keeps_layers_of_other_kinds():
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=2)
    assert [type(layer) for layer in new_cache(config).layers] == [AppendLayer] * 3
    config.layer_types = ["full_attention", "sliding_attention", "full_attention"]
    config.sliding_window = 4
    kinds = [type(layer) for layer in new_cache(config).layers]
    assert kinds[0] is AppendLayer and kinds[2] is AppendLayer and kinds[1] is not AppendLayer


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("greedy", [True, False])
def test_generate_with_the_cache_is_bit_identical(tmp_path, greedy, autocast):
    tokenizer = word_tokenizer()
    model = load_actor(build_tiny_llama(tmp_path / "tiny", tokenizer, hidden=32, layers=2, seed=3)).eval()
    prompts = [[4, 5, 6, 7, 8] * 3, [5, 6] * 11, [7] * 4]
    input_ids, attention_mask = left_pad(prompts, tokenizer.pad_token_id, "cpu")

    def generate(**cache):
        torch.manual_seed(7)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):  # the study's bfloat16 forwards
            return model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=not greedy,
                                  max_new_tokens=300, min_new_tokens=300, pad_token_id=tokenizer.pad_token_id,
                                  output_scores=True, return_dict_in_generate=True, **cache)

    reference, ours = generate(), generate(**{CACHE_ARGUMENT: new_cache(model.config)})
    assert torch.equal(ours.sequences, reference.sequences)
    assert all(torch.equal(a, b) for a, b in zip(ours.scores, reference.scores))
    assert isinstance(ours.get(CACHE_ARGUMENT).layers[0], AppendLayer)


def test_the_rollout_backend_generates_with_the_in_place_cache(tmp_path):
    from stppo_agent.rollouts.hf_generation import HFGenerationBackend
    from stppo_agent.rollouts.sampling import SamplingSettings

    tokenizer = word_tokenizer()
    model = load_actor(build_tiny_llama(tmp_path / "tiny", tokenizer, hidden=32, layers=2, seed=3))
    backend = HFGenerationBackend(model, tokenizer, SamplingSettings(greedy=True), batch_size=2)
    backend.generate([[4, 5, 6], [5, 6]], 3, keys=["a", "b"])  # a first turn: a fresh cache
    assert all(isinstance(layer, AppendLayer) for layer in backend.turns.states[0].cache.layers)


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
