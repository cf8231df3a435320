"""Forward passes over a RolloutBatch: per-token log-probs (and entropies) of a causal LM, critic values.

Alignment: with the prompt left-padded to width P, the logit at position P + t - 1 predicts response token t,
and the critic's output there is V(s_t), the value of the state before token t.
"""

from __future__ import annotations

import inspect

import torch

from stppo_agent.rollouts.batch import RolloutBatch
from stppo_agent.rollouts.sampling import SamplingSettings, sampling_logits


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as ``generate`` computes them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def accepts_logits_to_keep(model) -> bool:
    """Whether the model's forward can skip the LM head over positions (transformers' ``logits_to_keep``)."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def response_logits(model, batch: RolloutBatch) -> torch.Tensor:
    """(B, T, V) logits predicting each response token.

    Models that support ``logits_to_keep`` skip the LM head over the prompt (a large share of the work when the
    vocabulary is large and the prompt long).
    """
    width = batch.response_ids.shape[1]
    kwargs = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                  position_ids=position_ids(batch.attention_mask), use_cache=False)
    if accepts_logits_to_keep(model):
        return model(**kwargs, logits_to_keep=width + 1).logits[:, :width]  # positions P-1 .. P+T-1
    return model(**kwargs).logits[:, batch.prompt_width - 1: batch.prompt_width - 1 + width]


def token_logprobs(model, batch: RolloutBatch, with_entropy: bool = False, entropy_grad: bool = False,
                   sampling: SamplingSettings | None = None):
    """log pi(y_t | y_<t) for every response token (B, T) float32, and per-token entropy when asked.

    With ``sampling`` (the rollout's settings), pi is the distribution the tokens were sampled from: the logits
    divided by the temperature, truncated to the top-k / top-p support
    (:func:`stppo_agent.rollouts.sampling.sampling_logits`) -- what the behaviour log-probs were measured on. Greedy
    settings, or temperature 1 without truncation, score the raw logits exactly as without ``sampling``.

    ``logit[y] - logsumexp(logits)`` avoids keeping a second (B, T, V) tensor of log-probs for the backward pass.
    The entropy is computed only where the policy acted, and carries a gradient only with ``entropy_grad``
    (an entropy bonus needs it; the metric does not).
    """
    logits = sampling_logits(response_logits(model, batch).float(), batch.response_ids, sampling, batch.loss_mask)
    normalizer = torch.logsumexp(logits, dim=-1)
    chosen = logits.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1) - normalizer
    if not with_entropy:
        return chosen, None
    # the entropy of the same distribution as the log-probs: the one sampled from (temperature, truncation)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        policy_logits = logits[batch.loss_mask]
        probabilities, values = torch.softmax(policy_logits, dim=-1), policy_logits
        if sampling is not None and sampling.truncates:  # a removed token has probability 0: 0 * -inf would be NaN
            values = torch.where(torch.isfinite(policy_logits), policy_logits, 0.0)
        policy_entropy = normalizer[batch.loss_mask] - (probabilities * values).sum(-1)
        entropy = torch.zeros_like(chosen).masked_scatter(batch.loss_mask, policy_entropy)
    return chosen, entropy


def critic_values(critic, batch: RolloutBatch) -> torch.Tensor:
    """V(s_t) for every response position (B, T) float32."""
    width = batch.response_ids.shape[1]
    output = critic(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    position_ids=position_ids(batch.attention_mask))
    return output.logits[:, batch.prompt_width - 1: batch.prompt_width - 1 + width, 0].float()


def length_sorted_micro_batches(batch: RolloutBatch, micro_batch_size: int):
    """(rows, trimmed micro-batch) pairs covering ``batch``, rows grouped by length so that each micro-batch
    pads to its own longest trajectory rather than the batch's (the sum of micro-batch gradients, and every
    per-row result, does not depend on the grouping)."""
    order = torch.argsort(batch.lengths().cpu(), stable=True)
    for start in range(0, batch.batch_size, micro_batch_size):
        rows = order[start:start + micro_batch_size]
        yield rows, batch.select(rows).trimmed()


@torch.no_grad()
def batched_no_grad(fn, model, batch: RolloutBatch, micro_batch_size: int) -> torch.Tensor:
    """Apply ``fn(model, micro_batch)`` over length-grouped, trimmed micro-batches without gradients; the
    (B, T) result is in ``batch``'s row order and width (0 where a row was trimmed)."""
    was_training = model.training
    model.eval()
    out = None
    for rows, micro in length_sorted_micro_batches(batch, micro_batch_size):
        part = fn(model, micro)
        part = part[0] if isinstance(part, tuple) else part
        if out is None:
            out = torch.zeros(batch.batch_size, batch.response_ids.shape[1], dtype=part.dtype, device=part.device)
        out[rows.to(part.device), :part.shape[1]] = part
    model.train(was_training)
    return out
