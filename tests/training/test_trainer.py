"""``stppo_agent.training.trainer``: ``Trainer.__init__``'s wiring and the loop's
stages with their collaborators stubbed -- resume, rollback, the guard's decisions, the bar, every rank's share of
the writing -- and short runs on the toy env: the critic steps, the reference stays the initial policy, later
mini-batches are off-policy, progress shows within iterations."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import yaml

from stppo_agent.runs.metrics_log import read_metrics
from stppo_agent.training import trainer as trainer_module
from stppo_agent.training.config import from_dict, merged
from stppo_agent.training.live_rollouts import RolloutContext
from stppo_agent.training.state import Restore
from stppo_agent.training.trainer import Trainer
from tests.support.runs import toy_config
from tests.support.training_parts import RecordedBar, record_bars
from tests.support.training_states import linear_state

# -- trainer ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from stppo_agent.models.tiny import build_tiny_llama, word_tokenizer

    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", word_tokenizer(), hidden=8, layers=1)


def toy_run(model, out, **values):
    settings = dict(algo="ppo", env="stppo/Toy-v0", model=str(model), output_dir=str(out), iterations=3, seed=11,
                    algorithm={"kl_in_reward": 0.0, "kl_loss_coef": 0.0},
                    rollout=dict(prompts_per_iteration=2, samples_per_prompt=2, max_turns=2, max_new_tokens_per_turn=1,
                                 max_prompt_tokens=8, max_total_tokens=16),
                    optimizer=dict(mini_batch_size=4, micro_batch_size=2, actor_lr=0.01),
                    logging=dict(progress=False, tensorboard=False), checkpoint=dict(every=2, keep=5))
    return from_dict(merged(settings, values))


def test_a_short_run_trains_logs_and_checkpoints_every_save_every_and_at_the_end(tiny_folder, tmp_path,
                                                                               monkeypatch):
    import stppo_agent.training.trainer as trainer_module
    from stppo_agent.runs.metrics_log import read_metrics
    from stppo_agent.training.trainer import Trainer

    loggers, logger = [], trainer_module.MetricsLogger

    def metrics_logger(run_dir, tensorboard, wandb_project, config):  # W&B and TensorBoard stay off here
        loggers.append((run_dir, tensorboard, wandb_project, config))
        return logger(run_dir, tensorboard=False, wandb_project=None, config=config)

    monkeypatch.setattr(trainer_module, "MetricsLogger", metrics_logger)
    reports, batches = [], []
    trainer = Trainer(toy_run(tiny_folder, tmp_path, device="cpu", rollout=dict(staleness=1),
                              logging=dict(save_rollouts=True, step_diagnostics=True, tensorboard=True,
                                           wandb_project="toy"), precision=dict(autocast_dtype="auto")),
                      report=reports.append, batch_hook=batches.append)
    assert [entry[:3] for entry in loggers] == [(tmp_path, True, "toy")] and loggers[0][3]["seed"] == 11
    assert torch.initial_seed() == 11 and trainer.config.precision.autocast_dtype in (None, "bfloat16")  # auto resolved
    state = trainer.state
    assert (state.iteration, state.optimizer_steps, state.nan_skips_in_a_row, state.nan_skips_total,
            state.actor_lr_scale, trainer.rank, trainer.world, trainer.sharded) == (0, 0, 0, 0, 1.0, 0, 1, False)
    assert trainer.algo.advantage == "gae" and trainer.run_dir == tmp_path and trainer.device.type == "cpu"
    assert trainer.guard is not None and trainer.diagnostics is not None and trainer.recorder is not None
    assert trainer.state.full_states(trainer.sharded) == (None, None)
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["algorithm"]["advantage"] == "gae" and len(saved["algorithm"]) >= 15
    assert saved["precision"]["autocast_dtype"] == trainer.config.precision.autocast_dtype
    synced = []

    class Engine:  # a backend with its own copy of the weights (vLLM's role), generating through the HF one
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def sync_weights(self, actor):
            synced.append(actor)

    trainer.backend = Engine(trainer.backend)
    last = trainer.train()
    assert synced == [trainer.state.actor] * 3  # after every update
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3] and (state.iteration, state.optimizer_steps) == (3, 3)
    assert [r["staleness"] for r in records] == [0, 1, 1]
    assert last["reward"] == records[-1]["reward"] and last["staleness"] == 1  # train() returns the last metrics
    for r in records:
        assert 0 < r["rollout_seconds"] <= r["iteration_seconds"]
        assert r["rollout_tokens_per_s"] == pytest.approx(r["response_tokens"] * 4 / r["rollout_seconds"], rel=1e-6)
    assert len(batches) == 3 and all(b.batch_size == 4 for b in batches)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step-")) == \
        ["step-2", "step-3"]
    assert (tmp_path / "steps.jsonl").exists() and (tmp_path / "rollouts").is_dir()
    assert trainer._bar is None


def test_a_resumed_run_continues_and_one_as_long_as_asked_says_so(tiny_folder, tmp_path, capsys):
    import shutil

    from stppo_agent.runs.metrics_log import read_metrics
    from stppo_agent.training.trainer import Trainer

    Trainer(toy_run(tiny_folder, tmp_path, iterations=2, monitor=dict(on_collapse="none"), checkpoint=dict(every=1),
                    logging=dict(progress=True)),
            report=lambda _: None).train()
    bar = capsys.readouterr().err
    assert "training: 100%" in bar and " 2/2 " in bar and "scoring" in bar  # the progress bar
    assert "it/s" in bar or "s/it" in bar
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2] and not any("staleness" in r for r in records)
    assert not any("gpu_peak_memory_gib" in r for r in records)  # a CUDA-only metric
    assert not (tmp_path / "tensorboard").exists() and "training" not in capsys.readouterr().err  # both off
    shutil.rmtree(tmp_path / "checkpoints" / "step-2")  # as if killed before the second checkpoint
    reports = []
    again = Trainer(toy_run(tiny_folder, tmp_path, iterations=1, monitor=dict(on_collapse="none")), resume=True,
                    report=reports.append)
    assert (again.state.iteration, again.state.optimizer_steps) == (1, 1)
    assert again.guard is None and again.diagnostics is None
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]  # the records after the checkpoint are dropped
    assert again.train() == {}
    assert reports[-1] == (f"nothing to train: {tmp_path} is at iteration 1 and iterations=1; --iterations 2 or more "
                           "continues it")
    longer = Trainer(toy_run(tiny_folder, tmp_path, iterations=2, monitor=dict(on_collapse="none"),
                             checkpoint=dict(keep=1)),
                     resume=True, report=lambda _: None)
    longer.train()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2] and longer.state.optimizer_steps == 2
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step-")) == ["step-2"]
    with pytest.raises(Exception, match="resume|overwrite"):
        Trainer(toy_run(tiny_folder, tmp_path, iterations=2), report=lambda _: None)
    fresh = Trainer(toy_run(tiny_folder, tmp_path, iterations=2), overwrite=True, report=lambda _: None)
    assert fresh.state.iteration == 0 and read_metrics(tmp_path) == []


def test_a_bad_config_fails_before_the_run_folder_is_touched(tmp_path):
    from stppo_agent.training.trainer import Trainer

    with pytest.raises(ValueError, match="rollout.samples_per_prompt >= 2"):
        Trainer(toy_run("nowhere", tmp_path / "run", algo="grpo", rollout=dict(samples_per_prompt=1)))
    assert not (tmp_path / "run").exists()


class Recording:
    """A collaborator of the loop (rollout source, recorder, update, learning-signal notice) that records its calls."""

    sampled_by_actor = False
    env_kwargs = None

    def __init__(self, calls: list, batch=None):
        self.calls, self.batch = calls, batch

    def next_batch(self, iteration):
        self.calls.append(("next", iteration))
        return self.batch

    def record(self, iteration, batch):
        self.calls.append(("record", iteration, batch is self.batch))

    def update(self, batch, on_policy_start):
        return "update", batch, on_policy_start

    def actor_gradients(self, mini):
        return "gradients", mini

    def check(self, batch, iteration):
        self.calls.append(("signal", batch, iteration))


def test_the_trainer_stages_get_what_they_need_in_order(tiny_folder, tmp_path, monkeypatch):
    import stppo_agent.training.trainer as trainer_module
    from stppo_agent.monitoring.collapse_guard import CollapseGuard
    from stppo_agent.training.trainer import Trainer

    trainer = Trainer(toy_run(tiny_folder, tmp_path, monitor=dict(on_collapse="none"),
                              rollout=dict(old_logprobs="sampler")),
                      report=lambda _: None)
    calls = []
    batch = SimpleNamespace(to=lambda device: calls.append(("to", device)) or "moved")
    trainer.state.iteration = 4
    trainer.phase = lambda text: calls.append(("phase", text))
    trainer.source = trainer.recorder = trainer.updater = trainer.learning_signal = Recording(calls, batch)
    trainer.batch_hook = lambda b: calls.append(("hook", b is batch))
    assert trainer.rollout() == "moved"
    assert calls == [("phase", "rollout"), ("next", 4), ("record", 5, True), ("hook", True), ("to", trainer.device)]
    trainer.recorder = trainer.batch_hook = None
    calls.clear()
    trainer.rollout()
    assert calls == [("phase", "rollout"), ("next", 4), ("to", trainer.device)]
    # the sampler's own log-probs, sampled by another rule (a replay): not on-policy from the first step
    assert trainer.update("b") == ("update", "b", False) and trainer.actor_gradients("m") == ("gradients", "m")
    trainer.source.sampled_by_actor = True
    assert trainer.update("b") == ("update", "b", True)
    scored = []
    monkeypatch.setattr(trainer_module, "score_batch", lambda b, **kw: scored.append((b, kw)))
    calls.clear()
    the_batch = SimpleNamespace(batch_size=8)
    trainer.score(the_batch)
    state = trainer.state
    assert scored == [(the_batch, dict(config=trainer.config, algo=trainer.algo, actor=state.actor,
                                       generator=state.stale_policy.model, reference=state.reference,
                                       critic=state.critic, device=trainer.device, world=1,
                                       old_from_update=False))]  # only the training loop asks for it
    assert calls == [("signal", the_batch, 4)]
    saved = []
    state.save = lambda run_dir, config, algo, **kw: saved.append((run_dir, config, algo, kw)) or "path"
    assert trainer.save() == "path" and saved == [(tmp_path, trainer.config, trainer.algo,
                                                   dict(sharded=False, protect=()))]
    trainer.guard = CollapseGuard(trainer.config, tmp_path)
    trainer.guard.protected_steps = lambda: (2, 4)
    trainer.save()
    assert saved[-1][3] == dict(sharded=False, protect=(2, 4))


def test_phase_shows_on_the_bar_only_while_it_is_shown(tiny_folder, tmp_path):
    from stppo_agent.training.trainer import Trainer

    trainer = Trainer(toy_run(tiny_folder, tmp_path, monitor=dict(on_collapse="none")), report=lambda _: None)
    bar = RecordedBar(disable=False)
    trainer._bar = bar
    trainer.phase("scoring")
    assert bar.phases == ["scoring"] and bar.refreshed == [True]
    bar.disable = True
    trainer.phase("x")
    trainer._bar = None
    trainer.phase("y")
    assert bar.phases == ["scoring"]


def test_every_process_must_divide_both_batch_sizes(tiny_folder, tmp_path, monkeypatch):
    from stppo_agent.distributed import process_group
    from stppo_agent.training.trainer import Trainer

    monkeypatch.setattr(process_group, "world_size", lambda: 2)
    for prompts, mini in ((3, 2), (2, 3)):  # either one indivisible is refused
        with pytest.raises(ValueError) as info:
            Trainer(toy_run(tiny_folder, tmp_path / "run",
                            rollout=dict(prompts_per_iteration=prompts, samples_per_prompt=2 if prompts == 3 else 3),
                            optimizer=dict(mini_batch_size=mini, micro_batch_size=1)))
        assert str(info.value) == (f"rollout.prompts_per_iteration ({prompts}) and optimizer.mini_batch_size ({mini}) "
                                   "must be multiples of the number of processes (2)")
    assert not (tmp_path / "run").exists()


def test_fsdp2_joins_the_process_group_before_anything_else(tiny_folder, tmp_path, monkeypatch):
    from stppo_agent.distributed import process_group
    from stppo_agent.training.trainer import Trainer

    def joined():
        raise RuntimeError("joined the process group")

    monkeypatch.setattr(process_group, "ensure_process_group", joined)
    with pytest.raises(RuntimeError, match="joined the process group"):
        Trainer(toy_run(tiny_folder, tmp_path / "run", distributed=dict(strategy="fsdp2")))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("rank", [0, 1])
def test_only_a_later_rank_reseeds_and_only_the_first_writes_the_run(tiny_folder, tmp_path, monkeypatch, rank):
    """Rank 0 keeps the one-process stream (seeded once, before the models are built); a later rank then reseeds
    with its own seed, and neither logs, writes config.yaml nor saves a checkpoint (rank 0 does)."""
    from stppo_agent.distributed import process_group
    from stppo_agent.training.trainer import Trainer

    seeds, seed_everything = [], process_group.seed_everything
    monkeypatch.setattr(process_group, "seed_everything", lambda seed: seeds.append(seed) or seed_everything(seed))
    monkeypatch.setattr(process_group, "rank", lambda: rank)
    trainer = Trainer(toy_run(tiny_folder, tmp_path, iterations=1, checkpoint=dict(every=1),
                              monitor=dict(on_collapse="none")),
                      report=lambda _: None)
    assert seeds == ([11] if rank == 0 else [11, process_group.rank_seed(11, 1)])
    assert trainer._bar is None and trainer.phase("rollout") is None  # no bar outside train(): phases show nowhere
    assert trainer.rank == rank and (trainer.logger is None) == (rank == 1)
    trainer.train()
    assert (tmp_path / "config.yaml").exists() == (rank == 0) == (tmp_path / "metrics.jsonl").exists()
    assert trainer.save() == tmp_path / "checkpoints" / "step-1"
    assert (tmp_path / "checkpoints" / "step-1").is_dir() == (rank == 0)


def test_the_folder_and_the_metrics_log_report_through_the_trainer(tiny_folder, tmp_path):
    from stppo_agent.training.trainer import Trainer

    Trainer(toy_run(tiny_folder, tmp_path, iterations=1, checkpoint=dict(every=1), monitor=dict(on_collapse="none")),
            report=lambda _: None).train()
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 2, "rew')  # a torn last record, as kill -9 during a write leaves
    reports = []
    Trainer(toy_run(tiny_folder, tmp_path, iterations=1, checkpoint=dict(every=1), monitor=dict(on_collapse="none")),
            resume=True,
            report=reports.append)
    assert reports[-1] == f"{tmp_path / 'metrics.jsonl'}: dropped a torn last record (line 2, an interrupted write)"
    assert reports[0].startswith(f"resumed from {tmp_path / 'checkpoints' / 'step-1'} (iteration 1")
    reports.clear()
    Trainer(toy_run(tiny_folder, tmp_path, iterations=1, monitor=dict(on_collapse="none")), overwrite=True,
            report=reports.append)
    assert len(reports) == 1 and reports[0].startswith(f"--overwrite: removing the run in {tmp_path} (")


def test_a_resume_loads_the_checkpointed_weights_and_refuses_a_tied_setting(tiny_folder, tmp_path, monkeypatch):
    import stppo_agent.training.trainer as trainer_module
    from stppo_agent.training.trainer import Trainer

    first = Trainer(toy_run(tiny_folder, tmp_path, iterations=1, checkpoint=dict(every=1),
                            monitor=dict(on_collapse="none"), optimizer=dict(actor_lr=0.5)),
                    report=lambda _: None)
    first.train()
    again = Trainer(toy_run(tiny_folder, tmp_path, iterations=1, monitor=dict(on_collapse="none"),
                            optimizer=dict(actor_lr=0.5)), resume=True,
                    report=lambda _: None)
    trained, resumed = first.state.actor.state_dict(), again.state.actor.state_dict()
    assert all(torch.equal(trained[k], resumed[k]) for k in trained)  # not the folder's initial weights
    assert not (tmp_path / "rollouts").exists() and again.recorder is None  # save_rollouts is off
    loaded = []
    monkeypatch.setattr(trainer_module, "build_state", lambda *args: loaded.append(args))
    with pytest.raises(ValueError, match=r"^--resume cannot change seed \(11 -> 12\)"):  # before the models load
        Trainer(toy_run(tiny_folder, tmp_path, iterations=2, seed=12, monitor=dict(on_collapse="none"),
                        optimizer=dict(actor_lr=0.5)),
                resume=True, report=lambda _: None)
    assert loaded == []


def test_the_training_bar_counts_iterations_from_where_the_run_stands(tiny_folder, tmp_path, monkeypatch):
    import time

    from stppo_agent.training.trainer import Trainer

    bars = record_bars(monkeypatch, "training")

    Trainer(toy_run(tiny_folder, tmp_path, iterations=1, checkpoint=dict(every=1), monitor=dict(on_collapse="none")),
            report=lambda _: None).train()
    assert bars[0].kwargs == dict(total=1, initial=0, desc="training", unit="it", disable=True)  # progress=False
    started = time.perf_counter()
    metrics = Trainer(toy_run(tiny_folder, tmp_path, iterations=3, monitor=dict(on_collapse="none"),
                              logging=dict(progress=True)), resume=True,
                      report=lambda _: None).train()
    elapsed = time.perf_counter() - started
    bar = bars[1]
    assert bar.kwargs == dict(total=3, initial=1, desc="training", unit="it", disable=False) and bar.closed
    assert bar.updates == [1, 1]
    assert [phase for phase in bar.phases if phase in ("rollout", "scoring")] == ["rollout", "scoring"] * 2
    assert bar.postfixes[-1] == {"reward": f"{metrics['reward']:.3f}",
                                 "tok_s": f"{metrics['update_tokens_per_s']:.0f}"}
    assert 0 < metrics["rollout_seconds"] <= metrics["iteration_seconds"] < elapsed


def scripted_guard(trainer, script: dict):
    """The run's guard, deciding ``script[iteration]`` (continue otherwise); its calls are kept in ``seen``."""
    from stppo_agent.monitoring.collapse_guard import CONTINUE, CollapseGuard

    guard = CollapseGuard(trainer.config, trainer.run_dir)
    seen = []

    def check(iteration, metrics, actor_lr_scale=1.0):
        seen.append((iteration, "reward" in metrics, actor_lr_scale))
        return script.get(iteration, CONTINUE)

    guard.check = check
    trainer.guard = guard
    return seen


