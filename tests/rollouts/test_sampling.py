"""``stppo_agent.rollouts.sampling``: the sampling settings and the distribution they
describe -- temperature, top-k, top-p -- applied alike by generation and scoring."""

from __future__ import annotations

import types
import warnings

import pytest
import torch

from stppo_agent.rollouts import sampling as sampling_module
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
from tests.support.devices import F64

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
    assert caught[0].filename == warn_from_here.__code__.co_filename  # the caller's code, not the library
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
