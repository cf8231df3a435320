"""``stppo_agent.training.log_probs``: response-token log-probs, entropies and critic
values of each unpadded trajectory, under the sampling distribution, in length-sorted micro-batches."""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.training_parts import EPISODES, NoKeep, make_batch, tiny_lm


def row_logits(model, prompt, response):
    """Logits predicting each response token, from an unpadded forward of one trajectory."""
    ids = torch.tensor([list(prompt) + list(response)])
    return model(input_ids=ids).logits[0, len(prompt) - 1: len(prompt) - 1 + len(response)]


# -- log_probs ------------------------------------------------------------------------------------------------

def test_position_ids_skip_left_padding():
    from stppo_agent.training.log_probs import position_ids

    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0], [0, 0, 0, 0, 1]])
    assert position_ids(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3], [0, 0, 0, 0, 0]]


@pytest.mark.parametrize("keep", [True, False])
def test_response_logits_and_logprobs_are_those_of_each_unpadded_trajectory(keep):
    from stppo_agent.training.log_probs import accepts_logits_to_keep, response_logits, token_logprobs

    model = tiny_lm().eval()
    scored = model if keep else NoKeep(model)
    assert accepts_logits_to_keep(scored) is keep
    batch = make_batch()
    with torch.no_grad():
        logits = response_logits(scored, batch)
        logprobs, entropy = token_logprobs(scored, batch, with_entropy=True)
        for row, (prompt, pieces) in enumerate(EPISODES):
            response = [i for ids, _, _ in pieces for i in ids]
            n = len(response)
            expected = row_logits(model, prompt, response)
            assert torch.allclose(logits[row, :n], expected, atol=1e-5), row
            log_softmax = torch.log_softmax(expected, -1)
            chosen = log_softmax.gather(-1, torch.tensor(response)[:, None])[:, 0]
            assert torch.allclose(logprobs[row, :n], chosen, atol=1e-5), row
            mask = batch.loss_mask[row, :n]
            want = -(log_softmax.exp() * log_softmax).sum(-1)
            assert torch.allclose(entropy[row, :n][mask], want[mask], atol=1e-5), row
            assert (entropy[row][~batch.loss_mask[row]] == 0).all()
    assert logprobs.dtype == torch.float32 and logprobs.shape == batch.response_ids.shape


@pytest.mark.parametrize("keep", [True, False])
def test_the_forward_gets_the_mask_positions_and_no_cache(keep):
    """What the model is handed (transformers 5 infers a mask from position ids, so logits alone would not tell)."""
    from stppo_agent.training.log_probs import position_ids, response_logits

    seen = {}
    inner = tiny_lm().eval()

    class Recorder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None, **kwargs):
            seen.update(kwargs, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache)
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)

    class RecorderKeep(Recorder):
        def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None, logits_to_keep=0):
            return super().forward(input_ids, attention_mask, position_ids, use_cache, logits_to_keep=logits_to_keep)

    batch = make_batch()
    with torch.no_grad():
        logits = response_logits(RecorderKeep() if keep else Recorder(), batch)
    assert logits.shape[:2] == batch.response_ids.shape
    assert seen["attention_mask"] is batch.attention_mask and seen["use_cache"] is False
    assert torch.equal(seen["position_ids"], position_ids(batch.attention_mask))
    assert seen.get("logits_to_keep", None) == (batch.response_ids.shape[1] + 1 if keep else None)


def test_token_logprobs_score_under_the_sampling_temperature_and_truncation():
    from stppo_agent.rollouts.sampling import SamplingSettings
    from stppo_agent.training.log_probs import token_logprobs

    model = tiny_lm().eval()
    batch = make_batch()
    with torch.no_grad():
        plain, none = token_logprobs(model, batch)
        assert none is None
        hot, _ = token_logprobs(model, batch, sampling=SamplingSettings(temperature=2.0))
        prompt, pieces = EPISODES[0]
        response = [i for ids, _, _ in pieces for i in ids]
        logits = row_logits(model, prompt, response) / 2.0
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        assert torch.allclose(hot[0, :len(response)], want, atol=1e-5)
        assert not torch.allclose(hot, plain)
        truncated, _ = token_logprobs(model, batch, sampling=SamplingSettings(top_k=2))
        observed = ~batch.loss_mask & batch.attention_mask[:, batch.prompt_width:].bool()
        assert observed.any()  # tokens the policy did not act on are scored untruncated (their log-probs go unused)
        assert torch.allclose(truncated[observed], plain[observed], atol=1e-6)
        assert not torch.allclose(truncated[batch.loss_mask], plain[batch.loss_mask])
        _, entropy = token_logprobs(model, batch, with_entropy=True, sampling=SamplingSettings(top_k=3))
        assert torch.isfinite(entropy).all() and (entropy[batch.loss_mask] > 0).all()
        assert (entropy[batch.loss_mask] <= math.log(4) + 1e-5).all()  # support: 3 tokens and the sampled one