def test_a_stop_decision_saves_then_stops_with_the_guards_advice(tiny_folder, tmp_path):
    from stppo_agent.monitoring.collapse_guard import CollapseStopped, Decision
    from stppo_agent.training.trainer import Trainer

    trainer = Trainer(toy_run(tiny_folder, tmp_path, iterations=3, checkpoint=dict(every=10),
                              monitor=dict(on_collapse="none")),
                      report=lambda _: None)
    checks = scripted_guard(trainer, {2: Decision("stop", "reward collapsed.")})
    with pytest.raises(CollapseStopped) as info:
        trainer.train()
    assert checks == [(1, True, 1.0), (2, True, 1.0)]
    assert str(info.value) == ("reward collapsed. The state at the alarm is saved in "
                               f"{tmp_path / 'checkpoints' / 'step-2'}.")
    assert (tmp_path / "checkpoints" / "step-2").is_dir()


def test_a_rollback_starts_a_new_streak_of_nan_skips(tiny_folder, tmp_path):
    """max_nan_skips counts consecutive skipped updates of one set of weights: skips before a rollback belong to
    the weights it abandoned, so they do not bring the restored run nearer to stopping."""
    from stppo_agent.training.trainer import Trainer

    trainer = Trainer(toy_run(tiny_folder, tmp_path, iterations=2, checkpoint=dict(every=1),
                              monitor=dict(on_collapse="none")),
                      report=lambda message: None)
    trainer.train()
    trainer.state.nan_skips_in_a_row, total = 3, trainer.state.nan_skips_total
    trainer.roll_back(1)
    assert trainer.state.nan_skips_in_a_row == 0 and trainer.state.nan_skips_total == total  # the total is history


