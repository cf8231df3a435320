"""What every generation backend shares: one turn's sample, the backend protocol, and where a turn's generated
text really ends. Nothing here depends on a particular inference engine."""

from __future__ import annotations

import dataclasses
from typing import ContextManager, Hashable, Protocol, Sequence

STOP_STRINGS = ("</search>", "</answer>")


@dataclasses.dataclass
class Generation:
    """One turn's sample: token ids exactly as sampled and their log-probs under the sampling distribution."""

    token_ids: list[int]
    logprobs: list[float]


class GenerationBackend(Protocol):
    """Generates one turn for a batch of token sequences (HF: :mod:`stppo_agent.rollouts.hf_generation`; vLLM:
    :mod:`stppo_agent.rollouts.vllm_generation`)."""

    def generate(self, contexts: Sequence[Sequence[int]], max_new_tokens: int,
                 keys: Sequence[Hashable] | None = None) -> list[Generation]: ...


class TrainingBackend(GenerationBackend, Protocol):
    """A backend a trainer generates its rollouts with: besides one turn (:meth:`generate`), what the trainer needs
    around a rollout and after an update, so that a rollout source holds the backend and nothing of the trainer."""

    def generating(self) -> ContextManager:
        """Held while a rollout generates: the generating weights made whole (an FSDP2 model's shards gathered)."""
        ...

    def sync_weights(self, model) -> None:
        """The actor was updated (or rolled back): take its weights (a no-op for a backend that generates with the
        model object itself)."""
        ...


def generated_length(ids: Sequence[int], tokenizer, stop_strings: Sequence[str], eos_ids: Sequence[int]) -> int:
    """How many of ``ids`` the model really generated: through the first EOS, or through the token that
    completed a stop string (``generate`` pads finished rows, and the pad id is often the EOS id)."""
    length = len(ids)
    for i, token in enumerate(ids):
        if token in eos_ids:
            length = i + 1
            break
    if not stop_strings:
        return length

    def has_stop(n: int) -> bool:
        text = tokenizer.decode(ids[:n], skip_special_tokens=False)
        return any(stop in text for stop in stop_strings)

    if not has_stop(length):
        return length
    low, high = 1, length  # smallest n with a stop string in decode(ids[:n]); decoding is monotone in n
    while low < high:
        middle = (low + high) // 2
        if has_stop(middle):
            high = middle
        else:
            low = middle + 1
    return low