def test_the_entropy_carries_a_gradient_only_when_asked():
    from stppo_agent.training.log_probs import token_logprobs

    model = tiny_lm()
    batch = make_batch()
    logprobs, entropy = token_logprobs(model, batch, with_entropy=True)
    assert logprobs.requires_grad and not entropy.requires_grad
    _, entropy = token_logprobs(model, batch, with_entropy=True, entropy_grad=True)
    assert entropy.requires_grad
    with torch.no_grad():
        _, entropy = token_logprobs(model, batch, with_entropy=True, entropy_grad=True)
    assert not entropy.requires_grad


def test_critic_values_are_the_value_head_before_each_response_token():
    from stppo_agent.training.log_probs import critic_values

    critic = tiny_lm(1, critic=True).eval()
    batch = make_batch()
    with torch.no_grad():
        values = critic_values(critic, batch)
        assert values.shape == batch.response_ids.shape and values.dtype == torch.float32
        for row, (prompt, pieces) in enumerate(EPISODES):
            response = [i for ids, _, _ in pieces for i in ids]
            ids = torch.tensor([list(prompt) + response])
            want = critic(input_ids=ids).logits[0, len(prompt) - 1: len(prompt) - 1 + len(response), 0]
            assert torch.allclose(values[row, :len(response)], want, atol=1e-5), row


def test_the_critic_gets_the_mask_and_positions():
    from stppo_agent.training.log_probs import critic_values, position_ids

    seen = {}
    inner = tiny_lm(1, critic=True).eval()

    def critic(input_ids, attention_mask=None, position_ids=None):
        seen.update(attention_mask=attention_mask, position_ids=position_ids)
        return inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)

    batch = make_batch()
    with torch.no_grad():
        critic_values(critic, batch)
    assert seen["attention_mask"] is batch.attention_mask
    assert torch.equal(seen["position_ids"], position_ids(batch.attention_mask))


def test_length_sorted_micro_batches_cover_every_row_shortest_first():
    from stppo_agent.training.log_probs import length_sorted_micro_batches

    batch = make_batch()
    parts = list(length_sorted_micro_batches(batch, 4))
    assert [len(rows) for rows, _ in parts] == [4, 2]
    rows = torch.cat([r for r, _ in parts])
    lengths = batch.lengths()
    assert sorted(rows.tolist()) == list(range(6))
    assert lengths[rows].tolist() == sorted(lengths.tolist())
    assert rows.tolist() == torch.argsort(lengths, stable=True).tolist()
    first = parts[0][1]
    assert first.response_ids.shape[1] < batch.response_ids.shape[1]  # trimmed to its own longest
    assert first.response_ids.tolist() == batch.select(parts[0][0]).trimmed().response_ids.tolist()
    assert [len(r) for r, _ in length_sorted_micro_batches(batch, 1)] == [1] * 6


@pytest.mark.parametrize("training", [True, False])
def test_batched_no_grad_keeps_row_order_width_and_the_training_flag(training):
    from stppo_agent.training.log_probs import batched_no_grad, token_logprobs

    model = tiny_lm()
    model.train(training)
    batch = make_batch()
    out = batched_no_grad(token_logprobs, model, batch, 2)
    assert model.training is training and not out.requires_grad
    assert out.shape == batch.response_ids.shape
    with torch.no_grad():
        model.eval()
        whole, _ = token_logprobs(model, batch)
    mask = batch.attention_mask[:, batch.prompt_width:].bool()
    assert torch.allclose(out[mask], whole[mask], atol=1e-5)
    from stppo_agent.training.log_probs import length_sorted_micro_batches

    for rows, micro in length_sorted_micro_batches(batch, 2):
        assert (out[rows, micro.response_ids.shape[1]:] == 0).all()
    assert (out[:, -1] == 0).sum() == 4  # only the two longest rows reach the last column
