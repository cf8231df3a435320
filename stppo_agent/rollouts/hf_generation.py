"""The Hugging Face generation backend: ``model.generate`` with stop strings, behaviour log-probs at sampling time,
and KV caches kept across a trajectory's turns."""

from __future__ import annotations

import contextlib
import inspect
import weakref
from typing import ContextManager, Hashable, Sequence

import torch
import transformers
from transformers import StoppingCriteria, StoppingCriteriaList

from stppo_agent.distributed import process_group
from stppo_agent.rollouts.append_cache import new_cache
from stppo_agent.rollouts.batch import left_pad
from stppo_agent.rollouts.generation import STOP_STRINGS, Generation, generated_length
from stppo_agent.rollouts.sampling import (
    SamplingSettings,
    generation_config,
    project_generation,
    warn_ignored_checkpoint_settings,
)
from stppo_agent.rollouts.shared_prefill import shared_prefill
from stppo_agent.rollouts.turn_cache import TurnCaches, after_generate, extend_inputs

# transformers renamed generate's past_key_values argument (and output field) to cache during the 5.x series (5.10,
# which verl 0.9 pins, still has past_key_values): ask the models' signature, not the version number
CACHE_ARGUMENT = "cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters \
    else "past_key_values"
CACHE_OUTPUT = CACHE_ARGUMENT


class HFGenerationBackend:
    """``model.generate`` with stop strings; behaviour log-probs from the processed scores at sampling time.

    ``generate`` runs with a complete generation config built from ``sampling`` alone
    (:func:`stppo_agent.rollouts.sampling.generation_config`): a checkpoint's own processors (a repetition penalty,
    ``no_repeat_ngram_size``, ...) are not applied -- the trainer's scoring would not know them -- and a warning
    names them once.

    Given ``keys`` (one per trajectory, stable over a rollout's turns), trajectories are generated in fixed chunks of
    ``batch_size`` and, with ``reuse_cache``, each chunk continues from the key/value cache of its previous turn
    instead of re-encoding the transcript (:mod:`stppo_agent.rollouts.turn_cache`); :meth:`end_rollout` frees the
    caches. Caches append in place (:mod:`stppo_agent.rollouts.append_cache`): transformers' default copies the whole
    cache at every token, which long multi-turn contexts pay quadratically.
    """

    def __init__(self, model, tokenizer, sampling: SamplingSettings = SamplingSettings(),
                 stop_strings: Sequence[str] = STOP_STRINGS, batch_size: int = 64, reuse_cache: bool = True,
                 autocast_dtype: str | None = None):
        self.model, self.tokenizer, self.sampling = model, tokenizer, sampling
        # generation_autocast_dtype: every generating forward runs under this autocast, the output head's too,
        # while the learner's forwards stay float32 (the gap a bfloat16 inference engine opens)
        self.autocast_dtype = getattr(torch, autocast_dtype) if autocast_dtype else None
        self.stop_strings, self.batch_size, self.reuse_cache = tuple(stop_strings), batch_size, reuse_cache
        self.eos_ids = _eos_ids(model, tokenizer)
        self.turns = TurnCaches(batch_size)
        # a fresh chunk's prefill encodes each distinct context once (:mod:`stppo_agent.rollouts.shared_prefill`):
        # the same tokens, log-probs and caches as encoding every copy -- tested bit for bit on CPUs only, so None
        # (the default) shares on a CPU alone; True / False force it
        self.share_prefill: bool | None = None
        warn_ignored_checkpoint_settings(model)

    @torch.no_grad()
    def generate(self, contexts: Sequence[Sequence[int]], max_new_tokens: int,
                 keys: Sequence[Hashable] | None = None) -> list[Generation]:
        if keys is None:  # no trajectory identity: independent chunks, nothing kept
            out: list[Generation] = []
            for start in range(0, len(contexts), self.batch_size):
                part = contexts[start:start + self.batch_size]
                out += self._generate(list(range(len(part))), part, max_new_tokens, None)[0]
            return out
        results: list[Generation | None] = [None] * len(contexts)
        groups = self.turns.groups(keys)
        # a chunk none of whose trajectories plays this turn is done (trajectories do not come back; one that did
        # would be re-encoded): free its cache now rather than at the end of the rollout
        for finished in set(self.turns.states) - {chunk for chunk, _ in groups}:
            del self.turns.states[finished]
        for chunk, positions in groups:
            chunk_keys, chunk_contexts = [keys[p] for p in positions], [contexts[p] for p in positions]
            state = self.turns.states.pop(chunk, None) if self.reuse_cache else None
            generations, state = self._generate(chunk_keys, chunk_contexts, max_new_tokens, state)
            if self.reuse_cache:
                self.turns.states[chunk] = state
            for position, generation in zip(positions, generations):
                results[position] = generation
        return results

    def end_rollout(self) -> None:
        self.turns.clear()

    def generating(self) -> ContextManager:
        """Generation runs a different number of forwards on every rank: an FSDP2 model is gathered for it."""
        return process_group.gathered(self.model)

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Nothing to do: ``self.model`` is the generating model itself (the actor, or the lagged copy that
        :class:`~stppo_agent.training.stale_policy.StalePolicy` moves)."""

    def _generate(self, keys, contexts, max_new_tokens: int, state):
        """Generate one chunk, continuing ``state``'s cache when the contexts extend it; returns the generations
        and the chunk's new state."""
        device = next(self.model.parameters()).device
        new = state.continuation(keys, contexts) if state is not None else None
        if new is not None:
            state.select(keys)
            input_ids, attention_mask = extend_inputs(state, new, self.tokenizer.pad_token_id)
            cache = state.cache
        else:
            input_ids, attention_mask = left_pad(contexts, self.tokenizer.pad_token_id, device)
            cache = new_cache(self.model.config)
        was_training = self.model.training
        self.model.eval()
        config = generation_config(self.sampling, max_new_tokens=max_new_tokens,
                                   pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.eos_ids)
        # ranks generate independently (an FSDP2 actor is gathered first): never lock-step
        kwargs = dict(generation_config=config, synced_gpus=False)
        if cache is not None:
            kwargs[CACHE_ARGUMENT] = cache
        if self.stop_strings:
            candidates = stop_candidate_ids(self.tokenizer, self.stop_strings)
            kwargs["stopping_criteria"] = StoppingCriteriaList(
                [StopOnStrings(self.tokenizer, self.stop_strings, input_ids.shape[1], candidates)])
        # torch.autocast refuses a device type it has no autocast for (meta, ...) even when disabled: not entered
        sampler_precision = (contextlib.nullcontext() if self.autocast_dtype is None
                             else torch.autocast(device.type, dtype=self.autocast_dtype))
        share = self.share_prefill if self.share_prefill is not None else device.type == "cpu"
        sharing = (shared_prefill(self.model, CACHE_ARGUMENT, CACHE_OUTPUT)
                   if share and new is None and cache is not None else contextlib.nullcontext())
        with project_generation(self.model, config), sampler_precision, sharing:
            output = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        self.model.train(was_training)
        generated = output.sequences[:, input_ids.shape[1]:]
        # log p(chosen) = score[chosen] - logsumexp(score) per step, scores after temperature / top-k / top-p: no
        # (B, steps, V) stack nor a V-wide log-softmax output (150 MB per turn for 16 rows of 48 tokens, 49k vocab)
        chosen = torch.stack([score.float().gather(1, generated[:, step:step + 1]).squeeze(1)
                              - torch.logsumexp(score.float(), dim=-1)
                              for step, score in enumerate(output.scores)], dim=1)
        results, lengths = [], []
        for row in range(generated.shape[0]):
            ids = generated[row].tolist()
            length = generated_length(ids, self.tokenizer, self.stop_strings, self.eos_ids)
            lengths.append(length)
            results.append(Generation(ids[:length], chosen[row, :length].tolist()))
        next_state = None
        if self.reuse_cache and output.get(CACHE_OUTPUT) is not None:
            next_state = after_generate(keys, contexts, input_ids, attention_mask, output.sequences, lengths,
                                        output.get(CACHE_OUTPUT))
        return results, next_state


