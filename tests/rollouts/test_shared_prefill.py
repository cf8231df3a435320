"""A fresh chunk's prefill encodes each distinct context once, and the rollout is bit for bit the one that encodes
every copy; the stop check's lookup table answers what ``torch.isin`` did; no no-op logits processor runs."""

from __future__ import annotations

import contextlib
import inspect

import gymnasium as gym
import pytest
import torch
import transformers

import stppo_envs  # noqa: F401
from stppo_agent.models.loading import load_actor
from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer
from stppo_agent.rollouts.append_cache import new_cache
from stppo_agent.rollouts.hf_generation import CACHE_ARGUMENT, CACHE_OUTPUT, HFGenerationBackend, StopOnStrings
from stppo_agent.rollouts.sampling import SamplingSettings, generation_config
from stppo_agent.rollouts.shared_prefill import distinct_rows, shared_prefill
from stppo_agent.rollouts.turn_loop import RolloutLimits, collect_rollouts
from tests.support.retrievers import PASSAGES, KeywordRetriever


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from stppo_agent.models.default_model import smollm2_path
    from stppo_agent.models.loading import load_tokenizer

    return load_tokenizer(str(smollm2_path()))


def decoder_rows(model) -> list[int]:
    """Rows of every forward of the model's body (the decoder), recorded by a hook."""
    seen = []

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0]
        seen.append(int(ids.shape[0]))

    model.get_decoder().register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def rollout(model, tokenizer, env_id: str, share: bool, reuse: bool, samples: int = 3, prompts: int = 3):
    kwargs = dict(retriever=KeywordRetriever(PASSAGES), max_turns=3) if env_id == "stppo/NQ-v0" else \
        dict(turns=3, fixed_target=None)
    envs = [gym.make(env_id, **kwargs).unwrapped for _ in range(samples * prompts)]
    backend = HFGenerationBackend(model, tokenizer, SamplingSettings(), batch_size=16, reuse_cache=reuse)
    backend.share_prefill = share
    limits = RolloutLimits(max_turns=3, max_new_tokens_per_turn=10, max_observation_tokens=24, max_prompt_tokens=400,
                           max_total_tokens=600)
    torch.manual_seed(0)
    # GRPO's layout: each prompt sampled `samples` times (the same question, the same reset seed)
    return collect_rollouts(backend, tokenizer, envs, [{"index": i // samples} for i in range(len(envs))],
                            [i // samples for i in range(len(envs))], limits,
                            seeds=[i // samples for i in range(len(envs))])


@pytest.mark.parametrize("reuse", [True, False])
@pytest.mark.parametrize("env_id,vocabulary", [("stppo/NQ-v0", "smollm2"), ("stppo/Toy-v0", "words")])
def test_sharing_the_prefill_gives_the_same_rollout_bit_for_bit(smollm2_tokenizer, tmp_path, reuse, env_id,
                                                                vocabulary):
    tok = smollm2_tokenizer if vocabulary == "smollm2" else word_tokenizer()
    model = load_actor(build_tiny_llama(tmp_path / "tiny", tok, hidden=32, layers=2, seed=5))
    rows = decoder_rows(model)
    plain = rollout(model, tok, env_id, share=False, reuse=reuse)
    plain_rows, rows[:] = list(rows), []
    shared = rollout(model, tok, env_id, share=True, reuse=reuse)
    assert int(plain.loss_mask.sum()) > 9 * 3  # several turns of several tokens: the comparison means something
    assert plain_rows[0] == 9 and rows[0] == 3, (plain_rows, rows)  # 3 prompts x 3 samples: encoded once each
    for field in ("input_ids", "attention_mask", "response_ids", "loss_mask", "turn_ids", "sample_logprobs"):
        assert torch.equal(getattr(plain, field), getattr(shared, field)), field
    assert rows[1:] == plain_rows[1:]  # later forwards (decode steps, later turns) are the model's own


def generate(model, ids, mask, share: bool, cache=None, autocast: bool = False):
    torch.manual_seed(1)
    cache = new_cache(model.config) if cache is None else cache
    precision = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with torch.no_grad(), precision, \
            (shared_prefill(model, CACHE_ARGUMENT, CACHE_OUTPUT) if share else contextlib.nullcontext()):
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=4, min_new_tokens=4,
                             output_scores=True, return_dict_in_generate=True, pad_token_id=0,
                             **{CACHE_ARGUMENT: cache})
    return out


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bfloat16-autocast"])
def test_the_cache_and_scores_equal_those_of_a_plain_prefill(smollm2_tokenizer, tmp_path, autocast):
    # wide enough that the output head's matrix product over 8 rows rounds otherwise than over 32: the head must
    # run over every row (a cheaper sharing that copied the logits out fails here)
    model = load_actor(build_tiny_llama(tmp_path / "tiny", smollm2_tokenizer, hidden=256, layers=1, seed=5)).eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 1000, (8, 9), generator=generator).repeat_interleave(4, dim=0)
    mask = torch.ones_like(ids)
    mask[4:8, :2] = 0  # left padding on the copies of one prompt
    plain = generate(model, ids, mask, share=False, autocast=autocast)
    shared = generate(model, ids, mask, share=True, autocast=autocast)
    assert torch.equal(plain.sequences, shared.sequences)
    assert all(torch.equal(a, b) for a, b in zip(plain.scores, shared.scores))
    plain_cache, shared_cache = plain[CACHE_OUTPUT], shared[CACHE_OUTPUT]
    assert len(plain_cache.layers) == len(shared_cache.layers) == 1
    for a, b in zip(plain_cache.layers, shared_cache.layers):
        assert type(a) is type(b) and torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_distinct_rows_pairs_ids_with_their_mask():
    ids = torch.tensor([[1, 2], [1, 2], [3, 4], [1, 2]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [0, 1]])
    first, inverse = distinct_rows(ids, mask)
    assert first.tolist() == [0, 2, 3] and inverse.tolist() == [0, 0, 1, 2]
    assert distinct_rows(ids[:3:2], mask[:3:2]) is None  # nothing to share
    first, inverse = distinct_rows(ids, None)
    assert first.tolist() == [0, 2] and inverse.tolist() == [0, 0, 1, 0]


def test_what_it_cannot_share_runs_the_plain_forward(smollm2_tokenizer, tmp_path):
    model = load_actor(build_tiny_llama(tmp_path / "tiny", smollm2_tokenizer, hidden=32, layers=2, seed=5)).eval()
    rows = decoder_rows(model)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    generate(model, ids, torch.ones_like(ids), share=True)  # no two rows alike
    assert rows[0] == 2
    rows[:] = []
    twice = ids[[0, 0]]
    cache = new_cache(model.config)
    with torch.no_grad():
        model(input_ids=twice[:, :2], attention_mask=torch.ones_like(twice[:, :2]), **{CACHE_ARGUMENT: cache})
    rows[:] = []
    with torch.no_grad(), shared_prefill(model, CACHE_ARGUMENT, CACHE_OUTPUT):  # a cache that holds positions
        model(input_ids=twice[:, 2:], attention_mask=torch.ones_like(twice), **{CACHE_ARGUMENT: cache})
        model(input_ids=twice, attention_mask=torch.ones_like(twice), **{CACHE_ARGUMENT: new_cache(model.config)})
    assert rows == [2, 2]  # the first forward was not shareable, and only the first is ever shared


def test_the_model_is_left_as_it_was(smollm2_tokenizer, tmp_path):
    model = load_actor(build_tiny_llama(tmp_path / "tiny", smollm2_tokenizer, hidden=32, layers=2, seed=5)).eval()
    with shared_prefill(model, CACHE_ARGUMENT, CACHE_OUTPUT):
        # generate reads the forward's signature (logits_to_keep): the wrapper shows the model's own
        assert inspect.signature(model.forward) == inspect.signature(type(model).forward.__get__(model))
    assert "forward" not in model.__dict__  # never called: removed all the same
    ids = torch.tensor([[5, 6, 7], [5, 6, 7]])
    generate(model, ids, torch.ones_like(ids), share=True)
    assert "forward" not in model.__dict__


def test_the_stop_check_table_answers_what_isin_did():
    candidates = torch.tensor([3, 17, 40, 41])
    stop = StopOnStrings(tokenizer=None, stop_strings=("x",), prompt_width=0, candidate_ids=candidates)
    ids = torch.tensor([0, 3, 16, 17, 40, 41, 42, 10_000, 2**40])
    assert torch.equal(stop.is_candidate(ids), torch.isin(ids, candidates))
    empty = StopOnStrings(tokenizer=None, stop_strings=("x",), prompt_width=0,
                          candidate_ids=torch.tensor([], dtype=torch.long))
    assert not empty.is_candidate(ids).any()


@pytest.mark.parametrize("sampling", [SamplingSettings(), SamplingSettings(greedy=True)])
def test_no_logits_processor_runs_at_temperature_one_without_truncation(sampling):
    # min_p=0 removes nothing, but transformers builds (and runs, every step) its warper for any min_p that is set
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
    config = generation_config(sampling, max_new_tokens=4, pad_token_id=0, eos_token_id=[1])
    processors = model._get_logits_processor(
        generation_config=config, input_ids_seq_length=3, encoder_input_ids=torch.ones(1, 3, dtype=torch.long),
        prefix_allowed_tokens_fn=None, logits_processor=transformers.LogitsProcessorList())
    assert list(processors) == []


def test_by_default_a_cpu_backend_shares_the_prefill(smollm2_tokenizer, tmp_path):
    model = load_actor(build_tiny_llama(tmp_path / "tiny", smollm2_tokenizer, hidden=32, layers=2, seed=5))
    backend = HFGenerationBackend(model, smollm2_tokenizer, SamplingSettings(), batch_size=8)
    assert backend.share_prefill is None  # auto: on a CPU
    rows = decoder_rows(model)
    backend.generate([[5, 6, 7]] * 4 + [[8, 9]] * 4, 3, keys=list(range(8)))
    assert rows[0] == 2