def test_only_the_main_process_says_the_guards_alarm(tiny_folder, tmp_path, monkeypatch):
    """Every rank reaches the same decision (the monitor reads globally reduced metrics); one line says it, not
    one per process."""
    from stppo_agent.distributed import process_group
    from stppo_agent.monitoring.collapse_guard import Decision
    from stppo_agent.training.trainer import Trainer

    said = {}
    for main in (True, False):
        monkeypatch.setattr(process_group, "is_main", lambda main=main: main)
        reports = said[main] = []
        trainer = Trainer(toy_run(tiny_folder, tmp_path / str(main), iterations=2, checkpoint=dict(every=10),
                                  monitor=dict(on_collapse="none")),
                          report=reports.append)
        scripted_guard(trainer, {2: Decision("warn", "looks odd.")})
        trainer.train()
    assert "looks odd." in said[True] and "looks odd." not in said[False]


def test_the_loop_carries_out_every_decision_of_the_guard(tiny_folder, tmp_path):
    """continue: nothing; warn: say it and checkpoint; rollback to step N: step-N's weights and optimizer state at
    a lowered learning rate, said, logged and checkpointed; stop: checkpoint, then stop."""
    from safetensors.torch import load_file

    from stppo_agent.monitoring.collapse_guard import CollapseStopped, Decision
    from stppo_agent.runs.checkpoint import load_trainer_state
    from stppo_agent.runs.metrics_log import read_metrics
    from stppo_agent.training.trainer import Trainer

    reports = []
    trainer = Trainer(toy_run(tiny_folder, tmp_path, iterations=6, checkpoint=dict(every=10),
                              monitor=dict(on_collapse="none"), optimizer=dict(actor_lr=0.01)),
                      report=reports.append)
    seen = scripted_guard(trainer, {2: Decision("warn", "looks odd."),
                                    3: Decision("rollback", "collapsed.", rollback_to=2),
                                    5: Decision("stop", "collapsed again.")})
    synced = []  # what an engine with its own copy of the weights (vLLM) was handed, as it was then
    sync = trainer.backend.sync_weights

    def sync_weights(actor):
        synced.append((actor, {name: p.detach().clone() for name, p in actor.named_parameters()}))
        sync(actor)

    trainer.backend.sync_weights = sync_weights
    with pytest.raises(CollapseStopped) as info:
        trainer.train()
    assert [actor for actor, _ in synced] == [trainer.state.actor] * 6  # after each of the 5 updates, the rollback
    folder = tmp_path / "checkpoints"
    # the 4th hand-over is the rollback's (iteration 3, after its update's): step-2's weights, not the collapsed ones
    restored = load_file(folder / "step-2" / "actor" / "model.safetensors")
    handed = [weights for _, weights in synced]
    assert restored.keys() <= handed[3].keys() and all(torch.equal(handed[3][k], restored[k]) for k in restored)
    assert not all(torch.equal(handed[2][k], restored[k]) for k in restored)  # the update had moved them
    final = dict(trainer.state.actor.named_parameters())
    assert all(torch.equal(handed[-1][k], final[k]) for k in final)  # the engine ends in step with the actor
    assert str(info.value) == f"collapsed again. The state at the alarm is saved in {folder / 'step-5'}."
    assert seen == [(1, True, 1.0), (2, True, 1.0), (3, True, 1.0), (4, True, 0.5), (5, True, 0.5)]
    assert [m for m in reports if not m.startswith("iteration ")] == ["looks odd.", "collapsed.", "collapsed again."]
    assert sorted(p.name for p in folder.iterdir()) == ["step-2", "step-3", "step-5"]  # each alarm, at once
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5] and trainer.state.iteration == 5
    assert not any("collapse/rollback_to" in r for r in records if r["step"] != 3)
    rolled = records[2]
    assert (rolled["collapse/rollback_to"], rolled["collapse/lr_scale"]) == (2, 0.5)
    assert rolled["collapse/actor_lr"] == pytest.approx(0.005) == trainer.state.actor_scheduler.get_last_lr()[0]
    assert [r["actor_lr"] for r in records] == [pytest.approx(x) for x in (0.01, 0.01, 0.01, 0.005, 0.005)]
    assert trainer.guard.rollbacks == 1 and trainer.state.actor_lr_scale == 0.5
    # step-3 is the state the rollback restored, saved at once: step-2's weights and optimizer moments
    two, three = load_file(folder / "step-2" / "actor" / "model.safetensors"), \
        load_file(folder / "step-3" / "actor" / "model.safetensors")
    assert two.keys() == three.keys() and all(torch.equal(two[k], three[k]) for k in two)
    (two, saved_two), (three, saved_three) = (load_trainer_state(folder / f"step-{n}") for n in (2, 3))
    moments = two["actor_optimizer"]["state"]
    assert moments and all(torch.equal(moments[name][key], three["actor_optimizer"]["state"][name][key])
                           for name in moments for key in ("exp_avg", "exp_avg_sq"))
    assert (saved_two["iteration"], saved_three["iteration"]) == (2, 3)  # iterations keep counting
    assert saved_three["actor_lr_scale"] == 0.5 and saved_two["actor_lr_scale"] == 1.0
    # the collapsed update's steps count: the policy version is not rolled back
    assert saved_three["optimizer_steps"] == saved_two["optimizer_steps"] + trainer.config.optimizer.epochs


