"""The ``stppo`` verl training engine (stppo_agent/integrations/verl/engine.py): one update step of ST-PPO through
verl's own FSDP2 engine on CPU (gloo, a tiny Llama built from a config, ``attn_implementation=sdpa``,
``use_remove_padding=False``, a CPU platform registered through verl's platform plugin API) gives the gradient and
||C|| that this project's own loss and clip-bias corrector give on the same batch, with 2 micro-batches (FSDP2's
no-sync accumulation on and off) and with 2 gloo processes.

verl's engine runs in subprocesses (``python tests/integrations/verl/test_engine.py worker ...``): verl fixes its
platform at the first import of its engine module, and the CPU platform must be registered before that
(tests/support/verl_workers.py).
The whole update through verl's ``TrainingWorker`` is tests/integrations/verl/test_training_worker.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support.requires import require_verl

require_verl()

import torch  # noqa: E402

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

NORM_REL = 1e-4


def reference_step(model_dir: Path, batch: dict, preset: str) -> tuple[dict[str, torch.Tensor], float]:
    """This project's own computation: ``ppo_clip`` at the preset's ratio level on the whole batch (turn ids from the
    response-mask runs), C through :class:`ClipBiasCorrector`, the gradient divided by max(1, ||C|| / kappa)."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from stppo_agent.algorithms import ALGORITHMS, ClipBiasCorrector, get_policy_loss
    from stppo_agent.integrations.verl.losses import turn_ids_from_mask

    config = dataclasses.replace(ALGORITHMS[preset], clip_low=CLIP_LOW, clip_high=CLIP_HIGH, loss_agg="token-mean")
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation="sdpa")
    mask = batch["response_mask"].bool()
    logprobs = response_log_probs(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                                  mask.shape[1])
    loss, bias, _ = get_policy_loss(config.policy_loss)(
        logprobs=logprobs, old_logprobs=batch["old_log_probs"], advantages=batch["advantages"], loss_mask=mask,
        turn_ids=turn_ids_from_mask(mask), config=config)
    assert bias.requires_grad, "the test batch must clip something"
    corrector = ClipBiasCorrector(model.parameters(), config.clip_bias_kappa)
    corrector.accumulate(bias)
    loss.backward()
    metrics = corrector.apply()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}, float(metrics["clip_bias_norm"])


# -- the verl side, in worker processes -------------------------------------------------------------------------------
def worker(args: dict) -> None:
    """One rank: verl's engine registry (VERL_ENGINE_VENDOR=stppo) builds the actor engine on the CPU platform, runs
    ``forward_backward_batch`` with verl's ``ppo_loss`` on this rank's rows, and rank 0 saves the full gradient."""
    import datetime
    import functools

    import torch.distributed as dist
    import verl  # noqa: F401  (with VERL_USE_EXTERNAL_PLUGINS=none: the platform comes first)

    register_cpu_platform()
    from tensordict import TensorDict
    from verl.trainer.config import CheckpointConfig
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import FSDPActorConfig, FSDPOptimizerConfig, PolicyLossConfig
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding

    import stppo_agent.integrations.verl.plugin  # noqa: F401  (as actor_rollout_ref.model.external_lib would)

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))  # a mismatched collective fails
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = torch.load(args["batch"])
    rows = len(batch["prompts"])
    per_rank = rows // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    model, engine_config = tiny_model_configs(args["model"],
                                              use_no_sync_for_gradient_accumulation=args["no_sync"])
    optimizer = FSDPOptimizerConfig(lr=1e-3, total_training_steps=1, clip_grad=1e9)
    engine_kwargs = dict(model_config=model, engine_config=engine_config, optimizer_config=optimizer,
                         checkpoint_config=CheckpointConfig())
    if args["engine"] == "registry":
        engine = EngineRegistry.new("language_model", "fsdp2", **engine_kwargs)
    else:  # verl's own FSDP2 engine, as verl builds it without VERL_ENGINE_VENDOR=stppo
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

        engine = FSDPEngineWithLMHead(**engine_kwargs)
    engine.initialize()
    actor = FSDPActorConfig(strategy="fsdp2", rollout_n=1, ppo_mini_batch_size=rows,
                            ppo_micro_batch_size_per_gpu=per_rank // args["micro_batches"],
                            clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH, clip_ratio_c=1e9,
                            loss_agg_mode="token-mean", policy_loss=PolicyLossConfig(loss_mode=args["loss_mode"]),
                            use_dynamic_bsz=False)
    data = TensorDict({key: value[mine] for key, value in batch.items()}, batch_size=[per_rank])
    data = left_right_2_no_padding(data)
    tu.assign_non_tensor(data, use_remove_padding=False, use_dynamic_bsz=False, use_fused_kernels=False,
                         micro_batch_size_per_gpu=per_rank // args["micro_batches"], temperature=1.0,
                         global_batch_size=rows, calculate_entropy=False)
    engine.module.train()
    engine.optimizer_zero_grad()
    output = engine.forward_backward_batch(data, functools.partial(ppo_loss, config=actor))
    grads = {}
    for name, param in engine.module.named_parameters():
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        grads[name] = grad.detach().clone()
    if rank == 0:
        metrics = {key: float(value.aggregate()) for key, value in output["metrics"].items()
                   if key.startswith("actor/stppo/clip_bias")}
        torch.save({"grads": grads, "metrics": metrics, "engine": type(engine).__name__, "world": world,
                    "micro_batches": len(output["loss"]), "sharded": type(engine.module).__name__}, args["out"])
    dist.destroy_process_group()


