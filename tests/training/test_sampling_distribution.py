"""The trainer scores samples under the distribution they were drawn from.

Temperature, top-k and top-p reshape the distribution ``generate`` samples from; the behaviour log-probs recorded at
sampling time are log-probs of that processed distribution. The trainer's old log-probs, reference log-probs and
the log-probs of the update must be taken under the same one, or a "first, on-policy" mini-batch already has
ratios far from 1. A checkpoint's own generation_config (repetition_penalty, no_repeat_ngram_size, ...) must not
add processors that scoring does not know about.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer
from stppo_agent.rollouts.sampling import SamplingSettings
from stppo_agent.training.config import merged
from stppo_agent.training.config_sections import RolloutConfig
from stppo_agent.training.log_probs import batched_no_grad, token_logprobs
from stppo_agent.training.trainer import Trainer
from tests.support.runs import toy_config


@pytest.fixture(scope="module")
def penalised_model(tmp_path_factory) -> Path:
    """A checkpoint that ships processors in its generation_config, as several instruct models do."""
    from transformers import GenerationConfig

    path = build_tiny_llama(tmp_path_factory.mktemp("tiny") / "penalised", word_tokenizer())
    config = GenerationConfig.from_pretrained(path)
    config.repetition_penalty, config.no_repeat_ngram_size = 1.3, 2
    config.save_pretrained(path)
    return path


def quick(model, out, **overrides):
    """One iteration; its first mini-batch on-policy: everything the scoring sees, nothing the update changes. Two
    mini-batches, so that scoring computes the old log-probs (one would leave them to the update's forward)."""
    values = dict(iterations=1,
                  rollout=dict(prompts_per_iteration=4, samples_per_prompt=2, max_new_tokens_per_turn=3,
                               max_total_tokens=40), optimizer=dict(mini_batch_size=4, micro_batch_size=4, epochs=1),
                  monitor=dict(on_collapse="none"))
    values = merged(values, overrides)
    return toy_config(model, out, "grpo", **values)


def scored_batch(trainer: Trainer):
    torch.manual_seed(0)
    batch = trainer.rollout()
    trainer.score(batch)
    return batch


def gap(batch) -> torch.Tensor:
    return (batch.old_logprobs - batch.sample_logprobs)[batch.loss_mask].abs()


@pytest.mark.parametrize("sampling", [dict(temperature=0.7), dict(top_p=0.9), dict(temperature=0.7, top_p=0.9),
                                      dict(top_k=3), dict(temperature=1.3, top_k=4, top_p=0.8)])
def test_old_logprobs_equal_the_behaviour_logprobs_at_any_sampling_setting(tiny_model, tmp_path, sampling):
    trainer = Trainer(quick(tiny_model, tmp_path, rollout=sampling))
    batch = scored_batch(trainer)
    assert gap(batch).max() < 1e-5 and gap(batch).mean() < 1e-6
    # the same batch under the raw logits is far off: the setting really reshapes the distribution
    raw = token_logprobs(trainer.state.actor, batch.to(trainer.device))[0]
    assert (raw - batch.sample_logprobs)[batch.loss_mask].abs().mean() > 0.01


def test_the_update_scores_the_same_distribution(tiny_model, tmp_path):
    """On the first mini-batch (the actor has not moved) every ratio is 1 under temperature and top-p."""
    trainer = Trainer(quick(tiny_model, tmp_path, rollout=dict(temperature=0.7, top_p=0.9)))
    batch = scored_batch(trainer)
    metrics = trainer.actor_gradients(batch)
    assert metrics["ratio/max"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["ratio/min"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["clip_frac"] == 0.0


def test_reference_logprobs_use_the_sampling_distribution(tiny_model, tmp_path):
    """The reference starts equal to the actor: under the same temperature and top-p its log-probs equal the
    behaviour log-probs."""
    config = quick(tiny_model, tmp_path, algorithm={"kl_in_reward": 0.0, "kl_loss_coef": 0.1},
                   rollout=dict(temperature=0.7, top_p=0.9))
    batch = scored_batch(Trainer(config))
    mask = batch.loss_mask
    assert (batch.ref_logprobs - batch.sample_logprobs)[mask].abs().max() < 1e-5
    torch.testing.assert_close(batch.ref_logprobs[mask], batch.old_logprobs[mask])


def test_checkpoint_processors_are_not_applied_and_are_named_once(penalised_model, tmp_path):
    with pytest.warns(UserWarning, match="no_repeat_ngram_size=2, repetition_penalty=1.3") as caught:
        trainer = Trainer(quick(penalised_model, tmp_path / "a"))
        batch = scored_batch(trainer)
    assert sum("generation_config" in str(w.message) for w in caught) == 1
    assert gap(batch).max() < 1e-5
    with warnings.catch_warnings():  # the same checkpoint again: said once already
        warnings.simplefilter("error")
        scored_batch(Trainer(quick(penalised_model, tmp_path / "b")))
    # the checkpoint's own generation_config is left as it was (it is saved with every checkpoint)
    assert trainer.state.actor.generation_config.repetition_penalty == 1.3


def test_plain_and_greedy_scoring_are_bit_identical_to_the_raw_logits(tiny_model, tmp_path):
    trainer = Trainer(quick(tiny_model, tmp_path))
    batch = scored_batch(trainer).to(trainer.device)
    raw, raw_entropy = token_logprobs(trainer.state.actor, batch, with_entropy=True)
    for sampling in (SamplingSettings(), SamplingSettings(temperature=0.5, top_p=0.5, greedy=True)):
        scored, entropy = token_logprobs(trainer.state.actor, batch, with_entropy=True, sampling=sampling)
        assert torch.equal(scored, raw) and torch.equal(entropy, raw_entropy)
    # temperature 1, top-p 1: the trainer's old log-probs are today's computation, bit for bit
    assert torch.equal(batch.old_logprobs, batched_no_grad(token_logprobs, trainer.state.actor, batch, 8))


def test_temperature_zero_means_greedy_and_bad_settings_are_named():
    from stppo_agent.training.config import TrainConfig

    assert TrainConfig(model="m", rollout=RolloutConfig(temperature=0.0)).sampling().greedy
    assert TrainConfig(model="m", rollout=RolloutConfig(temperature=0.7, top_p=0.9, top_k=5)).sampling() == \
        SamplingSettings(temperature=0.7, top_p=0.9, top_k=5)
    for bad, match in ((dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
                       (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k")):
        with pytest.raises(ValueError, match=match):
            SamplingSettings(**bad)
        with pytest.raises(ValueError, match=match):  # named by validate(), before any model loads
            TrainConfig(model="m", rollout=RolloutConfig(**bad)).validate()


@pytest.mark.parametrize("settings", [dict(temperature=0.7), dict(top_p=0.9), dict(top_k=5),
                                      dict(temperature=0.6, top_k=8, top_p=0.7), dict(temperature=1.5, top_p=0.3)])
def test_scoring_distribution_equals_transformers_warpers(settings, monkeypatch):
    """Log-probs under :func:`sampling_logits` equal those of transformers' processed scores (what ``generate``
    samples from and reports), over many rows -- several sort chunks."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from stppo_agent.rollouts import sampling as module

    monkeypatch.setattr(module, "ROWS_PER_CHUNK", 7)
    sampling = SamplingSettings(**settings)
    logits = torch.randn(6, 5, 50, generator=torch.Generator().manual_seed(1)) * 3
    flat = logits.reshape(-1, 50)
    processed = TemperatureLogitsWarper(sampling.temperature)(None, flat.clone())
    if sampling.top_k:
        processed = TopKLogitsWarper(sampling.top_k)(None, processed)
    if sampling.top_p < 1:
        processed = TopPLogitsWarper(sampling.top_p)(None, processed)
    expected = torch.log_softmax(processed, -1)
    tokens = torch.multinomial(expected.exp(), 1, generator=torch.Generator().manual_seed(2)).reshape(6, 5)
    ours = torch.log_softmax(module.sampling_logits(logits, tokens, sampling), -1).reshape(-1, 50)
    kept = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(ours), kept)
    torch.testing.assert_close(ours[kept], expected[kept], rtol=0, atol=1e-6)


def test_a_sampled_token_outside_the_nucleus_keeps_a_finite_logprob_and_the_gradient_flows():
    """Scoring may find a slightly different nucleus than generate did (another batch shape, a cache, an update
    since): the sampled token stays in, so its log-prob is finite and no ratio is NaN."""
    from stppo_agent.rollouts.sampling import sampling_logits

    logits = torch.tensor([[[4.0, 3.0, 0.0, -1.0]]], requires_grad=True)
    sampling = SamplingSettings(top_p=0.5)  # the nucleus is token 0 alone
    unlikely = torch.tensor([[3]])
    out = torch.log_softmax(sampling_logits(logits, unlikely, sampling), -1)
    assert torch.isfinite(out[0, 0, 3]) and torch.isinf(out[0, 0, 1]) and torch.isinf(out[0, 0, 2])
    assert float(out[0, 0, 3].detach()) == pytest.approx(float(torch.log_softmax(torch.tensor([4.0, -1.0]), 0)[1]))
    out[0, 0, 3].backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 0, 1] == 0 and logits.grad[0, 0, 0] != 0
    # positions outside ``where`` (observation tokens) are not truncated: their values are never used
    nothing = torch.zeros(1, 1, dtype=torch.bool)
    assert torch.isfinite(sampling_logits(logits, unlikely, sampling, where=nothing)).all()


def test_the_entropy_is_the_sampled_distributions(tiny_model, tmp_path):
    """Sampled with top-k 2, no position has more entropy than log 2; at temperature 0.5 it is lower than at 1."""
    trainer = Trainer(quick(tiny_model, tmp_path, rollout=dict(top_k=2)))
    batch = scored_batch(trainer).to(trainer.device)
    mask = batch.loss_mask

    def entropy(**settings):
        sampling = SamplingSettings(**settings)
        return token_logprobs(trainer.state.actor, batch, with_entropy=True, sampling=sampling)[1][mask]

    assert entropy(top_k=2).max() <= torch.log(torch.tensor(2.0)) + 1e-6
    assert entropy(temperature=0.5).mean() < entropy().mean()
    assert torch.isfinite(entropy(top_p=0.5)).all()


def test_a_rollout_logs_no_transformers_warning(tiny_model, tmp_path):
    """The project's GenerationConfig asks transformers for nothing it warns about: min_length and min_new_tokens
    both set made ``generate`` log "Both `min_new_tokens` ... seem to have been set" on every call of a rollout."""
    import logging

    from transformers.utils import logging as hf_logging

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    hf_logging.get_logger("transformers").addHandler(handler)
    try:
        trainer = Trainer(toy_config(tiny_model, tmp_path, "grpo", iterations=1))
        trainer.rollout()
    finally:
        hf_logging.get_logger("transformers").removeHandler(handler)
    assert not records, records
