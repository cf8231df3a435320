"""The decoupled objective under a rollout lag: the behaviour weight
pi_prox / pi_behav is per token for every rule, M2PO cuts on the proximal-vs-behaviour pair, the KL columns mean
the behaviour policy; and a run that left its rollout correction to ``auto`` switching to it on ``--resume`` or
in ``stppo replay``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml

from stppo_agent.algorithms import estimate_advantages, kl_reward_penalty
from stppo_agent.models.tiny import toy_train_command
from stppo_agent.runs.metrics_log import read_metrics
from stppo_agent.training.config import TrainConfig, from_dict, merged
from stppo_agent.training.log_probs import batched_no_grad, token_logprobs
from stppo_agent.training.trainer import Trainer
from tests.support.cli_in_process import stppo
from tests.support.runs import toy_config


def lagged_config(model: Path, out: Path, algo: str, staleness: int, **overrides) -> TrainConfig:
    values = dict(iterations=5, rollout=dict(prompts_per_iteration=4, samples_per_prompt=4, staleness=staleness),
                  optimizer=dict(mini_batch_size=16, micro_batch_size=8, epochs=1, actor_lr=2e-2),
                  monitor=dict(on_collapse="none"))
    return toy_config(model, out, algo, **merged(values, overrides))


def scored_batches(trainer: Trainer, before=None) -> list:
    """Every batch the trainer scores, as scored (``before(batch)`` runs first, on the batch about to be scored)."""
    seen, score = [], trainer.score

    def watched(batch, **keywords):
        extra = before(batch) if before is not None else None
        score(batch, **keywords)
        seen.append((batch, extra))

    trainer.score = watched
    return seen


def logprobs_of(trainer: Trainer, model, batch) -> torch.Tensor:
    """``model``'s log-probs of the batch's tokens, scored as the trainer scores (same micro-batches)."""
    sampling = trainer.config.sampling()
    return batched_no_grad(lambda m, b: token_logprobs(m, b, sampling=sampling), model, batch,
                           trainer.config.optimizer.micro_batch_size)


@pytest.mark.parametrize("algo", ["ppo", "turn_ppo", "st_ppo", "so_grpo", "gspo"])
def test_decoupled_resolves_a_per_token_mis_weight_for_every_rule(algo):
    values = dict(model="m", algo=algo, rollout=dict(staleness=2, stale_objective="decoupled", samples_per_prompt=4))
    resolved = from_dict(values).algorithm_config()
    assert (resolved.rollout_correction, resolved.rollout_correction_level) == ("mis", "token")
    ppo = from_dict({**values, "algo": "ppo" if algo != "gspo" else "grpo"}).algorithm_config()
    differing = {f.name for f in dataclasses.fields(resolved) if getattr(resolved, f.name) != getattr(ppo, f.name)}
    assert not differing & {"rollout_correction", "rollout_correction_level", "rollout_correction_cap"}, differing
    coupled = from_dict(merged(values, {"rollout": {"backend": "vllm", "staleness": 0,
                                                    "stale_objective": "coupled"}})).algorithm_config()
    assert coupled.rollout_correction_level == ("turn" if resolved.ratio_level == "turn" else "token")


def test_st_ppo_under_decoupled_weights_each_token_by_its_own_behaviour_ratio(tiny_model, tmp_path):
    config = lagged_config(tiny_model, tmp_path, "st_ppo", 1, iterations=3,
                           rollout=dict(stale_objective="decoupled", max_new_tokens_per_turn=3))
    trainer = Trainer(config, report=lambda _: None)
    seen = scored_batches(trainer)
    trainer.train()
    cap = trainer.algo.rollout_correction_cap
    for batch, _ in seen[1:]:  # lagged: the proximal policy is one update past the behaviour policy
        mask = batch.loss_mask
        w = torch.exp((batch.old_logprobs - batch.sample_logprobs).clamp(-20, 20))
        expected = torch.where(mask & (w <= cap), w, torch.zeros(()))
        torch.testing.assert_close(batch.token_weights, expected, rtol=1e-6, atol=0)
        turn_means_differ = False  # the weights vary inside turns: a per-turn weight would be constant there
        for row in range(batch.batch_size):
            for turn in batch.turn_ids[row][mask[row]].unique():
                values = w[row][mask[row] & (batch.turn_ids[row] == turn)]
                turn_means_differ |= bool(values.max() - values.min() > 1e-4)
        assert turn_means_differ


def test_m2po_under_decoupled_cuts_on_the_proximal_against_behaviour_pair(tiny_model, tmp_path):
    """With 2 iterations of lag the behaviour log-ratio's second moment is far above the threshold: M2PO must
    report it and mask tokens on the first step of the iteration, where the current policy is the proximal one."""
    config = lagged_config(tiny_model, tmp_path, "m2po", 2,
                           algorithm={"m2_threshold": 0.01, "rollout_correction_cap": 1e6},
                           rollout=dict(stale_objective="decoupled", max_new_tokens_per_turn=3),
                           optimizer=dict(actor_lr=5e-2))
    trainer = Trainer(config, report=lambda _: None)
    seen = scored_batches(trainer)
    trainer.train()
    records = read_metrics(tmp_path)
    for (batch, _), record in list(zip(seen, records))[2:]:  # iterations 3-5 sample with weights 2 updates old
        log_ratio = (batch.old_logprobs - batch.sample_logprobs).clamp(-20, 20).double()
        expected = float((log_ratio[batch.loss_mask] ** 2).mean())  # the cap of 1e6 drops no token
        assert expected > 10 * trainer.algo.m2_threshold
        assert record["m2po/second_moment"] == pytest.approx(expected, rel=1e-5)
        assert record["clip_frac"] > 0  # tokens masked on the only step of the iteration


@pytest.mark.parametrize("objective", ["coupled", "decoupled"])
def test_kl_columns_are_the_behaviour_policys_and_the_learners_is_logged_apart(tiny_model, tmp_path, objective):
    config = lagged_config(tiny_model, tmp_path, "ppo", 1, iterations=4,
                           algorithm={"kl_in_reward": 0.05, "kl_loss_coef": 0.0},
                           rollout=dict(stale_objective=objective))
    trainer = Trainer(config, report=lambda _: None)

    def policies(batch):  # before scoring: the lagged behaviour weights, the actor the update starts from
        state = trainer.state
        return logprobs_of(trainer, state.stale_policy.model, batch), logprobs_of(trainer, state.actor, batch)

    seen = scored_batches(trainer, before=policies)
    trainer.train()
    records = read_metrics(tmp_path)
    for (batch, (behaviour, learner)), record in zip(seen, records):
        mask = batch.loss_mask
        assert batch.stats["kl_to_reference"] == pytest.approx(float((behaviour - batch.ref_logprobs)[mask].mean()),
                                                               abs=1e-7)
        assert record["learner_kl_to_reference"] == pytest.approx(
            float((learner - batch.ref_logprobs)[mask].double().mean()), abs=2e-6)
        penalty = kl_reward_penalty(behaviour, batch.ref_logprobs, mask, trainer.algo)
        advantages, _ = estimate_advantages(trainer.algo.advantage, rewards=batch.rewards, values=batch.values,
                                            loss_mask=mask, group_ids=batch.group_ids, config=trainer.algo,
                                            kl_penalty=penalty, turn_ids=batch.turn_ids)
        torch.testing.assert_close(batch.advantages, advantages, rtol=1e-5, atol=1e-6)
    lagged = [(b, r) for (b, (behaviour, learner)), r in zip(seen, records)
              if (behaviour - learner)[b.loss_mask].abs().max() > 1e-3]
    assert lagged  # the two policies differ: the checks above tell them apart


# A run that left its rollout correction to ``auto`` can switch to ``stale_objective=decoupled`` on ``--resume`` or in
# ``stppo replay``: config.yaml keeps the ``auto`` the user asked for beside what it resolved to, and the switch
# resolves it again (to the decoupled objective's per-token mis).


def recorded(run: Path) -> dict:
    return yaml.safe_load((run / "config.yaml").read_text())


def test_resume_and_replay_switch_an_auto_correction_to_the_decoupled_objective(tiny_model, tmp_path, capsys):
    run = tmp_path / "run"
    command = toy_train_command(tiny_model, run, 2, extra=("rollout.staleness=1", "logging.save_rollouts=true"))[3:]
    assert stppo(*command, capsys=capsys).returncode == 0
    config = recorded(run)
    assert config["algorithm"]["rollout_correction"] == config["algorithm"]["rollout_correction_level"] == "auto"
    assert config["algorithm_resolved"] == {"rollout_correction": "none", "rollout_correction_level": "turn"}
    assert "rollout_correction/masked_frac" not in read_metrics(run)[-1]

    replayed = tmp_path / "replay"
    done = stppo("replay", str(run), "--output-dir", str(replayed), "--set", "rollout.stale_objective=decoupled",
                 capsys=capsys)
    assert done.returncode == 0, done.stderr
    assert json.loads((replayed / "replay.json").read_text())["rollout_correction"] == "mis"
    assert recorded(replayed)["algorithm"]["rollout_correction_level"] == "token"
    assert all("rollout_correction/masked_frac" in record for record in read_metrics(replayed))

    resumed = stppo(*toy_train_command(tiny_model, run, 3, resume=True,
                                       extra=("rollout.staleness=1", "logging.save_rollouts=true",
                                              "rollout.stale_objective=decoupled"))[3:], capsys=capsys)
    assert resumed.returncode == 0, resumed.stderr
    assert "rollout_correction/masked_frac" in read_metrics(run)[-1] and read_metrics(run)[-1]["step"] == 3
    config = recorded(run)
    assert config["rollout"]["stale_objective"] == "decoupled" and config["algorithm"]["rollout_correction"] == "auto"
    assert config["algorithm_resolved"] == {"rollout_correction": "mis", "rollout_correction_level": "token"}


def test_a_correction_set_by_hand_stays_set(tiny_model, tmp_path, capsys):
    run = tmp_path / "run"
    command = toy_train_command(tiny_model, run, 1, extra=("rollout.staleness=1", "algorithm.rollout_correction=tis",
                                                           "algorithm.rollout_correction_cap=3"))[3:]
    assert stppo(*command, capsys=capsys).returncode == 0
    config = recorded(run)
    assert config["algorithm"]["rollout_correction"] == "tis" and config["algorithm"]["rollout_correction_cap"] == 3
    assert config["algorithm_resolved"] == {"rollout_correction_level": "turn"}
    resumed = stppo(*toy_train_command(tiny_model, run, 2, resume=True,
                                       extra=("rollout.staleness=1", "rollout.stale_objective=decoupled"))[3:],
                                       capsys=capsys)
    assert resumed.returncode == 0, resumed.stderr
    assert "rollout_correction/truncated_frac" in read_metrics(run)[-1]  # still tis, now per token
    assert recorded(run)["algorithm_resolved"] == {"rollout_correction_level": "token"}