def launch(tmp_path: Path, model_dir: Path, batch: dict, world: int, micro_batches: int, no_sync: bool,
           loss_mode: str = "stppo_st_ppo", engine: str = "registry") -> tuple[Path, list[int], list[str]]:
    """Run ``world`` worker processes (gloo on a free port); (their result file, exit codes, logs)."""
    torch.save(batch, tmp_path / "batch.pt")
    out = tmp_path / f"verl-{world}-{micro_batches}-{no_sync}-{loss_mode}-{engine}.pt"
    args = {"model": str(model_dir), "batch": str(tmp_path / "batch.pt"), "out": str(out), "no_sync": no_sync,
            "micro_batches": micro_batches, "loss_mode": loss_mode, "engine": engine}
    codes, logs = launch_workers(__file__, args, world, timeout=600)
    return out, codes, logs


def run_verl(*args, **kwargs) -> dict:
    out, codes, logs = launch(*args, **kwargs)
    failed = [log for code, log in zip(codes, logs) if code != 0]
    if failed:
        raise AssertionError(f"verl worker failed:\n{failed[0][-6000:]}")
    return torch.load(out)


# -- the correction's buffers, in process (no verl engine) -------------------------------------------------------------
def test_graph_leaves_are_the_parameters_the_forward_used_in_one_order(tmp_path):
    from transformers import AutoModelForCausalLM

    from stppo_agent.integrations.verl.correction import graph_leaves
    from stppo_agent.models.tiny import build_tiny_llama

    model = AutoModelForCausalLM.from_pretrained(build_tiny_llama(tmp_path / "m", seed=1), dtype=torch.float32)
    ids = torch.randint(3, model.config.vocab_size, (2, 5))
    first = graph_leaves(model(input_ids=ids).logits)
    second = graph_leaves(model(input_ids=ids[:1, :3]).logits.log_softmax(-1))
    assert {id(p) for p in first} == {id(p) for p in model.parameters()}
    assert [id(p) for p in first] == [id(p) for p in second]


def test_buffers_take_c_beside_grad_over_micro_batches_as_this_projects_corrector(tmp_path):
    """Two micro-batches: ||C|| and the scaled gradient equal ClipBiasCorrector's (float32, rtol 1e-5); taking C leaves
    .grad exactly as the loss backward made it (C never enters it)."""
    from transformers import AutoModelForCausalLM

    from stppo_agent.algorithms import ALGORITHMS, ClipBiasCorrector, get_policy_loss
    from stppo_agent.integrations.verl.correction import ClipBiasBuffers
    from stppo_agent.integrations.verl.losses import turn_ids_from_mask
    from stppo_agent.models.tiny import build_tiny_llama

    model_dir = build_tiny_llama(tmp_path / "m", seed=2)
    batch = make_batch(model_dir, seed=1)
    tokens = int(batch["response_mask"].sum())

    def step(ours: bool):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
        corrector = ClipBiasBuffers(1.0) if ours else ClipBiasCorrector(model.parameters(), 1.0)
        for rows in (slice(0, 2), slice(2, 4)):
            mask = batch["response_mask"][rows].bool()
            logprobs = response_log_probs(model, batch["input_ids"][rows], batch["attention_mask"][rows],
                                          batch["position_ids"][rows], mask.shape[1])
            loss, bias, _ = get_policy_loss("ppo_clip")(
                logprobs=logprobs, old_logprobs=batch["old_log_probs"][rows], advantages=batch["advantages"][rows],
                loss_mask=mask, turn_ids=turn_ids_from_mask(mask), config=ALGORITHMS["st_ppo"],
                global_num_tokens=tokens)
            before = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
            corrector.accumulate(bias, logprobs) if ours else corrector.accumulate(bias)
            for old, param in zip(before, model.parameters()):
                assert (old is None and param.grad is None) or torch.equal(old, param.grad)
            loss.backward()
        norm = corrector.scale_gradients(model.parameters())["clip_bias_norm"] if ours else \
            float(corrector.apply()["clip_bias_norm"])
        return norm, [p.grad for p in model.parameters()]

    (norm, grads), (reference_norm, reference_grads) = step(ours=True), step(ours=False)
    assert reference_norm > 1.0  # the correction rescales on this batch
    assert norm == pytest.approx(reference_norm, rel=1e-5)
    for grad, reference in zip(grads, reference_grads):
        torch.testing.assert_close(grad, reference, rtol=1e-5, atol=1e-8)


