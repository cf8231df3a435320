"""A vLLM generation backend (optional: ``pip install stppo[vllm]``), colocated with the trainer.

Importing this module never needs vLLM; constructing the backend does. Prompts go in as token ids and samples
come back as token ids with their log-probs (token-in/token-out), stopping at ``</search>`` / ``</answer>`` with
the stop string kept in the output. After every update the trainer pushes the actor's weights into the engine
with :meth:`VLLMGenerationBackend.sync_weights` (no checkpoint round-trip).

Distributions: the engine samples with the run's temperature / top-k / top-p and nothing else (no repetition,
presence or frequency penalty, no min-p, and not the checkpoint's generation_config), and reports each sampled
token's log-prob under that processed distribution (``logprobs_mode=processed_logprobs``). The trainer scores
the same processed distribution (:mod:`stppo_agent.rollouts.sampling`), so ``rollout_logprob_diff`` measures the
engine's numerical mismatch alone, at any sampling setting. A vLLM without ``logprobs_mode`` (V1 before it had the
option) reports raw log-probs: the backend then warns when the settings reshape the distribution.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, ContextManager, Iterable, Iterator, Sequence

import torch

from stppo_agent.rollouts.generation import STOP_STRINGS, Generation
from stppo_agent.rollouts.sampling import SamplingSettings

INSTALL_HINT = "the vLLM backend needs vllm: pip install 'stppo[vllm]' (on a machine with a CUDA GPU)"


def sampling_kwargs(sampling: SamplingSettings, max_new_tokens: int, stop_strings: Sequence[str],
                    seed: int | None = None) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` matching the HF backend's sampling: every processor that
    could reshape the distribution is set, to the run's value or off."""
    kwargs: dict[str, Any] = {
        "max_tokens": max_new_tokens, "stop": list(stop_strings), "include_stop_str_in_output": True,
        "logprobs": 0,  # the sampled token's log-prob (vLLM: 0 extra alternatives)
        "skip_special_tokens": False, "detokenize": True,
        "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0,
    }
    if sampling.greedy:
        kwargs.update(temperature=0.0)
    else:  # top_k -1 is "off" in every vLLM (0 only in newer ones)
        kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p,
                      top_k=sampling.top_k if sampling.top_k > 0 else -1)
    if seed is not None:
        kwargs["seed"] = seed
    return kwargs


def token_prompts(contexts: Sequence[Sequence[int]]) -> list[dict[str, list[int]]]:
    """vLLM ``TokensPrompt`` dicts: the exact ids, so nothing is re-tokenised."""
    return [{"prompt_token_ids": [int(t) for t in context]} for context in contexts]


def generations_from_outputs(outputs: Iterable[Any]) -> list[Generation]:
    """``RequestOutput`` objects -> :class:`Generation` (ids as sampled, log-prob of each sampled id)."""
    result = []
    for output in outputs:
        completion = output.outputs[0]
        ids = [int(t) for t in completion.token_ids]
        logprobs = []
        for position, token in enumerate(ids):
            entry = completion.logprobs[position] if completion.logprobs else None
            logprobs.append(float(entry[token].logprob) if entry and token in entry else float("nan"))
        result.append(Generation(ids, logprobs))
    return result


