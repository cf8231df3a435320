"""Whole actor updates of every ``stppo_*`` policy loss through verl's own ``TrainingWorker.train_mini_batch`` (the
path of ``ActorRolloutRefWorker.update_actor``): the batch as verl's trainer hands it over (``DataProto`` with the
agent loops' turn record, ``to_tensordict``, no-padding), the ``stppo`` engine picked by ``VERL_ENGINE_VENDOR``, 2
micro-batches, SGD with lr 1 so that the parameters move by exactly the gradient the update used. Each update is held
against this project's own loss (and clip-bias corrector) on the whole batch.

Two log-prob kernels: verl's own (log-softmax), and one with flash-attn's cross-entropy contract, whose backward
writes the gradient into the logits it saved (``inplace_backward=True``, verl's default on GPU): a second backward
through it reads garbage. And verl's token-level rollout rejection (``rollout_rs=token_k1``) applied to the mask, which
splits turns unless the loss reads them from the turn record.

verl runs in one subprocess (``python tests/integrations/verl/test_training_worker.py worker ...``) for every case.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from tests.support.requires import require_verl

require_verl()

import torch  # noqa: E402

from stppo_agent.algorithms import ALGORITHMS, ClipBiasCorrector, get_policy_loss  # noqa: E402
from stppo_agent.integrations.verl.settings import not_in_verl  # noqa: E402
from stppo_agent.integrations.verl.turns import TURN_SPANS, spans_from_mask, turn_ids_from_mask  # noqa: E402
from tests.support.verl_workers import (  # noqa: E402
    CLIP_HIGH,
    CLIP_LOW,
    GRAD_TOL,
    launch_workers,
    make_batch,
    register_cpu_platform,
    response_log_probs,
    tiny_model_configs,
)

CORRECTION = [name for name, preset in ALGORITHMS.items() if preset.clip_bias_correction]
TURN_LEVEL = ["turn_ppo", "st_ppo"]


class InPlaceCrossEntropy(torch.autograd.Function):
    """flash-attn's ``cross_entropy_loss(logits, labels, inplace_backward=True)`` as verl calls it: returns
    ``(losses, z_losses)``, and its backward computes the gradient from the logits it saved and writes it into their
    storage behind autograd's back (a Triton kernel: no version bump), so a second backward through the same node
    differentiates through garbage. ``backward_calls`` counts its backwards."""

    backward_calls = 0

    @staticmethod
    def forward(ctx, logits, labels, inplace_backward=True):
        lse = torch.logsumexp(logits.float(), dim=-1)
        losses = lse - logits.float().gather(-1, labels[:, None]).squeeze(-1)
        ctx.save_for_backward(logits, labels, lse)
        ctx.inplace_backward = inplace_backward
        return losses, torch.zeros_like(losses)

    @staticmethod
    def backward(ctx, grad_losses, grad_z_losses):
        InPlaceCrossEntropy.backward_calls += 1
        logits, labels, lse = ctx.saved_tensors
        gradient = torch.exp(logits.float() - lse[:, None])
        gradient.scatter_add_(-1, labels[:, None], -torch.ones_like(gradient[:, :1]))
        gradient = (gradient * grad_losses[:, None]).to(logits.dtype)
        if not ctx.inplace_backward:
            return gradient, None, None
        logits.data.copy_(gradient)
        return logits, None, None


def use_kernel(kernel: str) -> None:
    """Make verl's ``logprobs_from_logits`` take the flash-attn path with :class:`InPlaceCrossEntropy` ("inplace"),
    or its own log-softmax path ("verl")."""
    from verl.utils import torch_functional

    torch_functional.FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE = kernel == "inplace"
    torch_functional.cross_entropy_loss = lambda logits, labels, inplace_backward=True: InPlaceCrossEntropy.apply(
        logits, labels, inplace_backward)


# -- the verl side, in a worker process -------------------------------------------------------------------------------
def worker(args: dict) -> None:
    """One TrainingWorker (stppo engine); per case: re-initialise it, set verl's ppo_loss for the case's loss, train
    one mini-batch as verl's trainer hands it over, and keep the metrics and the parameters' change."""
    import datetime
    import functools

    import numpy as np
    import torch.distributed as dist
    import verl  # noqa: F401  (with VERL_USE_EXTERNAL_PLUGINS=none: the platform comes first)

    register_cpu_platform()
    from verl import DataProto
    from verl.trainer.config import CheckpointConfig
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import FSDPActorConfig, FSDPOptimizerConfig, PolicyLossConfig, TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding

    import stppo_agent.integrations.verl.plugin  # noqa: F401  (as actor_rollout_ref.model.external_lib would)

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    model_config, engine_config = tiny_model_configs(args["model"])
    training = TrainingWorker(TrainingWorkerConfig(
        model_type="language_model", model_config=model_config, engine_config=engine_config,
        optimizer_config=FSDPOptimizerConfig(optimizer="SGD", lr=1.0, weight_decay=0.0, clip_grad=1e9,
                                             total_training_steps=1),
        checkpoint_config=CheckpointConfig()))
    results = {"engine": type(training.engine).__name__}
    for case in args["cases"]:
        batch = torch.load(args["batches"][case["batch"]])
        spans = batch.pop(TURN_SPANS, None)
        rows = len(batch["prompts"])
        preset = ALGORITHMS[case["preset"]]
        use_kernel(case["kernel"])
        training.reset()
        training.set_loss_fn(functools.partial(ppo_loss, config=FSDPActorConfig(
            strategy="fsdp2", rollout_n=1, ppo_mini_batch_size=rows, ppo_micro_batch_size_per_gpu=case["micro"],
            clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH, clip_ratio_c=1e9, loss_agg_mode=preset.loss_agg,
            loss_scale_factor=int(preset.loss_scale_factor) if preset.loss_agg == "seq-mean-token-sum-norm" else None,
            use_kl_loss=False, entropy_coeff=0.0, use_dynamic_bsz=False,
            policy_loss=PolicyLossConfig(loss_mode=f"stppo_{case['preset']}"))))
        non_tensors = {}
        if spans is not None:  # as the agent loop's extra_fields reach the batch: one object per row
            non_tensors[TURN_SPANS] = np.empty(rows, dtype=object)
            non_tensors[TURN_SPANS][:] = spans
        proto = DataProto.from_dict(tensors=batch, non_tensors=non_tensors, meta_info={"temperature": 1.0})
        data = left_right_2_no_padding(proto.to_tensordict())  # verl's trainer, _update_actor
        tu.assign_non_tensor(data, calculate_entropy=False, global_batch_size=rows, mini_batch_size=rows, epochs=1,
                             seed=1, dataloader_kwargs={"shuffle": False}, compute_loss=True,
                             micro_batch_size_per_gpu=case["micro"], use_dynamic_bsz=False)
        before = {name: parameter.full_tensor().detach().clone()
                  for name, parameter in training.engine.module.named_parameters()}
        InPlaceCrossEntropy.backward_calls = 0
        try:
            metrics = tu.get(training.train_mini_batch(data), "metrics")
        except Exception as error:  # noqa: BLE001  (the case records what a refusing loss said)
            results[case["name"]] = {"error": f"{type(error).__name__}: {error}"}
            continue
        after = dict(training.engine.module.named_parameters())
        results[case["name"]] = {
            "metrics": {key: [float(v) for v in value] for key, value in metrics.items()},
            "step": {name: before[name] - after[name].full_tensor().detach() for name in before},
            "kernel_backwards": InPlaceCrossEntropy.backward_calls}
    torch.save(results, args["out"])
    dist.destroy_process_group()


# -- this project's own computation ------------------------------------------------------------------------------------
def reference_step(model_dir: Path, batch: dict, preset: str, turn_ids: torch.Tensor) -> tuple[dict, float | None]:
    """The preset's policy loss on the whole batch with the given turn ids, C through :class:`ClipBiasCorrector`
    for the correction presets: (the gradient per parameter, ||C|| or None)."""
    from transformers import AutoModelForCausalLM

    config = dataclasses.replace(ALGORITHMS[preset], clip_low=CLIP_LOW, clip_high=CLIP_HIGH)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    mask = batch["response_mask"].bool()
    logprobs = response_log_probs(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                                  mask.shape[1])
    loss, bias, _ = get_policy_loss(config.policy_loss)(
        logprobs=logprobs, old_logprobs=batch["old_log_probs"], advantages=batch["advantages"], loss_mask=mask,
        turn_ids=turn_ids, config=config)
    corrector = ClipBiasCorrector(model.parameters(), config.clip_bias_kappa) if config.clip_bias_correction else None
    if corrector is not None:
        assert bias.requires_grad, "the test batch must clip something"
        corrector.accumulate(bias)
    loss.backward()
    bias_norm = float(corrector.apply()["clip_bias_norm"]) if corrector is not None else None
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}, bias_norm


def rejected_inside_turns(batch: dict) -> dict:
    """The batch after verl's token-level rollout rejection (``rollout_rs=token_k1``, ratio bounds 0.5..2): the
    sampler's log-probs are off by 2 nats on the middle token of every turn of 3 tokens or more, which verl drops
    from the mask, splitting those turns. The turn record is the mask the agent loop built."""
    from verl import DataProto
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

    mask = batch["response_mask"]
    rollout = batch["old_log_probs"].clone()
    spans = [spans_from_mask(row.tolist()) for row in mask]
    for row, row_spans in enumerate(spans):
        for start, end in row_spans:
            if end - start >= 3:
                rollout[row, (start + end) // 2] -= 2.0
    proto = DataProto.from_dict(tensors={"old_log_probs": batch["old_log_probs"], "rollout_log_probs": rollout,
                                         "response_mask": mask})
    proto, _ = compute_rollout_correction_and_add_to_batch(proto, {"rollout_rs": "token_k1",
                                                                   "rollout_rs_threshold": "0.5_2.0"})
    rejected = dict(batch, response_mask=proto.batch["response_mask"])
    assert int(mask.sum() - rejected["response_mask"].sum()) == sum(e - s >= 3 for row in spans for s, e in row)
    return {**rejected, TURN_SPANS: spans}


def true_turn_ids(spans: list, mask: torch.Tensor) -> torch.Tensor:
    ids = torch.full(mask.shape, -1, dtype=torch.long)
    for row, row_spans in enumerate(spans):
        for turn, (start, end) in enumerate(row_spans):
            ids[row, start:end] = turn
    return torch.where(mask.bool(), ids, torch.full_like(ids, -1))


CASES = ([{"name": f"{name}-verl", "preset": name, "kernel": "verl", "batch": "plain"} for name in ALGORITHMS]
         + [{"name": f"{name}-inplace", "preset": name, "kernel": "inplace", "batch": "plain"}
            for name in [*CORRECTION, "ppo"]]
         + [{"name": f"{name}-rejected", "preset": name, "kernel": "inplace", "batch": "rejected"}
            for name in TURN_LEVEL])


@pytest.fixture(scope="module")
def updates(tmp_path_factory):
    """Every case in one worker process: (its results, the model, the batches)."""
    from stppo_agent.models.tiny import build_tiny_llama

    folder = tmp_path_factory.mktemp("verl_training_worker")
    model_dir = build_tiny_llama(folder / "llama", hidden=32, layers=2, seed=3)
    plain = make_batch(model_dir)
    batches = {"plain": plain, "rejected": rejected_inside_turns(plain)}
    paths = {}
    for key, batch in batches.items():
        paths[key] = str(folder / f"{key}.pt")
        torch.save(batch, paths[key])
    # M2PO's mask is a statistic of the micro-batch its loss is given: one micro-batch, the whole mini-batch
    cases = [dict(case, micro=len(plain["prompts"]) if ALGORITHMS[case["preset"]].policy_loss == "m2po" else 2)
             for case in CASES]
    out = folder / "results.pt"
    codes, logs = launch_workers(__file__, {"model": str(model_dir), "batches": paths, "cases": cases,
                                            "out": str(out)}, world=1)
    if codes != [0]:
        raise AssertionError(f"verl worker failed:\n{logs[0][-6000:]}")
    return torch.load(out, weights_only=False), model_dir, batches


def assert_step(result: dict, grads: dict) -> None:
    assert set(result["step"]) == set(grads)
    for name, grad in grads.items():
        torch.testing.assert_close(result["step"][name], grad, **GRAD_TOL, msg=lambda m: f"{name}: {m}")
    norm = torch.sqrt(sum(g.square().sum() for g in grads.values()))
    assert result["metrics"]["grad_norm"] == [pytest.approx(float(norm), rel=1e-4)]


@pytest.mark.parametrize("preset", [name for name in ALGORITHMS if not_in_verl(ALGORITHMS[name]) is None])
def test_every_stppo_loss_trains_one_mini_batch_through_verls_training_worker(updates, preset):
    results, model_dir, batches = updates
    result = results[f"{preset}-verl"]
    assert "error" not in result, result.get("error")
    assert results["engine"] == "ClipBiasFSDPEngine"
    mask = batches["plain"]["response_mask"]
    grads, bias_norm = reference_step(model_dir, batches["plain"], preset, turn_ids_from_mask(mask))
    assert float(torch.sqrt(sum(g.square().sum() for g in grads.values()))) > 1e-3  # a step that moves something
    assert_step(result, grads)
    metrics = result["metrics"]
    if bias_norm is None:
        assert "actor/stppo/clip_bias_norm" not in metrics
    else:
        assert bias_norm > 1.0  # kappa = 1: the correction rescales this step
        assert metrics["actor/stppo/clip_bias_norm"] == [pytest.approx(bias_norm, rel=1e-4)]
        assert metrics["actor/stppo/clip_bias_scale"] == [pytest.approx(bias_norm, rel=1e-4)]


@pytest.mark.parametrize("preset", [name for name in ALGORITHMS if not_in_verl(ALGORITHMS[name]) is not None])
def test_a_preset_verl_cannot_train_refuses_at_its_first_update(updates, preset):
    error = updates[0][f"{preset}-verl"]["error"]
    assert error.startswith(f"NotInVerlError: policy loss stppo_{preset}: ")
    assert "use stppo_" in error and "\n" not in error


@pytest.mark.parametrize("preset", [*CORRECTION, "ppo"])
def test_a_log_prob_kernel_that_overwrites_its_saved_logits_leaves_the_update_exact(updates, preset):
    """flash-attn's in-place cross-entropy runs its backward once per micro-batch (verl's loss.backward), never for
    C, and the update equals this project's."""
    results, model_dir, batches = updates
    result = results[f"{preset}-inplace"]
    assert "error" not in result, result.get("error")
    mask = batches["plain"]["response_mask"]
    grads, bias_norm = reference_step(model_dir, batches["plain"], preset, turn_ids_from_mask(mask))
    assert result["kernel_backwards"] == 2  # one per micro-batch
    assert_step(result, grads)
    if bias_norm is not None:
        assert result["metrics"]["actor/stppo/clip_bias_norm"] == [pytest.approx(bias_norm, rel=1e-4)]


@pytest.mark.parametrize("preset", TURN_LEVEL)
def test_turns_split_by_verls_token_rejection_stay_one_turn(updates, preset):
    results, model_dir, batches = updates
    result = results[f"{preset}-rejected"]
    assert "error" not in result, result.get("error")
    batch = batches["rejected"]
    mask = batch["response_mask"]
    grads, _ = reference_step(model_dir, batch, preset, true_turn_ids(batch[TURN_SPANS], mask))
    split, _ = reference_step(model_dir, batch, preset, turn_ids_from_mask(mask))
    assert any(not torch.allclose(grads[name], split[name], rtol=1e-3, atol=1e-6) for name in grads)
    assert_step(result, grads)


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    worker(json.loads(sys.argv[2]))
