"""M2PO's cut is a statistic of the whole optimizer batch across ranks, whatever the micro-batch size
and the number of processes: the trainer takes it from a no-grad forward over every micro-batch before the
backward passes (``WHOLE_BATCH_STATISTICS``)."""

from __future__ import annotations

import pytest
import torch

from stppo_agent.algorithms import get_policy_loss
from stppo_agent.algorithms.second_moment import m2po_keep_masks
from stppo_agent.distributed.process_group import free_port
from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer
from stppo_agent.training.log_probs import token_logprobs
from stppo_agent.training.trainer import Trainer
from tests.support.gloo_ranks import gloo_rank, start_ranks
from tests.support.runs import TIMING, one_iteration_config

M2PO = {"kl_in_reward": 0.0, "kl_loss_coef": 0.0, "m2_threshold": 0.02}


def _off_policy_batch(trainer: Trainer):
    batch = trainer.rollout()
    trainer.score(batch)
    noise = torch.randn(batch.old_logprobs.shape, generator=torch.Generator().manual_seed(0))
    batch.old_logprobs = batch.old_logprobs + 0.3 * noise  # squared log-ratios around 0.09: M2PO must cut
    return batch


def _whole_batch_loss(trainer: Trainer, batch):
    with torch.no_grad():
        logprobs, _ = token_logprobs(trainer.state.actor, batch, sampling=trainer.config.sampling())
        _, _, metrics = get_policy_loss("m2po")(
            logprobs=logprobs, old_logprobs=batch.old_logprobs, advantages=batch.advantages,
            loss_mask=batch.loss_mask, turn_ids=batch.turn_ids, config=trainer.algo)
    return metrics


def test_keep_masks_of_micro_batches_of_different_lengths_are_the_cut_of_their_concatenation():
    # two micro-batches, 3 and 4 positions wide (each padded by one masked position)
    ratios = [torch.tensor([[0.3, 0.3, 0.0]]), torch.tensor([[0.01, 0.01, 0.0, 0.2], [0.01, 0.0, 0.0, 0.0]])]
    masks = [torch.tensor([[True, True, False]]),
             torch.tensor([[True, True, False, True], [True, False, False, False]])]
    turns = [torch.tensor([[0, 0, -1]]), torch.tensor([[0, 0, -1, 1], [0, -1, -1, -1]])]
    kept, second_moment = m2po_keep_masks(ratios, masks, turns, "token", 0.02)
    squares = torch.cat([(r[m] ** 2) for r, m in zip(ratios, masks)])
    assert second_moment.item() == pytest.approx(float(squares.mean()))
    # squares 0.09 0.09 0.04 1e-4 x3: the mean without the largest is 0.026, without the two largest 0.0101 < 0.02,
    # so both 0.3s go and 0.2 stays. The first micro-batch alone would keep one 0.3 (no cut gets it below 0.02)
    assert [k.tolist() for k in kept] == [[[False, False, False]],
                                          [[True, True, False, True], [True, False, False, False]]]
    alone, _ = m2po_keep_masks(ratios[:1], masks[:1], turns[:1], "token", 0.02)
    assert alone[0].tolist() == [[False, True, False]]


def test_m2po_update_does_not_depend_on_the_micro_batch_size(tmp_path):
    """Same batch, same weights (lr 0): micro-batch 1 / 2 / 4 / 8 log the same loss, masked share, second moment
    and gradient norm as the whole batch in one call -- with a per-micro-batch cut they differ."""
    model = build_tiny_llama(tmp_path / "model", word_tokenizer())
    trainer = Trainer(one_iteration_config(model, tmp_path / "run", algo="m2po", algorithm=M2PO,
                                 optimizer=dict(actor_lr=0.0, critic_lr=0.0)),
                      report=lambda _: None)
    batch = _off_policy_batch(trainer)
    whole = _whole_batch_loss(trainer, batch)
    assert 0 < float(whole["clip_frac"]) < 1, "the cut must drop some tokens and keep others"
    logged = {}
    for micro in (1, 2, 4, 8):
        trainer.config.optimizer.micro_batch_size = micro
        logged[micro] = {k: v for k, v in trainer.update(batch).items() if k not in TIMING}
    for key in ("pg_loss", "clip_frac", "turn_clip_frac", "m2po/second_moment"):
        for micro, metrics in logged.items():
            assert metrics[key] == pytest.approx(float(whole[key]), rel=1e-5, abs=1e-7), (key, micro)
    for micro in (1, 2, 4):
        assert logged[micro]["grad_norm"] == pytest.approx(logged[8]["grad_norm"], rel=1e-5), micro