def test_a_step_with_nothing_clipped_anywhere_reduces_nothing(monkeypatch):
    """On-policy mini-batches (the first of every iteration) clip nothing on any rank: ||C|| = 0, scale 1, and no
    collective on CPU tensors, which NCCL would refuse."""
    import torch.distributed as dist

    from stppo_agent.integrations.verl.correction import ClipBiasBuffers

    def refuse(*args, **kwargs):
        raise AssertionError("a collective without anything clipped")

    for shard in (False, True):
        buffers = ClipBiasBuffers(1.0, shard=shard)
        buffers.world, buffers.shard = 2, shard  # as on a rank of 2
        monkeypatch.setattr(dist, "all_reduce", refuse)
        monkeypatch.setattr(dist, "reduce_scatter_tensor", refuse)
        grad = torch.ones(3)
        param = torch.nn.Parameter(torch.zeros(3))
        param.grad = grad.clone()
        assert buffers.scale_gradients([param]) == {"clip_bias_norm": 0.0, "clip_bias_scale": 1.0}
        assert torch.equal(param.grad, grad)


# -- the tests ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from stppo_agent.models.tiny import build_tiny_llama

    model_dir = build_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", hidden=32, layers=2, seed=3)
    batch = make_batch(model_dir)
    grads, bias_norm = reference_step(model_dir, batch, "st_ppo")
    return model_dir, batch, grads, bias_norm


def assert_same_step(result: dict, grads: dict, bias_norm: float, world: int = 1, rescaled: bool = True) -> None:
    assert (result["engine"], result["sharded"]) == ("ClipBiasFSDPEngine", "FSDPLlamaForCausalLM")
    assert (result["world"], result["micro_batches"]) == (world, 2)
    verl_norm = result["metrics"]["actor/stppo/clip_bias_norm"]
    assert verl_norm == pytest.approx(bias_norm, rel=NORM_REL)
    assert bias_norm > 0 and (bias_norm > 1.0) == rescaled  # kappa = 1: the correction rescales iff ||C|| > 1
    assert set(result["grads"]) == set(grads)
    for name, grad in grads.items():
        torch.testing.assert_close(result["grads"][name], grad, **GRAD_TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("no_sync", [True, False], ids=["no_sync_on", "no_sync_off"])
def test_two_micro_batches_give_this_projects_corrected_gradient(setup, tmp_path, no_sync):
    model_dir, batch, grads, bias_norm = setup
    assert_same_step(run_verl(tmp_path, model_dir, batch, world=1, micro_batches=2, no_sync=no_sync), grads,
                     bias_norm)


@pytest.mark.parametrize("no_sync", [True, False], ids=["no_sync_on", "no_sync_off"])
def test_two_gloo_processes_give_this_projects_corrected_gradient(setup, tmp_path, no_sync):
    """Each rank holds half the batch in 2 micro-batches; C is averaged over the ranks like the gradient."""
    model_dir, batch, grads, bias_norm = setup
    assert_same_step(run_verl(tmp_path, model_dir, batch, world=2, micro_batches=2, no_sync=no_sync), grads,
                     bias_norm, world=2)


def test_a_rank_with_nothing_clipped_joins_the_correction_backward(setup, tmp_path):
    """Rank 1's rows are on-policy (nothing clips there): it back-propagates zero so that FSDP2's all-gathers in
    rank 0's C backward have a partner, and C is still the global batch's."""
    model_dir = setup[0]
    batch = make_batch(model_dir, on_policy_rows=(2, 3))
    grads, bias_norm = reference_step(model_dir, batch, "st_ppo")
    result = run_verl(tmp_path, model_dir, batch, world=2, micro_batches=2, no_sync=True)
    assert_same_step(result, grads, bias_norm, world=2, rescaled=False)


def test_s_ppo_takes_c_at_the_token_level(setup, tmp_path):
    model_dir, batch, st_grads, st_norm = setup
    grads, bias_norm = reference_step(model_dir, batch, "s_ppo")
    assert abs(bias_norm - st_norm) > 1e-3 * st_norm  # the level matters on this batch
    result = run_verl(tmp_path, model_dir, batch, world=1, micro_batches=2, no_sync=True, loss_mode="stppo_s_ppo")
    assert_same_step(result, grads, bias_norm)


def test_verls_own_engine_refuses_st_ppo_instead_of_training_turn_ppo(setup, tmp_path):
    model_dir, batch, _, _ = setup
    out, codes, logs = launch(tmp_path, model_dir, batch, world=1, micro_batches=2, no_sync=True, engine="verl")
    assert codes == [1] and not out.exists()
    assert "ClipBiasEngineMissingError: policy loss stppo_st_ppo" in logs[0] and "VERL_ENGINE_VENDOR=stppo" in logs[0]


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    worker(json.loads(sys.argv[2]))