def test_train_on_cuda_measures_each_iterations_peak_memory(tiny_folder, tmp_path, monkeypatch):
    """The CUDA-only lines, on a trainer whose device says cuda: this CPU has no device to measure."""
    import stppo_agent.training.trainer as trainer_module
    from stppo_agent.training.trainer import Trainer

    trainer = Trainer(toy_run(tiny_folder, tmp_path, iterations=2, checkpoint=dict(every=10),
                              monitor=dict(on_collapse="none")),
                      report=lambda _: None)
    calls = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: calls.append(("reset", device)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: calls.append(("peak", device)) or 3 * 2**29)
    monkeypatch.setattr(trainer_module, "rollout_statistics",
                        lambda batch, algo: calls.append(("statistics", algo)) or {"reward": 0.5})
    device = SimpleNamespace(type="cuda")
    trainer.device = device
    trainer.rollout = lambda: SimpleNamespace(loss_mask=torch.ones(2, 3), batch_size=2)
    trainer.score = lambda batch, old_from_update=False: None
    trainer.update = lambda batch: {"update_tokens_per_s": 10.0}
    trainer.save = lambda: calls.append("save") or "path"
    metrics = trainer.train()
    assert calls == [("reset", device), ("statistics", trainer.algo), ("peak", device)] * 2 + ["save"]
    assert metrics["gpu_peak_memory_gib"] == 1.5 and trainer.state.iteration == 2