def _two_process_main(rank: int, port: int, model: str, out: str, batch_path: str) -> None:
    with gloo_rank(rank, port):
        trainer = Trainer(one_iteration_config(model, out, algo="m2po", algorithm=M2PO,
                                     optimizer=dict(actor_lr=0.0, critic_lr=0.0, micro_batch_size=1)),
                                                                                             report=lambda _: None)
        batch = torch.load(batch_path, weights_only=False)
        rows = [r for r in range(batch.batch_size) if r % 2 == rank]  # 4 rows each: 4 micro-batches of 1
        metrics = trainer.update(batch.select(rows))
        torch.save({"metrics": metrics}, f"{out}/rank{rank}.pt")


def test_two_processes_with_several_micro_batches_each_cut_the_global_batch(tmp_path):
    model = build_tiny_llama(tmp_path / "model", word_tokenizer())
    trainer = Trainer(one_iteration_config(model, tmp_path / "one", algo="m2po", algorithm=M2PO,
                                 optimizer=dict(actor_lr=0.0, critic_lr=0.0, micro_batch_size=1)),
                      report=lambda _: None)
    batch = _off_policy_batch(trainer)
    torch.save(batch, tmp_path / "batch.pt")
    whole = _whole_batch_loss(trainer, batch)
    single = trainer.update(batch)
    (tmp_path / "two").mkdir()
    start_ranks(_two_process_main, args=(free_port(), str(model), str(tmp_path / "two"),
                                                str(tmp_path / "batch.pt")), nprocs=2)
    for rank in (0, 1):
        two = torch.load(tmp_path / "two" / f"rank{rank}.pt", weights_only=False)["metrics"]
        for key in ("pg_loss", "clip_frac", "m2po/second_moment"):
            assert two[key] == pytest.approx(float(whole[key]), rel=1e-5, abs=1e-7), (rank, key)
        assert two["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-5), rank


def _strategy_config(model, out, strategy: str):
    # 4 prompts x 2 samples (M2PO is GRPO's family), mini-batch 8, micro-batch 2: 4 micro-batches in one process,
    # 2 on each of two ranks
    return one_iteration_config(model, out, algo="m2po", algorithm=M2PO, distributed=dict(strategy=strategy),
                      rollout=dict(samples_per_prompt=2, prompts_per_iteration=4), optimizer=dict(micro_batch_size=2))


def _strategy_rank_main(rank: int, port: int, model: str, out: str, batch_path: str, strategy: str) -> None:
    with gloo_rank(rank, port):
        from torch.distributed.tensor import DTensor

        trainer = Trainer(_strategy_config(model, out, strategy), report=lambda _: None)
        batch = torch.load(batch_path, weights_only=False)
        metrics = trainer.actor_gradients(batch.select(list(range(rank, batch.batch_size, 2))))
        grads = {name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
                 for name, p in trainer.state.actor.named_parameters()}  # a collective under FSDP2
        if rank == 0:
            torch.save({"grads": grads, "metrics": metrics}, f"{out}/rank0.pt")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_the_whole_batch_forward_runs_under_ddp_and_fsdp2(tmp_path, strategy):
    """2 gloo processes x 2 micro-batches each (DDP's no_sync, FSDP2's shards in the no-grad forward): the same
    gradient as one process with 4 micro-batches, with the cut dropping some tokens and keeping others."""
    model = build_tiny_llama(tmp_path / "model", word_tokenizer())
    single = Trainer(_strategy_config(model, tmp_path / "single", "ddp"), report=lambda _: None)
    batch = _off_policy_batch(single)
    torch.save(batch, tmp_path / "batch.pt")
    expected = single.actor_gradients(batch)
    assert 0 < expected["clip_frac"] < 1
    (tmp_path / "two").mkdir()
    start_ranks(_strategy_rank_main, args=(free_port(), str(model), str(tmp_path / "two"),
                                                  str(tmp_path / "batch.pt"), strategy), nprocs=2)
    got = torch.load(tmp_path / "two" / "rank0.pt", weights_only=False)
    for name, param in single.state.actor.named_parameters():
        torch.testing.assert_close(got["grads"][name], param.grad, rtol=1e-5, atol=1e-7)
    for key in ("clip_frac", "m2po/second_moment", "grad_norm"):
        assert got["metrics"][key] == pytest.approx(expected[key], rel=1e-5), key
