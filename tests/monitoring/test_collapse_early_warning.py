"""Collapse early warning: the monitor's rules on synthetic series, and warn / stop / rollback end to end on the
toy env with a reward that turns adversarial mid-run (``reward_flip_episodes``)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from stppo_agent.cli import main
from stppo_agent.monitoring.collapse_guard import CollapseStopped
from stppo_agent.monitoring.collapse_rules import CollapseMonitor, MonitorSettings
from stppo_agent.runs.checkpoint_health import best_step, checkpoint_reward, healthy_steps
from stppo_agent.runs.metrics_log import read_metrics
from stppo_agent.runs.plots import collapse_events, plot_runs
from stppo_agent.runs.run_folder import pick_checkpoint
from stppo_agent.training.config import merged
from stppo_agent.training.trainer import Trainer
from tests.support.runs import toy_config

FLIP = [9, 12]  # iterations 10, 11 and 12 pay for *not* saying the target


def healthy_metrics(rng: random.Random) -> dict[str, float]:
    return {"tail/ratio_max": 1.05 + 0.02 * rng.random(), "clip_frac": 0.05 + 0.01 * rng.random(),
            "entropy": 0.8 + 0.05 * rng.random(), "grad_norm": 0.5 + 0.1 * rng.random(),
            "reward": 0.6 + 0.05 * rng.random(), "response_tokens": 40 + 4 * rng.random()}


def feed(monitor: CollapseMonitor, series: list[dict[str, float]], start: int = 1):
    return [monitor.observe(start + i, metrics) for i, metrics in enumerate(series)]


def test_two_families_at_once_alarm_immediately_one_family_needs_patience():
    rng = random.Random(0)
    monitor = CollapseMonitor(MonitorSettings(warmup=5, z=6, patience=2, min_families=2))
    quiet = feed(monitor, [healthy_metrics(rng) for _ in range(10)])
    assert not any(v.trips or v.alarm for v in quiet)

    one = healthy_metrics(rng) | {"grad_norm": 9.0}  # a gradient spike alone: tripped, not yet an alarm
    verdict = monitor.observe(11, one)
    assert [t.key for t in verdict.trips] == ["grad_norm"] and not verdict.alarm
    verdict = monitor.observe(12, healthy_metrics(rng) | {"grad_norm": 9.5})  # the same family again: alarm
    assert verdict.alarm and verdict.onset == 11
    assert "grad_norm 9.5 (recent" in verdict.describe()

    monitor = CollapseMonitor(MonitorSettings(warmup=5))
    feed(monitor, [healthy_metrics(rng) for _ in range(10)])
    both = healthy_metrics(rng) | {"tail/ratio_max": 4.0, "entropy": 3.0}
    verdict = monitor.observe(11, both)
    assert verdict.alarm and {t.family for t in verdict.trips} == {"off-policy", "entropy"}
    assert verdict.metrics()["collapse/alarm"] == 1 and verdict.metrics()["collapse/tripped"] == 2


def test_floors_warmup_and_direction():
    monitor = CollapseMonitor(MonitorSettings(warmup=5))
    flat = [{"clip_frac": 0.0, "entropy": 1.0, "grad_norm": 0.001} for _ in range(8)]
    feed(monitor, flat)
    # MAD is 0, but a first clipped token or a converged policy's gradient coming back is not a collapse
    assert not monitor.observe(9, {"clip_frac": 0.02, "entropy": 1.0, "grad_norm": 0.5}).trips
    assert monitor.observe(10, {"clip_frac": 0.5}).trips  # a jump far beyond the floor
    down = CollapseMonitor(MonitorSettings(warmup=5))
    feed(down, [{"tail/ratio_max": 1.5} for _ in range(8)])
    assert not down.observe(9, {"tail/ratio_max": 1.0}).trips  # ratio tails are bad only upwards
    early = CollapseMonitor(MonitorSettings(warmup=5))
    feed(early, [{"grad_norm": 0.5} for _ in range(4)])
    assert not early.observe(5, {"grad_norm": 50.0}).trips  # 4 iterations of history: still warming up


def test_absolute_limits_trip_from_the_first_iteration_and_warm_up_is_not_known_healthy():
    monitor = CollapseMonitor(MonitorSettings(warmup=5, thresholds=(("kl_to_reference", 1.0),)))
    first = monitor.observe(1, {"kl_to_reference": 1.7, "reward": 0.5})
    assert first.warming_up and first.metrics()["collapse/warmup"] == 1
    assert [t.describe() for t in first.trips] == ["kl_to_reference 1.7 (above its limit 1)"]
    records = [{"step": i, "reward": 0.5, **monitor.observe(i, {"kl_to_reference": 0.1, "reward": 0.5}).metrics()}
               for i in range(2, 9)]
    assert [r["step"] for r in records if r.get("collapse/warmup")] == [2, 3, 4, 5]
    assert healthy_steps(records, range(1, 9)) == [6, 7]  # 5 and earlier were judged by limits alone
    with pytest.raises(ValueError, match="not a monitored signal"):
        MonitorSettings(thresholds=(("kl", 1.0),)).validate()


def test_reward_drawdown_beyond_its_noise():
    rng = random.Random(1)
    monitor = CollapseMonitor(MonitorSettings(warmup=5, drawdown=0.5))
    feed(monitor, [{"reward": 0.9 + 0.02 * rng.random()} for _ in range(8)])
    assert [t.key for t in monitor.observe(9, {"reward": 0.05}).trips] == ["reward_drawdown"]

    noisy = CollapseMonitor(MonitorSettings(warmup=5, drawdown=0.5))  # tiny batches: 0 and 0.5 by chance
    rewards = [0.5, 0.0, 0.4, 0.1, 0.5, 0.0, 0.45, 0.05]
    feed(noisy, [{"reward": r} for r in rewards])
    assert not noisy.observe(9, {"reward": 0.0}).trips


def test_replay_of_records_rebuilds_the_monitor_and_forgets_rolled_back_iterations():
    rng = random.Random(2)
    series = [healthy_metrics(rng) for _ in range(12)]
    live = CollapseMonitor()
    records = []
    for i, metrics in enumerate(series, start=1):
        records.append({"step": i, **metrics, **live.observe(i, metrics).metrics()})
        if i == 10:  # iteration 10 rolled back to step 6, as the guard does
            live.forget_after(6)
            records[-1]["collapse/rollback_to"] = 6
    rebuilt = CollapseMonitor()
    rebuilt.reobserve(records)
    probe = healthy_metrics(rng) | {"grad_norm": 3.0}
    assert rebuilt.history == live.history
    assert [t.z for t in rebuilt.observe(13, probe).trips] == [t.z for t in live.observe(13, probe).trips]
    assert all(i <= 6 or i > 10 for i, _ in rebuilt.history["grad_norm"])


def test_checkpoint_health_and_best_from_records():
    records = [{"step": i, "reward": r, "collapse/tripped": t}
               for i, (r, t) in enumerate([(0.1, 0), (0.5, 0), (0.9, 0), (0.8, 0), (0.2, 1), (0.1, 1), (0.3, 0)],
                                          start=1)]
    assert healthy_steps(records, [1, 2, 3, 4, 5, 6, 7]) == [1, 2, 3]  # 4: iteration 5 (its rollouts) tripped
    assert checkpoint_reward(records, 2) == 0.9  # iteration 3 sampled with step 2's weights
    assert checkpoint_reward(records, 7) == 0.3  # the last one: its own iteration
    assert best_step(records, [1, 2, 3, 4, 5]) == 2
    assert best_step(records, [5, 6]) is None


def flip_config(model: Path, out: Path, action: str, **overrides):
    values = dict(iterations=16, env_kwargs={"fixed_target": "red", "reward_flip_episodes": FLIP},
                  checkpoint=dict(every=1, keep=1), monitor=dict(on_collapse=action))
    values = merged(values, overrides)
    return toy_config(model, out, "ppo", **values)


def test_warn_raises_the_alarm_within_two_iterations_of_the_onset(tiny_model, tmp_path):
    messages = []
    Trainer(flip_config(tiny_model, tmp_path, "warn", iterations=12), report=messages.append).train()
    records = read_metrics(tmp_path)
    alarms = [r["step"] for r in records if r.get("collapse/alarm")]
    assert alarms and FLIP[0] + 1 <= alarms[0] <= FLIP[0] + 2, alarms  # the onset is iteration 10
    assert not any(r.get("collapse/alarm") for r in records if r["step"] <= FLIP[0])  # no alarm while healthy
    assert records[alarms[0] - 1]["collapse/action"] == "warn"
    warning = next(m for m in messages if m.startswith("collapse alarm"))
    assert f"at iteration {alarms[0]}" in warning and "reward" in warning and "below its best" in warning
    assert all("collapse/rollback_to" not in r for r in records)
    assert collapse_events(records)[0] == (alarms[0], "alarm")
    # pruning to 1 kept the newest healthy checkpoint (taken before the corruption) and the best one
    assert 8 in {int(p.name.split("-")[1]) for p in (tmp_path / "checkpoints").glob("step-*")}


def test_rollback_restores_a_healthy_checkpoint_and_recovers(tiny_model, tmp_path):
    messages = []
    Trainer(flip_config(tiny_model, tmp_path, "rollback"), report=messages.append).train()
    records = read_metrics(tmp_path)
    rollbacks = [r for r in records if "collapse/rollback_to" in r]
    assert len(rollbacks) == 1, [r.get("collapse/signals") for r in records]
    event = rollbacks[0]
    assert event["step"] <= FLIP[0] + 2 and event["collapse/rollback_to"] <= FLIP[0] - 1
    assert event["collapse/lr_scale"] == pytest.approx(0.5)
    after = [r for r in records if r["step"] > event["step"]]
    assert all(r["actor_lr"] == pytest.approx(1.5e-3) for r in after)  # the scaled rate stays
    assert sum(r["reward"] for r in records[-3:]) / 3 > 0.85, [r["reward"] for r in records]
    # the collapsed checkpoints are set aside, never resumed from; the rolled-back state was saved at once
    aside = sorted(p.name for p in (tmp_path / "checkpoints").glob(".collapsed-step-*"))
    assert aside and all(int(name.rsplit("-", 1)[1]) > event["collapse/rollback_to"] for name in aside)
    assert any(m.startswith("collapse alarm") and "Rolling back to step-" in m for m in messages)
    # the restored weights are the checkpoint's: a fresh trainer resuming there scores the same log-probs
    folder, why = pick_checkpoint(tmp_path, "best")
    assert "healthy" in why and int(folder.name.split("-")[1]) not in {int(n.rsplit("-", 1)[1]) for n in aside}
    from stppo_agent.evaluation.agent_specs import resolve_agent_spec

    spec, note = resolve_agent_spec(f"hf:{tmp_path}@best")
    assert spec == f"hf:{folder / 'actor'}" and note.startswith(f"hf:{tmp_path}@best -> step-")
    assert resolve_agent_spec(f"hf:{tmp_path}")[0].endswith("step-16/actor")  # a run folder alone: its latest
    with pytest.raises(ValueError, match="choose @latest, @best, @healthy"):
        resolve_agent_spec(f"hf:{tmp_path}@bestest")
    written = plot_runs([tmp_path], tmp_path / "plots")
    assert written and all(p.stat().st_size > 0 for p in written)


def test_an_alarm_during_the_warm_up_cannot_roll_back_and_stops(tiny_model, tmp_path):
    # the KL to the reference grows as the policy learns and passes a low absolute limit after a few clean
    # iterations, all inside a long warm-up: their checkpoints are not known healthy (the demo at lr 1e-4 collapsed
    # inside the warm-up, and was first rolled back to a checkpoint that had collapsed already)
    config = flip_config(tiny_model, tmp_path, "rollback", iterations=10, env_kwargs={},
                         algorithm={"kl_in_reward": 0.001, "kl_loss_coef": 0.0},
                         monitor=dict(warmup=12, thresholds={"kl_to_reference": 0.3}))
    with pytest.raises(CollapseStopped, match="Cannot roll back: no checkpoint is known healthy"):
        Trainer(config, report=lambda _: None).train()
    records = read_metrics(tmp_path)
    clean = [r["step"] for r in records if not r["collapse/tripped"]]
    assert len(clean) >= 2 and clean == list(range(1, len(clean) + 1))  # healthy-looking iterations came first
    assert records[-1]["collapse/action"] == "stop" and all(r.get("collapse/warmup") for r in records)
    assert all("collapse/rollback_to" not in r for r in records)


def test_rollback_weights_equal_the_checkpoint(tiny_model, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    trainer = Trainer(flip_config(tiny_model, tmp_path, "none", iterations=2, env_kwargs={},
                                  monitor=dict(rollback_lr_factor=0.25)))
    trainer.train()
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoints" / "step-2" / "actor")
    with torch.no_grad():
        for p in trainer.state.actor.parameters():
            p.add_(1.0)  # what a collapse does to weights, roughly
    base_lr = trainer.state.actor_scheduler.base_lrs[0]
    scale = trainer.roll_back(2)["collapse/lr_scale"]
    for (name, mine), theirs in zip(trainer.state.actor.state_dict().items(), saved.state_dict().values()):
        assert torch.equal(mine, theirs), name
    assert scale == pytest.approx(0.25) and trainer.state.actor_scheduler.base_lrs[0] == pytest.approx(base_lr * 0.25)
    assert trainer.state.actor_optimizer.param_groups[0]["lr"] == pytest.approx(base_lr * 0.25)


def cli_train(model: Path, out: Path, action: str, iterations: int = 16) -> list[str]:
    return ["train", "--algo", "ppo", "--env", "stppo/Toy-v0", "--model", str(model), "--output-dir", str(out),
            "--iterations", str(iterations), "--set", f"monitor.on_collapse={action}", "--set", "checkpoint.every=1",
            "--set", "checkpoint.keep=1", "--set", "rollout.prompts_per_iteration=8", "--set",
            "rollout.samples_per_prompt=8",
            "--set", "optimizer.mini_batch_size=32", "--set", "optimizer.micro_batch_size=16", "--set",
            "optimizer.epochs=2",
            "--set", "optimizer.actor_lr=3e-3", "--set", "optimizer.critic_lr=3e-3", "--set", "rollout.max_turns=2",
            "--set", "rollout.max_new_tokens_per_turn=1", "--set", "rollout.max_prompt_tokens=8", "--set",
            "rollout.max_total_tokens=32",
            "--set", "logging.progress=false", "--set", "logging.tensorboard=false", "--set",
            "algorithm.kl_in_reward=0",
            "--set", "algorithm.kl_loss_coef=0", "--set", "env_kwargs.fixed_target=red",
            "--set", f"env_kwargs.reward_flip_episodes={json.dumps(FLIP)}"]


def test_stop_from_the_cli_checkpoints_and_exits_3(tiny_model, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(cli_train(tiny_model, out, "stop"))
    err = capsys.readouterr().err
    assert code == 3, err
    assert "stopped: collapse alarm at iteration" in err and "monitor.on_collapse=stop" in err and "--resume" in err
    records = read_metrics(out)
    last = records[-1]
    assert last["collapse/alarm"] == 1 and last["collapse/action"] == "stop" and last["step"] <= FLIP[0] + 2
    assert (out / "checkpoints" / f"step-{last['step']}" / "manifest.json").exists()  # saved at the alarm
    assert f"step-{last['step']}" in err


@pytest.mark.parametrize("action", ["warn", "rollback"])
def test_warn_and_rollback_from_the_cli_then_plot_and_evaluate_the_best_checkpoint(tiny_model, tmp_path, capsys,
                                                                                   action):
    out = tmp_path / "run"
    assert main(cli_train(tiny_model, out, action, iterations=14)) == 0
    captured = capsys.readouterr()
    assert "collapse alarm at iteration" in captured.out + captured.err
    events = collapse_events(read_metrics(out))
    assert events and events[0][1] == ("alarm" if action == "warn" else "rollback")
    assert main(["plot", str(out), "--out", str(tmp_path / "plots")]) == 0
    assert main(["eval", "--agent", f"hf:{out}@best", "--benchmarks", "nq", "--limit", "1", "--max-turns", "1",
                 "--max-new-tokens", "2", "--output-dir", str(tmp_path / "eval")]) == 0
    assert "@best -> step-" in capsys.readouterr().out


def test_config_rejects_bad_collapse_settings():
    from stppo_agent.training.config import TrainConfig

    for field, value, message in (("on_collapse", "panic", "monitor.on_collapse must be one of"),
                                  ("rollback_lr_factor", 1.5, "monitor.rollback_lr_factor"),
                                  ("warmup", 50, "monitor.warmup")):
        with pytest.raises(ValueError, match=message):
            TrainConfig(model="m", monitor={field: value}).validate()
    from stppo_agent.training.config import load_config

    config = load_config(None, ["monitor.thresholds.tail/ratio_max=50", "monitor.on_collapse=rollback"], model="m")
    assert config.monitor.thresholds == {"kl_to_reference": 1.0, "tail/ratio_max": 50}
    config.validate()
    with pytest.raises(ValueError, match="not a monitored signal"):
        load_config(None, ["monitor.thresholds.ratio=5"], model="m").validate()


def test_an_unmonitored_run_has_no_healthy_checkpoint_and_its_best_says_so(tiny_model, tmp_path):
    # on_collapse=none: no monitor judged any iteration, so none can vouch for a checkpoint
    config = toy_config(tiny_model, tmp_path, "ppo", iterations=4, checkpoint=dict(every=1, keep=4),
                        rollout=dict(prompts_per_iteration=4, samples_per_prompt=2),
                        optimizer=dict(mini_batch_size=8, micro_batch_size=4), monitor=dict(on_collapse="none"))
    Trainer(config, report=lambda _: None).train()
    records = read_metrics(tmp_path)
    assert not any(key.startswith("collapse/") for r in records for key in r)
    assert healthy_steps(records, [1, 2, 3, 4]) == []
    with pytest.raises(FileNotFoundError,
                       match="monitor.on_collapse=none.*no collapse monitor.*@best, @latest or @STEP"):
        pick_checkpoint(tmp_path, "healthy")
    folder, why = pick_checkpoint(tmp_path, "best")
    rewards = {s: checkpoint_reward(records, s) for s in (1, 2, 3, 4)}
    best = max(sorted(rewards), key=lambda s: (rewards[s], s))
    assert folder.name == f"step-{best}", (rewards, why)
    assert f"highest training reward ({rewards[best]:.3f}, iteration " in why and "not monitored" in why
    # iterations the monitor never saw vouch for nothing in a run that turned it on later
    judged = [{"step": 1, "reward": 0.9}, {"step": 2, "reward": 0.9},
              {"step": 3, "reward": 0.5, "collapse/tripped": 0}, {"step": 4, "reward": 0.5, "collapse/tripped": 0}]
    assert healthy_steps(judged, [1, 2, 3]) == [3]