def weight_items(model: torch.nn.Module, chunk_bytes: int = 1 << 30) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The actor's parameters and buffers as (name, tensor) chunks of about ``chunk_bytes`` (FSDP2 shards
    gathered), with the
    ``module.`` prefix of DDP/FSDP wrappers removed (vLLM expects the Hugging Face names)."""
    from torch.distributed.tensor import DTensor

    chunk, size = [], 0
    for name, tensor in model.state_dict().items():
        if isinstance(tensor, DTensor):  # FSDP2 shard: gather the whole tensor (a collective: all ranks sync)
            tensor = tensor.full_tensor()
        while name.startswith("module."):
            name = name[len("module."):]
        name = name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")
        chunk.append((name, tensor.detach()))
        size += tensor.numel() * tensor.element_size()
        if size >= chunk_bytes:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def engine_defaults(vllm: Any) -> dict[str, Any]:
    """Engine options this vLLM knows: log-probs after temperature / top-k / top-p (V1 reports raw ones by
    default), so they compare with the HF backend's and with the trainer's old log-probs, which score the same
    processed distribution; and vLLM's own sampling defaults rather than the checkpoint's generation_config."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(vllm.EngineArgs)} if hasattr(vllm, "EngineArgs") else set()
    options = {"logprobs_mode": "processed_logprobs"} if "logprobs_mode" in fields else {}
    if "generation_config" in fields:
        options["generation_config"] = "vllm"
    return options


class VLLMGenerationBackend:
    """``vllm.LLM`` behind the :class:`~stppo_agent.rollouts.generation.GenerationBackend` interface."""

    def __init__(self, model_path: str, sampling: SamplingSettings = SamplingSettings(),
                 stop_strings: Sequence[str] = STOP_STRINGS, *, gpu_memory_utilization: float = 0.35,
                 dtype: str = "bfloat16", tensor_parallel_size: int = 1, seed: int = 0, **llm_kwargs: Any):
        try:
            import vllm
        except ImportError as exc:
            raise ImportError(INSTALL_HINT) from exc
        self._vllm = vllm
        self.sampling, self.stop_strings, self.seed = sampling, tuple(stop_strings), seed
        defaults = engine_defaults(vllm)
        if sampling.reshapes and "logprobs_mode" not in defaults:
            warnings.warn(f"vLLM {getattr(vllm, '__version__', '?')} has no logprobs_mode: its V1 engine reports "
                          "log-probs of the raw logits, not of the temperature / top-k / top-p distribution it "
                          "samples from, so rollout_logprob_diff and the rollout correction see the settings; "
                          "upgrade vllm", UserWarning, stacklevel=2)
        self.llm = vllm.LLM(model=model_path, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
                            tensor_parallel_size=tensor_parallel_size, enable_prefix_caching=True, seed=seed,
                            **{**defaults, **llm_kwargs})
        self._calls = 0

    def generate(self, contexts: Sequence[Sequence[int]], max_new_tokens: int, keys=None) -> list[Generation]:
        """``keys`` (trajectory identities) are not needed: vLLM's prefix caching reuses earlier turns by itself."""
        params = self._vllm.SamplingParams(**sampling_kwargs(self.sampling, max_new_tokens, self.stop_strings,
                                                             self.seed + self._calls))
        self._calls += 1
        outputs = self.llm.generate(token_prompts(contexts), params, use_tqdm=False)
        return generations_from_outputs(outputs)

    def generating(self) -> ContextManager:
        """The engine holds its own whole copy of the weights: nothing to gather."""
        return contextlib.nullcontext()

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Load the trainer's current actor weights into the engine, chunk by chunk; reset the prefix cache."""
        for chunk in weight_items(model):
            if hasattr(self.llm, "apply_model"):  # vLLM >= 0.9: the supported way into the worker's model
                self.llm.apply_model(lambda engine_model, chunk=chunk: engine_model.load_weights(weights=chunk))
            else:
                _engine_model(self.llm).load_weights(weights=chunk)
        if hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()


def _engine_model(llm: Any) -> Any:
    """The engine's torch model in a colocated (in-process) vLLM; a clear error where the layout differs."""
    paths = ("llm_engine.model_executor.driver_worker.worker.model_runner.model",
             "llm_engine.model_executor.driver_worker.model_runner.model")
    for path in paths:
        target = llm
        try:
            for attribute in path.split("."):
                target = getattr(target, attribute)
            return target
        except AttributeError:
            continue
    raise RuntimeError("cannot reach the vLLM engine's model in this process: run vLLM in-process "
                       "(VLLM_ENABLE_V1_MULTIPROCESSING=0) so weights can be synced after each update")