def _section(**values):
    return dataclasses.field(default_factory=lambda: SimpleNamespace(**values))


@dataclasses.dataclass
class FakeConfig:
    output_dir: str = "run"
    device: str = "cpu"
    seed: int = 7
    critic_model: str | None = None
    stage: str = "raw"
    rollout: SimpleNamespace = _section(prompts_per_iteration=4)
    optimizer: SimpleNamespace = _section(mini_batch_size=2)
    distributed: SimpleNamespace = _section(strategy="ddp")
    logging: SimpleNamespace = _section(tensorboard=True, wandb_project="wb", save_rollouts=False,
                                        step_diagnostics=False)
    monitor: SimpleNamespace = _section(on_collapse="none")

    def validate(self):
        CALLS.append(("validate", self.stage))

    def algorithm_config(self):
        return f"algo<{self.stage}>"

    def to_yaml(self, resolved):
        return f"yaml {self.stage} {resolved}"


CALLS: list = []
STATE = linear_state()


@dataclasses.dataclass
class Source:
    """What the stubbed rollout source was built from."""

    name: str
    context: RolloutContext
    env_kwargs: list | None = None


class Logger:
    def __init__(self, run_dir, **kwargs):
        CALLS.append(("logger", run_dir, kwargs))

    def truncate_after(self, iteration, report):
        CALLS.append(("truncate_after", iteration, report))


def _stub(monkeypatch, *, rank=0, world=1, checkpoint=None):
    CALLS.clear()

    def record(name, result=None):
        return lambda *args, **kwargs: CALLS.append((name, args, kwargs)) or result

    monkeypatch.setattr(trainer_module, "resolve_device", lambda d: f"dev<{d}>")
    monkeypatch.setattr(trainer_module, "with_resolved_precision",
                        lambda c, d: dataclasses.replace(c, stage=f"{c.stage}+prec({d})"))
    monkeypatch.setattr(trainer_module, "with_training_split",
                        lambda c, ck, report: dataclasses.replace(c, stage=f"{c.stage}+split({ck},{report.__name__})"))
    monkeypatch.setattr(trainer_module, "process_group", SimpleNamespace(
        ensure_process_group=record("ensure_process_group"), rank=lambda: rank, world_size=lambda: world,
        seed_everything=record("seed"), rank_seed=lambda seed, r: seed * 100 + r, is_main=lambda: rank == 0))
    monkeypatch.setattr(trainer_module, "run_folder",
                        SimpleNamespace(prepare_on_all_ranks=record("prepare", checkpoint)))
    monkeypatch.setattr(trainer_module, "trainer_state", SimpleNamespace(
        checkpoint_config=lambda ck: f"cfg<{ck}>", check_resume_settings=record("check_resume")))
    global STATE
    STATE = linear_state()
    STATE.load = record("load")
    monkeypatch.setattr(trainer_module, "build_state", record("build_state", STATE))
    monkeypatch.setattr(trainer_module, "weights_folder", lambda config, ck: f"weights<{ck}>")
    monkeypatch.setattr(trainer_module, "generation_backend", record("backend", "the backend"))
    monkeypatch.setattr(trainer_module, "PPOUpdate", lambda *args, **kwargs: ("updater", args, kwargs))
    monkeypatch.setattr(trainer_module, "LiveRollouts", lambda context: Source("live", context))
    monkeypatch.setattr(trainer_module, "LearnerProbe", SimpleNamespace(for_run=lambda *args: ("probe", args)))
    monkeypatch.setattr(trainer_module, "MetricsLogger", Logger)
    monkeypatch.setattr(trainer_module, "drop_recordings_after", record("drop"))
    monkeypatch.setattr(trainer_module, "RolloutRecorder", SimpleNamespace(
        for_run=lambda *args, **kwargs: ("recorder", args, kwargs)))
    monkeypatch.setattr(trainer_module, "StepDiagnostics", SimpleNamespace(
        for_run=lambda *args, **kwargs: ("diag", args, kwargs)))
    monkeypatch.setattr(trainer_module, "CollapseGuard", lambda *args: ("guard", args))
    monkeypatch.setattr(trainer_module, "LearningSignalNotice", lambda *args: ("signal", args))


def report(message):
    pass


def _calls(name):
    return [c[1:] for c in CALLS if c[0] == name]


def test_defaults_and_wiring_of_a_new_run(monkeypatch, tmp_path):
    _stub(monkeypatch)
    t = trainer_module.Trainer(FakeConfig(output_dir=str(tmp_path)), report=report)
    assert _calls("prepare") == [((tmp_path,), {"resume": False, "overwrite": False, "report": report})]
    assert t.device == "dev<cpu>" and t.run_dir == tmp_path and t.rank == 0 and t.world == 1
    assert t.config.stage == "raw+prec(dev<cpu>)+split(None,report)" and t.algo == "algo<raw+prec(dev<cpu>)>"
    assert _calls("validate") == [("raw",)]
    assert t.state is STATE and (STATE.iteration, STATE.optimizer_steps, STATE.actor_lr_scale) == (0, 0, 1.0)
    assert t._bar is None and t.sharded is False
    assert t.report is report and t.batch_hook is None
    assert _calls("ensure_process_group") == [] and _calls("seed") == [((7,), {})]
    assert _calls("check_resume") == [((t.config, t.algo, None, report), {})]
    assert _calls("build_state") == [((t.config, t.algo, "dev<cpu>", False, None, report), {})]
    assert _calls("backend") == [((t.config, STATE.stale_policy.model, STATE.tokenizer, 0, "weights<None>"), {})]
    names = [call[0] for call in CALLS]
    assert names.index("check_resume") < names.index("build_state")  # a refused change fails before the models load
    assert t.backend == "the backend"
    assert t.source == Source("live", RolloutContext(t.config, t.algo, tmp_path, STATE.tokenizer, "the backend", 0,
                                                     1, t.phase))
    assert STATE.sampler is t.source and t.probe == ("probe", (t.config, STATE.tokenizer, None))
    assert t.updater == ("updater", (STATE, t.config, t.algo), dict(
        device="dev<cpu>", rank=0, world=1, sharded=False, diagnostics=t.diagnostics, run_dir=tmp_path, report=report,
        phase=t.phase))
    assert t.learning_signal == ("signal", (t.config, t.algo, report, 1, "dev<cpu>"))
    assert _calls("load") == [] and _calls("drop") == []
    config = dataclasses.asdict(t.config)
    assert _calls("logger") == [(tmp_path, {"tensorboard": True, "wandb_project": "wb", "config": config})]
    assert _calls("truncate_after") == [(0, report)]
    assert (tmp_path / "config.yaml").read_text() == f"yaml {t.config.stage} algo<raw+prec(dev<cpu>)>"
    assert t.recorder is None and t.guard is None
    assert t.diagnostics == ("diag", (tmp_path, t.algo), dict(step_diagnostics=False, on_collapse="none",
                                                              sharded=False, iteration=0))


def test_resume_source_recorder_guard_and_sharding(monkeypatch, tmp_path):
    _stub(monkeypatch, checkpoint="CK")
    source = lambda context: Source("mine", context)  # noqa: E731
    config = FakeConfig(output_dir=str(tmp_path), critic_model="critic0")
    config.distributed.strategy, config.logging.save_rollouts, config.monitor.on_collapse = "fsdp2", True, "stop"
    t = trainer_module.Trainer(config, resume=True, overwrite=True, report=report, rollout_source=source)
    assert _calls("prepare")[0][1] == {"resume": True, "overwrite": True, "report": report}
    assert t.sharded is True and len(_calls("ensure_process_group")) == 1
    assert t.config.stage.endswith("+split(cfg<CK>,report)")
    assert _calls("check_resume") == [((t.config, t.algo, "CK", report), {})]
    assert _calls("build_state") == [((t.config, t.algo, "dev<cpu>", True, "CK", report), {})]
    assert _calls("backend")[0][0][-1] == "weights<CK>"
    assert _calls("load") == [(("CK", t.config, t.algo, Restore.RESUME, report), {})]
    names = [call[0] for call in CALLS]
    assert names.index("load") > names.index("backend")  # the sampler's position needs the source built
    assert _calls("drop") == [((tmp_path, 0), {})]
    assert t.source.name == "mine" and t.state.sampler is t.source and t.guard == ("guard", (t.config, tmp_path))
    kind, args, kwargs = t.recorder
    assert (kind, args) == ("recorder", (tmp_path, STATE.tokenizer, 0, 1))
    assert {k: kwargs[k] for k in ("iteration", "actor", "critic", "critic_model")} == dict(
        iteration=0, actor=STATE.actor, critic=None, critic_model="critic0")
    actor_full, critic_full = kwargs["full_states"]()  # gathered, as the run is sharded (None, None unsharded)
    assert set(actor_full) == {"weight", "bias"} and critic_full is None
    assert t.updater[2]["sharded"] is True and t.diagnostics[2]["sharded"] is True