_STOP_CANDIDATES: "weakref.WeakKeyDictionary[object, dict[tuple[str, ...], torch.Tensor]]" = weakref.WeakKeyDictionary()


def stop_candidate_ids(tokenizer, stop_strings: Sequence[str]) -> torch.Tensor:
    """The token ids that, decoded alone, hold the last character of a stop string: only such a token can complete
    one. Decoding the vocabulary once per tokenizer (0.5 s for SmolLM2's 49k tokens) spares every generation step a
    decode of every row's newest token."""
    known = _STOP_CANDIDATES.setdefault(tokenizer, {})
    key = tuple(stop_strings)
    if key not in known:
        last_chars = {stop[-1] for stop in stop_strings}
        texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=False)
        known[key] = torch.tensor([i for i, text in enumerate(texts) if any(ch in text for ch in last_chars)],
                                  dtype=torch.long)
    return known[key]


class StopOnStrings(StoppingCriteria):
    """Ends a row once the text it generated contains a stop string. Decodes only the last few tokens of rows whose
    newest token is in ``candidate_ids`` (:func:`stop_candidate_ids`), so it works with any tokenizer
    (transformers' own ``stop_strings`` needs a BPE-style vocabulary)."""

    def __init__(self, tokenizer, stop_strings: Sequence[str], prompt_width: int, candidate_ids: torch.Tensor,
                 window: int = 24):
        self.tokenizer, self.stop_strings = tokenizer, tuple(stop_strings)
        self.prompt_width, self.window, self.candidate_ids = prompt_width, window, candidate_ids
        self._is_candidate: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if input_ids.shape[1] <= self.prompt_width:
            return done
        candidates = self.is_candidate(input_ids[:, -1]).nonzero().flatten().tolist()
        if candidates:
            start = max(self.prompt_width, input_ids.shape[1] - self.window)
            tails = self.tokenizer.batch_decode(input_ids[candidates, start:], skip_special_tokens=False)
            for row, tail in zip(candidates, tails):
                done[row] = any(stop in tail for stop in self.stop_strings)
        return done

    def is_candidate(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Whether each of ``token_ids`` is in ``candidate_ids``: a lookup in a boolean table over the ids (what
        ``torch.isin`` answers, at a fraction of its cost per step); an id past the table is no candidate."""
        table = self._is_candidate
        if table is None or table.device != token_ids.device:
            size = int(self.candidate_ids.max()) + 2 if self.candidate_ids.numel() else 1
            table = torch.zeros(size, dtype=torch.bool, device=token_ids.device)
            table[self.candidate_ids.to(token_ids.device)] = True  # the last entry stays False: past the table
            self._is_candidate = table
        return table[token_ids.clamp(0, table.numel() - 1)]


def _eos_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id if getattr(model, "generation_config", None) else None
    ids = ids if ids is not None else tokenizer.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids
