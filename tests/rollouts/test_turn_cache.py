"""``stppo_agent.rollouts.turn_cache``: KV-cache reuse across turns gives the tokens
and log-probs of re-encoding every transcript, with less work; its cache layout and device."""

from __future__ import annotations

import gymnasium as gym
import pytest
import torch

import stppo_envs  # noqa: F401
from stppo_agent.models.loading import load_actor
from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer
from stppo_agent.rollouts.hf_generation import HFGenerationBackend
from stppo_agent.rollouts.sampling import SamplingSettings
from stppo_agent.rollouts.turn_cache import ChunkCache, TurnCaches, after_generate, extend_inputs
from stppo_agent.rollouts.turn_loop import RolloutLimits, collect_rollouts
from tests.support.retrievers import PASSAGES, KeywordRetriever


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from stppo_agent.models.default_model import smollm2_path
    from stppo_agent.models.loading import load_tokenizer

    return load_tokenizer(str(smollm2_path()))


def count_forward_tokens(model) -> list[int]:
    """Record how many input positions each forward call processes (a hook: replacing ``forward`` would hide its
    signature from ``generate``, which then stops passing position ids)."""
    seen = []

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0]
        seen.append(int(ids.numel()))

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def rollout(model, tokenizer, envs, reuse: bool, greedy: bool, chunk: int, seed: int = 0):
    backend = HFGenerationBackend(model, tokenizer, SamplingSettings(greedy=greedy), batch_size=chunk,
                                  reuse_cache=reuse)
    limits = RolloutLimits(max_turns=3, max_new_tokens_per_turn=10, max_observation_tokens=24, max_prompt_tokens=400,
                           max_total_tokens=600)
    torch.manual_seed(seed)
    batch = collect_rollouts(backend, tokenizer, envs, [{"index": i % 2} for i in range(len(envs))],
                             list(range(len(envs))), limits, seeds=list(range(len(envs))))
    assert not backend.turns.states  # the caches are freed at the end of the rollout
    return batch


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("env_id,vocabulary", [("stppo/NQ-v0", "smollm2"), ("stppo/NQ-v0", "words"),
                                               ("stppo/Toy-v0", "words")])
def test_reuse_gives_the_same_tokens_and_log_probs(smollm2_tokenizer, tmp_path, greedy, env_id, vocabulary):
    # SmolLM2's byte-level vocabulary; or 9 words, where EOS is drawn often: rows then stop at different steps of a
    # turn, leaving holes in the cache and a cached copy of their last token to hide
    tok = smollm2_tokenizer if vocabulary == "smollm2" else word_tokenizer()
    model = load_actor(build_tiny_llama(tmp_path / "tiny", tok, hidden=32, layers=2, seed=5))
    kwargs = dict(retriever=KeywordRetriever(PASSAGES), max_turns=3) if env_id == "stppo/NQ-v0" else \
        dict(turns=3, fixed_target=None)

    def envs():
        return [gym.make(env_id, **kwargs).unwrapped for _ in range(7)]

    processed = count_forward_tokens(model)
    fresh = rollout(model, tok, envs(), reuse=False, greedy=greedy, chunk=3)
    fresh_tokens, processed[:] = sum(processed), []
    reused = rollout(model, tok, envs(), reuse=True, greedy=greedy, chunk=3)
    reused_tokens = sum(processed)
    assert int(fresh.loss_mask.sum()) > 7 * 3  # several turns of several tokens: the comparison means something
    assert torch.equal(fresh.response_ids, reused.response_ids)
    assert torch.equal(fresh.loss_mask, reused.loss_mask) and torch.equal(fresh.turn_ids, reused.turn_ids)
    torch.testing.assert_close(fresh.sample_logprobs, reused.sample_logprobs, rtol=0, atol=1e-5)
    assert reused_tokens < 0.8 * fresh_tokens, (reused_tokens, fresh_tokens)
    if vocabulary == "words" and not greedy:  # the early-stop path was exercised
        lengths = [int(((fresh.turn_ids[row] == turn) & fresh.loss_mask[row]).sum())
                   for row in range(7) for turn in range(int(fresh.turn_ids[row].max()))]  # turns before the last
        assert any(0 < n < 10 for n in lengths), lengths


