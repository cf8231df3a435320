"""A verl training engine (vendor ``stppo``) that applies ST-PPO's clip-bias correction: verl's FSDP2 engine
for language models, plus C taken per micro-batch and the gradient divided by ``max(1, ||C|| / kappa)`` after the
last micro-batch, before verl clips the gradient norm and steps (docs/verl.md, "The clip-bias engine").

verl picks an engine by ``(device, vendor)`` in ``EngineRegistry``; ``VERL_ENGINE_VENDOR=stppo`` in the workers'
environment selects this one for the actor (and the reference model, which only runs forward). The critic has no
``stppo`` engine and keeps verl's own. Registered for FSDP2 only (the backend tested; verl's FSDP1 does not run on
CPU): with ``strategy=fsdp``, another backend, or without the variable, verl builds its own engine and the policy
loss refuses at the first update (:class:`.correction.ClipBiasEngineMissingError`), never a silent Turn-PPO.

How a micro-batch runs: verl's ``forward_backward_batch`` calls :meth:`forward_step` inside its gradient-sync
context (FSDP2's no-sync on all but the last micro-batch by default); here the forward and the loss run while a
collector is active, the policy loss hands over its bias surrogate, and C's share is taken with
``torch.autograd.grad`` (graph kept) before verl's own ``loss.backward()``. ``.grad`` is never touched, so no-sync
on or off gives the same C and the same loss gradient (:mod:`.correction`).
"""

from __future__ import annotations

from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

from stppo_agent.algorithms import ALGORITHMS

from . import correction
from .losses import LOSS_PREFIX

VENDOR = "stppo"
DEVICES = ["cuda", "npu", "cpu"]  # cpu: verl has no CPU platform; the tests register one (tests/test_verl_engine.py)
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


class ClipBiasEngineMixin:
    """The correction on top of any verl engine whose ``forward_backward_batch`` calls ``forward_step`` once per
    micro-batch and then ``loss.backward()`` (verl's FSDP engines)."""

    _clip_bias: correction.ClipBiasBuffers | None = None

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
        output["metrics"].update({f"actor/stppo/{key}": value for key, value in step.items()})
        return output

    def forward_step(self, micro_batch, loss_function, forward_only):
        if self._clip_bias is None or forward_only:
            return super().forward_step(micro_batch, loss_function=loss_function, forward_only=forward_only)
        offered = []
        with correction.collecting(offered):
            loss, output = super().forward_step(micro_batch, loss_function=loss_function, forward_only=False)
        if len(offered) != 1:
            raise RuntimeError(f"clip-bias engine: expected one bias surrogate per micro-batch, got {len(offered)}")
        self._clip_bias.accumulate(*offered[0])
        return loss, output


@EngineRegistry.register(model_type="language_model", backend=BACKENDS, device=DEVICES, vendor=VENDOR)
class ClipBiasFSDPEngine(ClipBiasEngineMixin, FSDPEngineWithLMHead):
    """verl's FSDP2 language-model engine with ST-PPO's clip-bias correction."""
