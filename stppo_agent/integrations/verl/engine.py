"""A verl training engine (vendor ``stppo``): verl's FSDP2 engine for language models, plus, for the ``stppo_*``
policy losses, the hand-over of the agent loops' turn record to the loss (:mod:`.turns`) and ST-PPO's clip-bias
correction: C taken per micro-batch and the gradient divided by ``max(1, ||C|| / kappa)`` after the last
micro-batch, before verl clips the gradient norm and steps (docs/verl.md, "The stppo engine").

verl picks an engine by ``(device, vendor)`` in ``EngineRegistry``; ``VERL_ENGINE_VENDOR=stppo`` in the workers'
environment selects this one for the actor (and the reference model, which only runs forward). The critic has no
``stppo`` engine and keeps verl's own. Registered for FSDP2 only (the backend tested; verl's FSDP1 does not run on
CPU): with ``strategy=fsdp``, another backend, or without the variable, verl builds its own engine and the
correction presets refuse at the first update (:class:`.correction.ClipBiasEngineMissingError`), never a silent
Turn-PPO.

How a micro-batch runs: verl's ``forward_backward_batch`` calls :meth:`forward_step` inside its gradient-sync
context (FSDP2's no-sync on all but the last micro-batch when ``use_no_sync_for_gradient_accumulation`` is on);
here the forward and the loss run with the micro-batch's turn record and, for the correction presets, a collector
active: the policy loss hands over its bias surrogate and the log-prob kernel's logits are recorded, and C's share is
taken with ``torch.autograd.grad`` from those logits (graph kept, not through the kernel) before verl's own
``loss.backward()``. ``.grad`` is never touched, so no-sync on or off gives the same C and the same loss gradient
(:mod:`.correction`).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

from verl.utils.metric import AggregationType, Metric
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp import transformer_impl
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

from stppo_agent.algorithms import ALGORITHMS

from . import correction, turns
from .losses import LOSS_PREFIX

VENDOR = "stppo"
# cpu: verl has no CPU platform; the tests register one (tests/integrations/verl/test_engine.py)
DEVICES = ["cuda", "npu", "cpu"]
BACKENDS = ["fsdp2"]


def preset_of(loss_function):
    """The preset of the ``stppo_<preset>`` policy loss that ``loss_function`` (verl's ``ppo_loss`` bound to the
    actor config) uses, or None; kappa is the preset's ``clip_bias_kappa`` (a preset registered with another kappa
    is its own ``stppo_<name>``)."""
    config = getattr(loss_function, "keywords", {}).get("config")
    policy_loss = getattr(config, "policy_loss", None)
    mode = policy_loss.get("loss_mode", "vanilla") if policy_loss is not None else "vanilla"
    if not mode.startswith(LOSS_PREFIX):
        return None
    return ALGORITHMS.get(mode[len(LOSS_PREFIX):])


def turn_record(micro_batch) -> list | None:
    """The micro-batch's turn spans per row (:data:`.turns.TURN_SPANS`; None for a row from a loop that writes
    none), or None when the batch carries no record."""
    if turns.TURN_SPANS not in micro_batch.keys():
        return None
    spans = micro_batch[turns.TURN_SPANS]
    return spans.tolist() if hasattr(spans, "tolist") else list(spans)


@contextmanager
def recording_log_prob_kernel(module, sink: list):
    """While active, every call of ``module.logprobs_from_logits`` (the log-prob kernel verl's engine calls:
    flash-attn's cross-entropy where installed, else log-softmax) appends ``(logits, labels, log_probs)`` to
    ``sink``."""
    kernel = module.logprobs_from_logits

    def recorded(logits, labels, *args, **kwargs):
        log_probs = kernel(logits, labels, *args, **kwargs)
        sink.append(correction.KernelCall(logits, labels, log_probs))
        return log_probs

    module.logprobs_from_logits = recorded
    try:
        yield sink
    finally:
        module.logprobs_from_logits = kernel


class ClipBiasEngineMixin:
    """The turn record and the correction on top of any verl engine whose ``forward_backward_batch`` calls
    ``forward_step`` once per micro-batch and then ``loss.backward()``, and whose ``prepare_model_outputs`` takes
    log-probs with ``logprobs_from_logits`` of the module in :attr:`log_prob_module` (verl's FSDP engines)."""

    log_prob_module = transformer_impl
    _clip_bias: correction.ClipBiasBuffers | None = None
    _kernel_calls: list | None = None

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        preset = preset_of(loss_function)
        if forward_only or preset is None or not preset.clip_bias_correction:
            return super().forward_backward_batch(data, loss_function, forward_only=forward_only)
        if getattr(self, "ulysses_sequence_parallel_size", 1) > 1:  # C's average would have to skip the SP ranks
            raise NotImplementedError("the stppo engine's clip-bias correction is not implemented for Ulysses "
                                      "sequence parallelism (ulysses_sequence_parallel_size > 1); docs/verl.md")
        no_sync = getattr(self.engine_config, "use_no_sync_for_gradient_accumulation", True)
        self._clip_bias = correction.ClipBiasBuffers(preset.clip_bias_kappa, group=self.get_data_parallel_group(),
                                                     shard=not no_sync)
        try:
            output = super().forward_backward_batch(data, loss_function, forward_only=False)
            step = self._clip_bias.scale_gradients(self.module.parameters())
        finally:
            self._clip_bias = None
        # a Metric, as verl's loss metrics leave forward_backward_batch: TrainingWorker aggregates those over ranks
        output["metrics"].update({f"actor/stppo/{key}": Metric(AggregationType.MEAN, value)
                                  for key, value in step.items()})
        return output

    def forward_step(self, micro_batch, loss_function, forward_only):
        if forward_only or preset_of(loss_function) is None:
            return super().forward_step(micro_batch, loss_function=loss_function, forward_only=forward_only)
        with turns.recorded(turn_record(micro_batch)):
            if self._clip_bias is None:
                return super().forward_step(micro_batch, loss_function=loss_function, forward_only=False)
            offered, self._kernel_calls = [], []
            try:
                with correction.collecting(offered):
                    loss, output = super().forward_step(micro_batch, loss_function=loss_function, forward_only=False)
                calls = self._kernel_calls
            finally:
                self._kernel_calls = None
        if len(offered) != 1:
            raise RuntimeError(f"clip-bias engine: expected one bias surrogate per micro-batch, got {len(offered)}")
        self._clip_bias.accumulate(*offered[0], kernel_calls=calls)
        return loss, output

    def prepare_model_outputs(self, *args, **kwargs):
        recording = (nullcontext() if self._kernel_calls is None
                     else recording_log_prob_kernel(self.log_prob_module, self._kernel_calls))
        with recording:
            return super().prepare_model_outputs(*args, **kwargs)


@EngineRegistry.register(model_type="language_model", backend=BACKENDS, device=DEVICES, vendor=VENDOR)
class ClipBiasFSDPEngine(ClipBiasEngineMixin, FSDPEngineWithLMHead):
    """verl's FSDP2 language-model engine with the turn record and ST-PPO's clip-bias correction."""