def test_a_context_that_does_not_extend_the_cache_is_re_encoded():
    state = ChunkCache(keys=["a", "b"], ids=torch.zeros(2, 3, dtype=torch.long), mask=torch.ones(2, 3),
                       cache=None, pending=[[7], [8]], covered=[[1, 2, 7], [3, 4, 8]])
    assert state.continuation(["a", "b"], [[1, 2, 7, 9, 9], [3, 4, 8, 5]]) == [[7, 9, 9], [8, 5]]
    assert state.continuation(["a"], [[1, 2, 7]]) == [[7]]  # no observation: the last token is fed again
    assert state.continuation(["a", "b"], [[1, 2, 6, 9], [3, 4, 8]]) is None  # a generation cut short
    assert state.continuation(["a", "c"], [[1, 2, 7], [3]]) is None  # a trajectory the chunk never saw


def test_a_wrapped_generate_still_reuses_the_cache(smollm2_tokenizer, tmp_path):
    # a user timing or logging the backend wraps generate(*args, **kwargs): the rollout must still pass the
    # trajectory keys, or every turn silently re-encodes the transcript (what benchmarks/trainer.py once measured)
    model = load_actor(build_tiny_llama(tmp_path / "tiny", smollm2_tokenizer, hidden=32, layers=2, seed=5))
    backend = HFGenerationBackend(model, smollm2_tokenizer, SamplingSettings(greedy=True), batch_size=4)
    inner, keyed = backend.generate, []

    def wrapper(*args, **kwargs):
        keyed.append(kwargs.get("keys") is not None)
        return inner(*args, **kwargs)

    backend.generate = wrapper
    processed = count_forward_tokens(model)
    limits = RolloutLimits(max_turns=3, max_new_tokens_per_turn=10, max_observation_tokens=24, max_prompt_tokens=400,
                           max_total_tokens=600)
    envs = [gym.make("stppo/Toy-v0", turns=3, fixed_target=None).unwrapped for _ in range(4)]
    collect_rollouts(backend, smollm2_tokenizer, envs, [{}] * 4, list(range(4)), limits, seeds=list(range(4)))
    assert len(keyed) == 3 and all(keyed)
    prefill = [n for n in processed if n > 4]  # a decode step feeds one token per row
    assert len(prefill) == 3 and prefill[1] < prefill[0] and prefill[2] < prefill[0], prefill


def test_a_finished_chunk_frees_its_cache_at_once(tmp_path):
    tok = word_tokenizer()
    model = load_actor(build_tiny_llama(tmp_path / "tiny", tok, hidden=32, layers=2, seed=5))
    backend = HFGenerationBackend(model, tok, SamplingSettings(greedy=True), batch_size=2)
    contexts = {key: [4, 5, 6][: 1 + key % 3] for key in range(4)}  # chunks {0, 1} and {2, 3}
    generations = backend.generate(list(contexts.values()), 3, keys=list(contexts))
    assert sorted(backend.turns.states) == [0, 1]
    later = [contexts[2] + generations[2].token_ids + [7]]  # only trajectory 2 plays on
    backend.generate(later, 3, keys=[2])
    assert sorted(backend.turns.states) == [1]  # chunk 0 is done: its cache is gone before the rollout ends


def test_the_evaluation_agent_reuses_caches_with_the_same_episodes(tmp_path):
    from stppo_agent.evaluation.evaluate import run_episodes
    from stppo_agent.evaluation.hf_agent import HFAgent
    from tests.support.retrievers import KeywordRetriever

    model = build_tiny_llama(tmp_path / "tiny", word_tokenizer(), hidden=32, layers=2, seed=5)
    records, processed_tokens = {}, {}
    for reuse in (False, True):
        agent = HFAgent(str(model), max_new_tokens=8, max_observation_tokens=24, batch_size=3, reuse_cache=reuse)
        processed = count_forward_tokens(agent.model)
        envs = [gym.make("stppo/NQ-v0", retriever=KeywordRetriever(PASSAGES), max_turns=3).unwrapped
                for _ in range(4)]
        records[reuse] = run_episodes(envs, agent, list(range(7)))  # two sets of episodes: 4, then 3
        processed_tokens[reuse] = sum(processed)
        assert len(agent.backend.turns.states) <= 2  # only the last set's chunks are held
        # a new set of episodes starts afresh
        assert set(agent.backend.turns.chunk_of) == {r["example_id"] for r in records[reuse][4:]}
    assert [r["transcript"] for r in records[True]] == [r["transcript"] for r in records[False]]
    assert sum(r["turns"] for r in records[True]) > 7  # episodes went past their first turn
    assert processed_tokens[True] < 0.8 * processed_tokens[False], processed_tokens


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
