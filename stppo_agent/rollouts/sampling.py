"""The distribution a rollout samples from, stated once and applied alike by generation and by scoring.

Sampling with temperature tau, top-k and top-p draws token y_t from a processed distribution, not from
softmax(logits): the logits divided by tau, then everything outside the k most likely tokens and outside the
nucleus (the smallest set of most likely tokens whose probability exceeds top_p) removed, in that order -- the
order of transformers' warpers and of vLLM's sampler. The behaviour log-probs a backend records are log-probs of
that processed distribution, so the trainer takes its old log-probs, its reference log-probs and the log-probs
of the update under the same one (as verl divides the logits by the rollout temperature in all three); otherwise
the ratios of an on-policy step are not 1 and ``rollout_logprob_diff`` measures the settings, not the mismatch.

Truncation in scoring (:func:`sampling_logits`): the kept set is found from the *detached* logits with the same
rule as transformers' ``TopKLogitsWarper`` / ``TopPLogitsWarper`` (and vLLM's ``apply_top_k_top_p``), and the
sampled token is always kept. At the edge of the nucleus a token that ``generate`` kept may fall just outside the
set that the scoring forward finds (another batch shape, a KV cache, bfloat16), and as the policy moves during
the update a sampled token may leave the current nucleus; either would give log-prob -inf and a NaN ratio. The
log-prob of a sampled token is therefore taken under the nucleus of the current logits plus that token. No
gradient flows through the choice of the set (a step function); it flows through the kept logits. Tokens tied
in value with the nucleus' smallest member are all kept (transformers keeps some of them, by sort order; ties
of float32 logits are rare).

Greedy decoding (``greedy=True``) samples nothing: its log-probs stay those of the raw logits, as are those of
temperature 1 without truncation -- bit for bit the same computation as without settings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings

import torch

ROWS_PER_CHUNK = 256
"""Positions sorted at once to find their nucleus: bounds the (rows, V) sort buffers (values + int64 indices)."""


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    """How a backend samples, and so how the trainer scores: temperature, top-p, greedy, top-k (0: off)."""

    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    top_k: int = 0

    def __post_init__(self):
        if not self.greedy and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature} (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")

    @property
    def truncates(self) -> bool:
        """Whether sampling draws from a truncated support (top-k or top-p)."""
        return not self.greedy and (self.top_p < 1.0 or self.top_k > 0)

    @property
    def reshapes(self) -> bool:
        """Whether the sampled distribution differs from softmax(logits)."""
        return not self.greedy and (self.temperature != 1.0 or self.truncates)


def sampling_logits(logits: torch.Tensor, tokens: torch.Tensor, sampling: SamplingSettings | None,
                    where: torch.Tensor | None = None) -> torch.Tensor:
    """``logits`` (..., V) of the distribution ``sampling`` draws from, with the gradient of the kept ones.

    Divided by the temperature; with top-k / top-p, -inf outside the truncated support found from the detached
    logits, except at ``tokens`` (..., the sampled ids), which are always kept. ``where`` (..., bool) limits the
    truncation to those positions (the policy's: the others' log-probs are never used, and the sort is the cost).
    Unchanged (the same tensor) when ``sampling`` does not reshape the distribution.
    """
    if sampling is None or not sampling.reshapes:
        return logits
    scaled = logits / sampling.temperature if sampling.temperature != 1.0 else logits
    if not sampling.truncates:
        return scaled
    with torch.no_grad():
        threshold = torch.full(scaled.shape[:-1], -torch.inf, dtype=scaled.dtype, device=scaled.device)
        rows = where if where is not None else torch.ones_like(threshold, dtype=torch.bool)
        index = rows.nonzero(as_tuple=True)
        flat = torch.empty(len(index[0]), dtype=scaled.dtype, device=scaled.device)
        for start in range(0, flat.shape[0], ROWS_PER_CHUNK):
            part = tuple(i[start:start + ROWS_PER_CHUNK] for i in index)
            flat[start:start + ROWS_PER_CHUNK] = support_threshold(scaled.detach()[part], sampling)
        threshold[index] = flat
        removed = scaled.detach() < threshold.unsqueeze(-1)
        removed.scatter_(-1, tokens.unsqueeze(-1), False)
    return scaled.masked_fill(removed, -torch.inf)


def support_threshold(scaled: torch.Tensor, sampling: SamplingSettings) -> torch.Tensor:
    """Per row of ``scaled`` (N, V: temperature already applied), the smallest logit sampling keeps.

    top-k: the k-th largest logit. top-p, on what top-k kept: sort ascending, remove the prefix whose cumulative
    probability is <= 1 - top_p, always keep the largest (transformers' ``TopPLogitsWarper``, vLLM's
    ``apply_top_k_top_p``).
    """
    if sampling.top_k > 0:
        kth = torch.topk(scaled, min(sampling.top_k, scaled.shape[-1]), dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, -torch.inf)
        if sampling.top_p >= 1.0:
            return kth.squeeze(-1)
    ascending = torch.sort(scaled, dim=-1).values
    removed = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - sampling.top_p
    removed[..., -1] = False
    first_kept = removed.sum(-1, keepdim=True)
    return ascending.gather(-1, first_kept).squeeze(-1)


# -- generation: the project's settings, never a checkpoint's leftovers -----------------------------------------

PROCESSOR_DEFAULTS = {
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "min_p": 0.0, "top_h": None, "typical_p": 1.0, "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0, "bad_words_ids": None, "sequence_bias": None, "suppress_tokens": None,
    "begin_suppress_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None, "min_length": 0,
    "min_new_tokens": 0, "exponential_decay_length_penalty": None, "renormalize_logits": False,
    "guidance_scale": 1.0, "watermarking_config": None, "remove_invalid_values": False, "num_beams": 1,
    "penalty_alpha": None, "dola_layers": None, "diversity_penalty": 0.0, "num_beam_groups": 1,
    "constraints": None, "force_words_ids": None, "token_healing": False,
}
"""generation_config fields that change what ``generate`` samples (or how it searches) beyond the project's
temperature / top-k / top-p, with the value that leaves sampling alone (None: unset)."""
SAMPLING_ONLY = ("min_p", "top_h", "typical_p", "epsilon_cutoff", "eta_cutoff")


def generation_config(sampling: SamplingSettings, *, max_new_tokens: int, pad_token_id: int,
                      eos_token_id: list[int]):
    """A complete ``GenerationConfig``: the project's sampling settings, every other processor explicitly off.

    ``generate`` fills what a passed config leaves unset (or, in transformers 4, left at a global default) from
    ``model.generation_config``; :func:`project_generation` also swaps that for this one during the call.
    """
    from transformers import GenerationConfig

    values = dict(do_sample=not sampling.greedy, max_new_tokens=max_new_tokens, pad_token_id=pad_token_id,
                  eos_token_id=eos_token_id, output_scores=True, return_dict_in_generate=True, use_cache=True,
                  num_return_sequences=1)
    values.update({key: value for key, value in PROCESSOR_DEFAULTS.items() if value is not None})
    # min_new_tokens=0 already means no minimum; transformers warns on every call where min_length is set too
    values.pop("min_length")
    # min_p=0 removes nothing, yet transformers builds its warper for any min_p that is set: a softmax, a max, a
    # top-k and a masked fill over the vocabulary at every step (11% of a small model's rollout on a CPU). Unset,
    # it cannot come from the checkpoint either: project_generation makes this config the model's for the call.
    values.pop("min_p")
    if sampling.greedy:  # sampling-only flags stay unset: greedy has no warpers (and transformers warns of them)
        for key in SAMPLING_ONLY:
            values.pop(key, None)
    else:
        values.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
    known = GenerationConfig().to_dict()  # fields differ between transformers versions
    return GenerationConfig(**{key: value for key, value in values.items() if key in known})


@contextlib.contextmanager
def project_generation(model, config):
    """``model.generation_config`` is ``config`` inside the block, and the checkpoint's own again after it (it is
    what a saved checkpoint writes, eos ids included)."""
    own = model.generation_config
    model.generation_config = config
    try:
        yield config
    finally:
        model.generation_config = own


def ignored_checkpoint_settings(model) -> dict[str, object]:
    """The processors ``model``'s own generation_config asks for that the project does not apply."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return {}
    ignored = {}
    for key, neutral in PROCESSOR_DEFAULTS.items():
        value = getattr(config, key, None)
        if value is not None and value != neutral:
            ignored[key] = value
    return ignored


_WARNED: set[tuple[str, str]] = set()


def warn_ignored_checkpoint_settings(model) -> None:
    """Say once per checkpoint that its generation_config's processors are not applied: sampling and scoring must
    see the same distribution, and scoring knows only temperature / top-k / top-p."""
    ignored = ignored_checkpoint_settings(model)
    if not ignored:
        return
    name = str(getattr(getattr(model, "config", None), "name_or_path", "") or type(model).__name__)
    listed = ", ".join(f"{key}={value}" for key, value in sorted(ignored.items()))
    if (name, listed) in _WARNED:
        return
    _WARNED.add((name, listed))
    warnings.warn(f"{name}: its generation_config sets {listed}; not applied -- rollouts sample with the run's "
                  "temperature / top_k / top_p only, the distribution the trainer scores", UserWarning, stacklevel=3)
