"""Logged numbers do not depend on how a batch is split: micro-batch size, number of processes.

Losses and fractions are ratios of sums over the whole mini-batch, rollout statistics are
combined over ranks as sums and counts (33.2), and the global mini-batches of 2 processes are those of 1
process (33.6): 2 gloo processes log what 1 process logs on the same global batch, step by step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stppo_agent.algorithms import get_policy_loss, value_loss
from stppo_agent.algorithms.metrics import ROLLOUT_STAT_POPULATIONS
from stppo_agent.distributed.process_group import free_port
from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer
from stppo_agent.rollouts.episode_stats import episode_rates
from stppo_agent.runs.metrics_log import read_metrics
from stppo_agent.training.config import TrainConfig
from stppo_agent.training.live_rollouts import RolloutContext
from stppo_agent.training.log_probs import critic_values, token_logprobs
from stppo_agent.training.trainer import Trainer
from tests.support.gloo_ranks import gloo_rank, start_ranks
from tests.support.runs import TIMING, one_iteration_config


def test_logged_losses_and_fractions_do_not_depend_on_micro_batching(tmp_path):
    """Same batch, micro-batch 1 / 2 / 4 / 8 (the whole mini-batch): the same pg_loss, entropy, kl_loss,
    value_loss, clip and turn-clip fractions, and each equals the loss's own value over the whole batch."""
    model = build_tiny_llama(tmp_path / "model", word_tokenizer())
    # learning rates 0: every update sees the same weights, so the runs differ only in how the batch is split
    trainer = Trainer(one_iteration_config(model, tmp_path / "run", optimizer=dict(actor_lr=0.0, critic_lr=0.0)),
                      report=lambda _: None)
    batch = trainer.rollout()
    trainer.score(batch)
    # every statistic a rollout and its scoring report has a declared population to be combined over ranks by
    assert set(batch.stats) <= set(ROLLOUT_STAT_POPULATIONS), set(batch.stats) - set(ROLLOUT_STAT_POPULATIONS)
    noise = torch.randn(batch.old_logprobs.shape, generator=torch.Generator().manual_seed(0))
    batch.old_logprobs = batch.old_logprobs + 0.3 * noise  # off-policy: ratios leave the clip range
    logged = {}
    for micro in (1, 2, 4, 8):
        trainer.config.optimizer.micro_batch_size = micro
        logged[micro] = {k: v for k, v in trainer.update(batch).items() if k not in TIMING}
    # the loss applied to the whole batch in one call: the values a logged metric must have
    with torch.no_grad():
        logprobs, entropy = token_logprobs(trainer.state.actor, batch, with_entropy=True)
        _, _, whole = get_policy_loss("ppo_clip")(
            logprobs=logprobs, old_logprobs=batch.old_logprobs, advantages=batch.advantages,
            loss_mask=batch.loss_mask, turn_ids=batch.turn_ids, config=trainer.algo, ref_logprobs=batch.ref_logprobs,
            entropy=entropy)
        _, critic = value_loss(values=critic_values(trainer.state.critic, batch), old_values=batch.values,
                               returns=batch.returns, loss_mask=batch.loss_mask, config=trainer.algo)
    whole.update(critic)
    assert 0 < whole["turn_clip_frac"] < 1 and 0 < whole["clip_frac"] < 1  # the fractions mean something
    for key in ("pg_loss", "entropy", "kl_loss", "clip_frac", "turn_clip_frac", "ratio/mean", "ratio/max",
                "ratio/min", "approx_kl", "value_loss", "value_clip_frac", "explained_variance"):
        for micro, metrics in logged.items():
            assert metrics[key] == pytest.approx(float(whole[key]), rel=1e-5, abs=1e-7), (key, micro)
    for micro in (1, 2, 4):  # everything else logged (gradient norms, ||C||, ratio tails) does not move either
        assert set(logged[micro]) == set(logged[8])
        for key, value in logged[8].items():
            assert logged[micro][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (key, micro)


# --- 1 process vs 2 processes ----------------------------------------------------------------------------------

# per row of the 8-row batch: (reward, turns, invalid actions, searches served, searches failed); shares of two
# ranks (prompts 0, 2 and 1, 3: rows 0, 1, 4, 5 and 2, 3, 6, 7) differ, so rank 0's share is not the batch
EPISODES = [(1.0, 2, 0, 1, 0), (0.5, 2, 1, 1, 0), (0.0, 1, 1, 0, 1), (0.0, 2, 2, 0, 0),
            (1.0, 2, 0, 2, 0), (1.0, 1, 0, 1, 0), (0.0, 2, 1, 0, 2), (0.5, 2, 0, 1, 1)]


def share_stats(batch, rows: list[int]) -> dict[str, float]:
    """What a rollout reports for ``rows`` (the formulas of rollout.to_batch), from :data:`EPISODES`."""
    episodes = [dict(zip(("reward", "turns", "invalid_actions", "search_calls", "search_errors"), EPISODES[r]),
                     answered=EPISODES[r][0] > 0) for r in rows]
    return {"reward": sum(e["reward"] for e in episodes) / len(rows),
            "response_tokens": float(batch.loss_mask[rows].sum()) / len(rows),
            "turns": sum(e["turns"] for e in episodes) / len(rows),
            "search_calls": sum(e["search_calls"] for e in episodes) / len(rows),
            "search_errors": sum(e["search_errors"] for e in episodes) / len(rows),
            **episode_rates(episodes), "truncated_max_total_tokens": 0.0}


def test_the_search_error_rate_over_ranks_is_exact_when_one_rank_had_only_failures():
    # rank 0: 2 trajectories of 3 turns, every search failed (2 each); rank 1: one served search each. 4 of 6
    # searches failed. Derived from the rate alone, rank 0's attempts were only bounded (turns - answers = 5).
    from types import SimpleNamespace

    from stppo_agent.algorithms.metrics import combine_rollout_statistics
    from stppo_agent.rollouts.statistics import rollout_parts

    def share(served: float, failed: float) -> SimpleNamespace:
        stats = {"turns": 3.0, "search_calls": served, "search_errors": failed, "answer_rate": 0.5,
                 "invalid_action_rate": 0.0, "search_error_rate": failed / (served + failed)}
        return SimpleNamespace(stats=stats, batch_size=2, loss_mask=torch.ones(2, 3, dtype=torch.bool),
                               old_logprobs=None)

    combined = combine_rollout_statistics([rollout_parts(share(0.0, 2.0), None), rollout_parts(share(1.0, 0.0), None)])
    assert combined["search_error_rate"] == pytest.approx(4 / 6)
    assert combined["search_errors"] == pytest.approx(1.0) and combined["search_calls"] == pytest.approx(0.5)


def test_the_observation_cut_rate_over_ranks_is_weighted_by_observations():
    # rank 0: 2 trajectories, 1 observation each, both cut; rank 1: 2 trajectories, 3 each, none cut: 2 of 8
    from types import SimpleNamespace

    from stppo_agent.algorithms.metrics import combine_rollout_statistics
    from stppo_agent.rollouts.statistics import rollout_parts

    def share(observations: float, cut_rate: float) -> SimpleNamespace:
        stats = {"turns": 3.0, "observations": observations, "observation_cut_rate": cut_rate}
        return SimpleNamespace(stats=stats, batch_size=2, loss_mask=torch.ones(2, 3, dtype=torch.bool),
                               old_logprobs=None)

    combined = combine_rollout_statistics([rollout_parts(share(1.0, 1.0), None), rollout_parts(share(3.0, 0.0), None)])
    assert combined["observation_cut_rate"] == pytest.approx(2 / 8)
    assert combined["observations"] == pytest.approx(2.0)


class FixedShares:
    """A rollout source (:class:`~stppo_agent.training.live_rollouts.RolloutSource`) serving this rank's share
    (prompts rank::world) of a batch saved to disk."""

    sampled_by_actor = True
    env_kwargs = None  # it plays no envs

    def __init__(self, context: RolloutContext, path: str):
        self.context, self.path = context, path

    def next_batch(self, iteration: int):
        batch = torch.load(self.path, weights_only=False)
        spp = self.context.config.rollout.samples_per_prompt
        prompts = range(self.context.rank, batch.batch_size // spp, self.context.world)
        rows = [prompt * spp + sample for prompt in prompts for sample in range(spp)]
        share = batch.select(rows)
        share.stats = share_stats(batch, rows)
        return share

    def state(self):
        return {}

    def load(self, state):
        pass


def shared_config(model: str, out: str) -> TrainConfig:
    # two mini-batches of 4 over two epochs: the shuffle decides which rows share a step; step diagnostics log
    # every step; rollout correction (tis) logs weight statistics; the reference model logs kl_to_reference
    return one_iteration_config(Path(model), Path(out),
                      algorithm={"kl_in_reward": 0.0, "kl_loss_coef": 0.1, "entropy_coef": 0.01,
                                 "rollout_correction": "tis", "rollout_correction_cap": 1.2},
                      optimizer=dict(epochs=2, mini_batch_size=4, micro_batch_size=1, actor_lr=3e-3, critic_lr=3e-3),
                      logging=dict(step_diagnostics=True))


def _two_process_main(rank: int, port: int, model: str, out: str, batch_path: str) -> None:
    with gloo_rank(rank, port):
        trainer = Trainer(shared_config(model, out), report=lambda _: None,
                          rollout_source=lambda context: FixedShares(context, batch_path))
        trainer.train()
        if rank == 0:
            torch.save({n: p.detach().clone() for n, p in trainer.state.actor.named_parameters()}, f"{out}/weights.pt")


def test_two_processes_log_and_train_what_one_process_does(tmp_path):
    model = build_tiny_llama(tmp_path / "model", word_tokenizer())
    maker = Trainer(one_iteration_config(model, tmp_path / "maker"), report=lambda _: None)
    batch = maker.rollout()
    # sampled log-probs off the trainer's: rollout-correction weights spread around 1, some above the cap
    batch.sample_logprobs = batch.sample_logprobs + 0.3 * torch.randn(
        batch.sample_logprobs.shape, generator=torch.Generator().manual_seed(1)) * batch.loss_mask
    batch.rewards = torch.tensor([e[0] for e in EPISODES])
    torch.save(batch, tmp_path / "batch.pt")

    single = Trainer(shared_config(str(model), str(tmp_path / "one")), report=lambda _: None,
                     rollout_source=lambda context: FixedShares(context, str(tmp_path / "batch.pt")))
    single.train()
    start_ranks(_two_process_main, args=(free_port(), str(model), str(tmp_path / "two"),
                                                str(tmp_path / "batch.pt")), nprocs=2)
    one, two = read_metrics(tmp_path / "one")[0], read_metrics(tmp_path / "two")[0]
    # the rollout statistics of the global batch, not rank 0's share: reward 0.5 (rank 0's share: 0.875)
    assert one["reward"] == pytest.approx(0.5) and two["reward"] == pytest.approx(0.5)
    assert two["invalid_action_rate"] == pytest.approx(5 / 14)  # 5 invalid actions in 14 turns
    assert two["search_error_rate"] == pytest.approx(4 / 10)  # 4 of 10 searches failed
    assert one["rollout_correction/truncated_frac"] > 0
    assert set(one) == set(two)
    for key in sorted(set(one) - TIMING):
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), key
    # step by step: the same global mini-batches give the same gradient norms, fractions and ratio tails
    steps_one, steps_two = read_metrics(tmp_path / "one", "steps.jsonl"), read_metrics(tmp_path / "two", "steps.jsonl")
    assert len(steps_one) == len(steps_two) == 4
    for first, second in zip(steps_one, steps_two):
        for key, value in first.items():
            assert second[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (first["step"], key)
    weights = torch.load(tmp_path / "two" / "weights.pt")
    for name, param in single.state.actor.named_parameters():
        torch.testing.assert_close(weights[name], param.detach(), rtol=1e-4, atol=1e-6)
    print(json.dumps({k: (one[k], two[k]) for k in ("reward", "entropy", "turn_clip_frac", "grad_norm")}))