def test_another_rank_reseeds_and_writes_nothing(monkeypatch, tmp_path):
    _stub(monkeypatch, rank=1, world=2, checkpoint="CK")
    t = trainer_module.Trainer(FakeConfig(output_dir=str(tmp_path)), report=report)
    assert _calls("seed") == [((7,), {}), ((701,), {})]
    assert t.logger is None and not (tmp_path / "config.yaml").exists()
    assert _calls("logger") == [] and _calls("drop") == []
    assert _calls("load") == [(("CK", t.config, t.algo, Restore.RESUME, report), {})]
    assert (t.source.context.rank, t.source.context.world) == (1, 2)
    assert t.updater[2]["rank"] == 1 and t.updater[2]["world"] == 2


def test_rank_two_reseeds_too(monkeypatch, tmp_path):
    _stub(monkeypatch, rank=2, world=2)
    trainer_module.Trainer(FakeConfig(output_dir=str(tmp_path)), report=report)
    assert _calls("seed") == [((7,), {}), ((702,), {})]


@pytest.mark.parametrize("prompts,mini", [(3, 2), (4, 3), (3, 3)])
def test_sizes_must_be_multiples_of_the_world(monkeypatch, tmp_path, prompts, mini):
    _stub(monkeypatch, world=2)
    config = FakeConfig(output_dir=str(tmp_path))
    config.rollout.prompts_per_iteration, config.optimizer.mini_batch_size = prompts, mini
    with pytest.raises(ValueError, match=rf"rollout.prompts_per_iteration \({prompts}\) and optimizer.mini_batch_size "
                                         rf"\({mini}\) must be multiples of the number of processes \(2\)"):
        trainer_module.Trainer(config, report=report)
    assert _calls("prepare") == []


def test_print_is_the_default_report(monkeypatch, tmp_path):
    _stub(monkeypatch)
    t = trainer_module.Trainer(FakeConfig(output_dir=str(tmp_path)))
    assert t.report is print and _calls("prepare")[0][1]["report"] is print


def small(model, out, algo="ppo", **overrides):
    values = dict(iterations=1, rollout=dict(prompts_per_iteration=4, samples_per_prompt=2),
                  optimizer=dict(mini_batch_size=4, micro_batch_size=2, epochs=2, actor_lr=1e-2, critic_lr=1e-2),
                  checkpoint=dict(every=1))
    values = merged(values, overrides)
    return toy_config(model, out, algo, **values)


# --- trainer -------------------------------------------------------------------------------------------------

def test_the_critic_takes_optimizer_steps(tiny_model, tmp_path):
    trainer = Trainer(small(tiny_model, tmp_path))
    before = {n: p.detach().clone() for n, p in trainer.state.critic.named_parameters()}
    trainer.train()
    changed = [n for n, p in trainer.state.critic.named_parameters() if not torch.equal(p, before[n])]
    assert "score.weight" in changed and len(changed) > len(before) // 2


def test_the_reference_stays_the_initial_policy_after_resume(tiny_model, tmp_path):
    from safetensors.torch import load_file

    config = small(tiny_model, tmp_path, algo="grpo", iterations=2, algorithm={"kl_loss_coef": 0.1})
    Trainer(config).train()
    initial = load_file(str(tiny_model / "model.safetensors"))
    config.iterations = 3
    resumed = Trainer(config, resume=True)
    trained = load_file(str(tmp_path / "checkpoints" / "step-2" / "actor" / "model.safetensors"))
    reference = resumed.state.reference.state_dict()
    assert all(torch.equal(reference[k], initial[k]) for k in initial)  # not the resumed actor
    assert any(not torch.equal(trained[k], initial[k]) for k in initial)
    actor = resumed.state.actor.state_dict()
    assert all(torch.equal(actor[k], trained[k]) for k in trained)


def test_later_mini_batches_are_off_policy(tiny_model, tmp_path):
    """Old log-probs come from before the update: after the first step the ratios leave 1 and clipping acts."""
    Trainer(small(tiny_model, tmp_path, logging=dict(step_diagnostics=True), optimizer=dict(actor_lr=5e-2))).train()
    record = read_metrics(tmp_path)[0]
    assert record["offpolicy/steps"] == 3 and record["offpolicy/clip_frac"] > 0
    assert record["offpolicy/tail/ratio_max"] > 1.2


def test_training_shows_progress_within_iterations(tiny_model, tmp_path, capsys):
    Trainer(small(tiny_model, tmp_path, logging=dict(progress=True))).train()
    err = capsys.readouterr().err
    for phase in ("rollout turn 1/2", "scoring", "update step 1/4", "update step 4/4"):
        assert phase in err, phase
