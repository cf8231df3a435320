"""``stppo_agent.rollouts.hf_generation``: behaviour log-probs of exactly the
generated tokens, stop strings, eos ids, cache reuse across turns, and how ``model.generate`` is called."""

from __future__ import annotations

import types
import warnings

import pytest
import torch

from stppo_agent.models.tiny import tiny_generation_model
from stppo_agent.rollouts import hf_generation
from stppo_agent.rollouts import sampling as sampling_module
from stppo_agent.rollouts.append_cache import AppendLayer
from stppo_agent.rollouts.hf_generation import HFGenerationBackend, StopOnStrings, _eos_ids, stop_candidate_ids
from stppo_agent.rollouts.sampling import SamplingSettings, sampling_logits

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


def _autocast_seen(model, backend) -> set:
    seen = set()
    handle = model.register_forward_pre_hook(
        lambda module, args: seen.add(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None))
    try:
        torch.manual_seed(0)
        backend.generate([[3, 4], [5]], 3)
    finally:
        handle.remove()
    return seen


@pytest.mark.parametrize("name, dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16), (None, None)])
def test_generation_runs_under_the_samplers_autocast_and_only_then(tiny, name, dtype):
    model, tok = tiny
    backend = HFGenerationBackend(model, tok, stop_strings=(), autocast_dtype=name)
    assert backend.autocast_dtype is dtype
    assert _autocast_seen(model, backend) == {dtype}
    assert torch.is_autocast_enabled("cpu") is False  # left on exit


def test_generate_is_called_unsynced_with_the_projects_config_and_a_cache_for_the_models_layers(tiny, monkeypatch):
    """Ranks generate independently (``synced_gpus=False``: transformers' None would lock-step FSDP ranks), rows
    are padded with the tokenizer's pad id, and the fresh cache is laid out for this model's config (its sliding
    or full attention layers)."""
    import stppo_agent.rollouts.hf_generation as hf_generation

    model, tok = tiny
    calls, caches = [], []
    real_generate, real_new_cache = model.generate, hf_generation.new_cache
    monkeypatch.setattr(model, "generate", lambda **kw: calls.append(kw) or real_generate(**kw))
    monkeypatch.setattr(hf_generation, "new_cache", lambda config: caches.append(config) or real_new_cache(config))
    backend = HFGenerationBackend(model, tok, stop_strings=())
    torch.manual_seed(0)
    backend.generate([[3, 4], [5]], 3)
    [kw] = calls
    assert kw["synced_gpus"] is False
    assert kw["generation_config"].pad_token_id == tok.pad_token_id == 0
    assert kw["generation_config"].eos_token_id == [1] and kw["generation_config"].max_new_tokens == 3
    assert caches == [model.config]


def test_without_cache_reuse_no_turn_state_is_built(tiny, monkeypatch):
    import stppo_agent.rollouts.hf_generation as hf_generation

    model, tok = tiny
    built = []
    real = hf_generation.after_generate
    monkeypatch.setattr(hf_generation, "after_generate", lambda *a: built.append(1) or real(*a))
    torch.manual_seed(0)
    HFGenerationBackend(model, tok, stop_strings=(), reuse_cache=False).generate([[3, 4], [5]], 2, keys=["a", "b"])
    assert built == []
    HFGenerationBackend(model, tok, stop_strings=(), reuse_cache=True).generate([[3, 4], [5]], 2, keys=["a", "b"])
    assert built == [1]


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
