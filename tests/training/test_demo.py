"""``stppo_agent.training.demo``: the demo's recipe and settings, the threads it takes
and gives back, and its phases run in order, with the trainer, the warm start and the evaluations replaced by
recorders."""

from __future__ import annotations

import pytest
import torch

from stppo_agent.cli.demo import DEMO_DEFAULTS
from stppo_agent.training import demo
from stppo_agent.training.config_checks import setting
from stppo_agent.training.demo import DemoSettings
from stppo_agent.training.demo_progress import DemoProgress
from tests.support.demo import CountingAgent, Recorder


# -- demo.py -----------------------------------------------------------------------------------------------------
def test_demo_settings_and_constants_are_the_recipes():
    assert DemoSettings() == DemoSettings(model="smollm2", output_dir="runs/demo", iterations=1, sft_steps=8,
                                          limit=8, lr=1.5e-5, on_collapse="warn", seed=0, autocast_dtype="auto")
    with pytest.raises(ValueError, match="autocast_dtype must be one of auto, bfloat16, none, got 'float16'"):
        DemoSettings(autocast_dtype="float16")
    assert demo.DEMO_BENCHMARKS == ("nq", "hotpotqa", "medqa")
    assert (demo.DEMO_MAX_OBSERVATION_TOKENS, demo.DEMO_MAX_TURNS, demo.DEMO_MAX_NEW_TOKENS) == (160, 3, 48)
    assert (demo.DEMO_SFT_BATCH_SIZE, demo.DEMO_SFT_LR, demo.DEMO_SFT_MAX_TOTAL_TOKENS) == (4, 1e-4, 1024)
    assert (demo.DEMO_RL_ENV, demo.DEMO_MAX_RESAMPLE_ROUNDS) == ("stppo/NQ-v0", 4)
    assert demo.EXPECTED_RANGES == {"answer rate before RL": (0.75, 1.0), "reward spread": (0.01, 1.0),
                                    "turn_clip_frac": (0.01, 0.5), "max clip_bias_scale": (1.01, 10.0),
                                    "answer rate after RL": (0.75, 1.0)}


def test_demo_config_is_the_recipe(tmp_path):
    config = demo.demo_config(DemoSettings(iterations=3, lr=2e-5), "the/model", tmp_path)
    expected = dict(algo="st_ppo", env="stppo/NQ-v0", model="the/model",
                    output_dir=str(tmp_path / "train"), env_kwargs={"split": "train", "format_reward": 0.2},
                    algorithm={"dynamic_sampling": True, "max_resample_rounds": 4, "clip_bias_kappa": 0.5},
                    iterations=3, device="auto", seed=0)
    expected.update({"rollout.prompts_per_iteration": 1, "rollout.samples_per_prompt": 8,
                     "optimizer.mini_batch_size": 4, "optimizer.micro_batch_size": 2, "optimizer.epochs": 2,
                     "optimizer.actor_lr": 2e-5, "optimizer.critic_lr": 1e-5, "rollout.max_turns": 3,
                     "rollout.max_new_tokens_per_turn": 48, "rollout.max_observation_tokens": 160,
                     "rollout.max_prompt_tokens": 400, "rollout.max_total_tokens": 768, "checkpoint.every": 3,
                     "checkpoint.keep": 1, "checkpoint.optimizer": "none", "precision.autocast_dtype": "auto",
                     "logging.progress": False, "logging.step_diagnostics": True, "monitor.on_collapse": "warn"})
    assert {key: setting(config, key) for key in expected} == expected
    algo = config.algorithm_config()  # ST-PPO with DAPO's dynamic sampling on top
    assert (algo.name, algo.ratio_level, algo.clip_bias_correction, algo.dynamic_sampling) == ("st_ppo", "turn",
                                                                                               True, True)
    assert algo.clip_bias_kappa == 0.5  # set to the demo's measured ||C||, not the spec's default 1
    seeded = demo.demo_config(DemoSettings(seed=5, autocast_dtype="bfloat16"), "m", tmp_path)
    assert (seeded.seed, seeded.precision.autocast_dtype) == (5, "bfloat16")
    assert demo.demo_config(DemoSettings(autocast_dtype="none"), "m", tmp_path).precision.autocast_dtype is None
    rollback = demo.demo_config(DemoSettings(iterations=3, on_collapse="rollback"), "m", tmp_path)
    assert rollback.checkpoint.every == 1 and rollback.monitor.on_collapse == "rollback"
    assert rollback.checkpoint.optimizer == "all"  # a rollback restores AdamW's state too
    rollback.validate()


def test_demo_trainer_counts_an_iteration_done_at_the_next_iterations_first_phase(monkeypatch):
    from stppo_agent.training.trainer import Trainer

    made, phases = [], []
    monkeypatch.setattr(Trainer, "__init__", lambda self, config, report, overwrite: made.append(
        (config, report, overwrite)))
    monkeypatch.setattr(Trainer, "phase", lambda self, text: phases.append(text))
    progress = Recorder()
    trainer = demo.DemoTrainer("config", progress)
    assert made == [("config", progress.say, True)] and trainer.progress is progress
    from tests.support.training_states import linear_state

    trainer.state = linear_state()
    trainer.phase("rollout")
    trainer.state.iteration = 1
    trainer.phase("rollout")
    trainer.phase("scoring")
    assert phases == ["rollout", "rollout", "scoring"]
    assert progress.calls == [("note", "rollout"), ("step", 1, "rollout"), ("note", "scoring")]


def test_demo_trainer_keeps_every_scored_trajectorys_reward(monkeypatch):
    from types import SimpleNamespace

    from stppo_agent.training.trainer import Trainer

    scored = []
    monkeypatch.setattr(Trainer, "__init__", lambda self, config, report, overwrite: None)
    monkeypatch.setattr(Trainer, "score", lambda self, batch, old_from_update=False: scored.append(batch))
    trainer = demo.DemoTrainer("config", Recorder())
    assert trainer.rewards == []
    first, second = SimpleNamespace(rewards=torch.tensor([1.0, 0.2])), SimpleNamespace(rewards=torch.tensor([0.0]))
    trainer.score(first)
    trainer.score(second)
    assert scored == [first, second] and trainer.rewards == pytest.approx([1.0, 0.2, 0.0])


def test_demo_evaluation_runs_each_benchmark_with_the_demo_settings(monkeypatch, tmp_path):
    from stppo_agent.evaluation import agent_specs, evaluate, hf_agent, results

    made, runs, written = [], [], []
    monkeypatch.setattr(agent_specs, "resolve_agent_spec", lambda spec: ("hf:/ckpt/actor", f"{spec} -> newest"))
    def agent(path, max_new_tokens, max_observation_tokens):
        made.append((path, max_new_tokens, max_observation_tokens))
        inner = CountingAgent()
        inner.max_observation_tokens = max_observation_tokens
        return inner

    monkeypatch.setattr(hf_agent, "HFAgent", agent)
    from stppo_agent.evaluation.agents import EpisodeView

    def evaluate_benchmark(spec, settings, agent_factory):
        runs.append((spec, settings, agent_factory()))
        agent_factory().act([EpisodeView("q", "q", None, (), 0)])  # the display hears of each turn
        return {"benchmark": settings.benchmark}

    monkeypatch.setattr(evaluate, "evaluate_benchmark", evaluate_benchmark)
    monkeypatch.setattr(results, "write_results", lambda res, out: written.append((res, out)))
    progress = Recorder()
    got = demo.evaluate_demo("hf:run@latest", DemoSettings(limit=5), progress, tmp_path / "eval", "evaluation X")
    assert got == [{"benchmark": b} for b in ("nq", "hotpotqa", "medqa")] and written == [(got, tmp_path / "eval")]
    assert made == [("/ckpt/actor", 48, 160)]  # observations cut as in training
    assert progress.calls[:2] == [("phase", "evaluation X", 3), ("say", "agent hf:run@latest -> newest")]
    assert ("note", "nq: turn 1/3 of 1 episodes") in progress.calls
    assert [c for c in progress.calls if c[0] == "step"] == [
        ("step", 0, "nq: loading"), ("step", 1, "hotpotqa: loading"), ("step", 2, "medqa: loading")]
    assert [spec for spec, _, _ in runs] == ["hf:/ckpt/actor"] * 3
    assert {id(agent) for _, _, agent in runs} == {id(runs[0][2])} and runs[0][2].max_turns == 3
    assert runs[0][2].max_observation_tokens == 160  # what the results record the agent read
    assert runs[0][2].benchmark == "medqa"  # the one agent, told each benchmark in turn
    from stppo_agent.evaluation.evaluate import EvalSettings

    assert [settings for _, settings, _ in runs] == [EvalSettings(
        b, None, None, 5, "demo", 3, 3, 16, 0, 48, 160) for b in ("nq", "hotpotqa", "medqa")]
    monkeypatch.setattr(agent_specs, "resolve_agent_spec", lambda spec: (spec, None))
    quiet = Recorder()
    demo.evaluate_demo("hf:/m", DemoSettings(), quiet, tmp_path / "e2", "e")
    assert not [c for c in quiet.calls if c[0] == "say"] and made[-1] == ("/m", 48, 160)


def test_demo_cpu_threads_leave_a_core_to_each_other_process():
    assert demo.cpu_threads(4, 0.5, None) == 4 and demo.cpu_threads(4, 0.51, None) == 3
    assert demo.cpu_threads(4, 1.5, None) == 3 and demo.cpu_threads(4, 1.6, None) == 2
    assert demo.cpu_threads(2, 9.0, None) == 1 and demo.cpu_threads(2, 9.0, "3") == 3
    assert demo.cpu_threads(2, 0.0, "0") == 1 and demo.cpu_threads(3, 0.0, "") == 3


def test_demo_other_running_processes_averages_samples_and_sleeps_between_them(monkeypatch, tmp_path):
    import builtins
    import time

    values = iter([3, 6, 2])
    real_open = builtins.open
    stat = tmp_path / "stat"

    def fake_open(path, *args, **kwargs):
        if path == "/proc/stat":
            stat.write_text(f"cpu 1\nprocs_running {next(values)}\nprocs_blocked 9\n")
            return real_open(stat, *args, **kwargs)
        return real_open(path, *args, **kwargs)

    sleeps = []
    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(time, "sleep", sleeps.append)
    assert demo.other_running_processes(samples=3, interval_s=0.25) == pytest.approx((2 + 5 + 1) / 3)
    assert sleeps == [0.25, 0.25]
    sleeps.clear()
    values = iter([4] * 5)
    assert demo.other_running_processes() == 3.0 and sleeps == [0.1] * 4
    monkeypatch.setattr(builtins, "open", lambda *a, **k: (_ for _ in ()).throw(OSError("no /proc")))
    assert demo.other_running_processes() == 0.0


def test_demo_run_sets_the_threads_checks_the_model_and_restores_them(monkeypatch):
    from stppo_agent.plugins import name_checks

    checked, seen = [], []
    monkeypatch.setattr(name_checks, "check_model", checked.append)
    monkeypatch.setattr(demo, "other_running_processes", lambda: 1.2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(demo, "_run_demo", lambda settings, progress, out, busy: seen.append(
        (settings, type(progress), out, busy, torch.get_num_threads())) or {"f": 1.0})
    previous = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        settings = DemoSettings(model="m", output_dir="somewhere/demo")
        assert demo.run_demo(settings) == {"f": 1.0}
        assert checked == ["m"]
        from pathlib import Path

        assert seen == [(settings, DemoProgress, Path("somewhere/demo"),
                         "; 2 of 3 CPU threads: 1.2 other processes running", 2)]
        assert torch.get_num_threads() == 3
        monkeypatch.setattr(demo, "other_running_processes", lambda: 0.0)
        mine = Recorder()
        demo.run_demo(settings, mine)
        assert seen[-1][1:] == (Recorder, Path("somewhere/demo"), "", 3)
        monkeypatch.setenv("OMP_NUM_THREADS", "1")  # set by the user: it decides
        demo.run_demo(settings)
        assert seen[-1][3:] == ("; 1 of 3 CPU threads: 0.0 other processes running", 1)
        monkeypatch.setattr(demo, "_run_demo", lambda *a: (_ for _ in ()).throw(RuntimeError("x")))
        with pytest.raises(RuntimeError):
            demo.run_demo(settings)
        assert torch.get_num_threads() == 3  # given back even when the demo fails
    finally:
        torch.set_num_threads(previous)


def fake_phases(monkeypatch, tmp_path, metrics_reward=0.5):
    """Every heavy phase of the demo replaced by a recorder; returns the record of calls."""
    from stppo_agent.models import default_model

    calls = []
    monkeypatch.setattr(default_model, "resolve_model", lambda name: calls.append(("resolve", name)) or "/cache/m")
    monkeypatch.setattr(demo, "warm_start", lambda settings, model, out, progress: calls.append(
        ("warm_start", model, out, settings, progress)) or "/out/sft")

    def evaluate(spec, settings, progress, out, name):
        calls.append(("evaluate", spec, out, name, settings, progress))
        return [{"benchmark": "nq", "metrics": {"n": 2, "em": 0.5, "answer_rate": 1.0, "invalid_action_rate": 0.0,
                                                 "mean_search_calls": 1.0}}]

    class Trainer:
        def __init__(self, config, progress):
            calls.append(("trainer", config.model, config.output_dir, config.iterations, progress))
            self.rewards = [1.0, 0.2]

        def train(self):
            calls.append(("train",))
            return {"reward": metrics_reward}

    monkeypatch.setattr(demo, "evaluate_demo", evaluate)
    monkeypatch.setattr(demo, "DemoTrainer", Trainer)
    monkeypatch.setattr(demo, "off_policy_means", lambda run: calls.append(("means", run)) or {
        "turn_clip_frac": 0.1, "clip_bias_scale_max": 2.0})
    monkeypatch.setattr(demo, "off_policy_summary", lambda means, rewards, resampled: f"summary {sorted(means)} "
                        f"{rewards} {resampled}")
    return calls


def test_demo_run_warm_starts_evaluates_trains_and_evaluates_again(monkeypatch, tmp_path):
    from stppo_agent.models import precision

    # a CPU without AMX, whatever this machine is: autocast_dtype=auto then means float32 forwards
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(precision, "cpu_has_amx_bf16", lambda: False)
    calls = fake_phases(monkeypatch, tmp_path)
    progress = Recorder()
    out = tmp_path / "d"
    settings = DemoSettings(model="smol", sft_steps=3, iterations=2, limit=4)
    figures = demo._run_demo(settings, progress, out, "; busy")
    assert calls == [("resolve", "smol"), ("warm_start", "/cache/m", out, settings, progress),
                     ("evaluate", "hf:/out/sft", out / "eval_before", "evaluation before RL", settings, progress),
                     ("trainer", "/out/sft", str(out / "train"), 2, progress), ("train",), ("means", out / "train"),
                     ("evaluate", f"hf:{out / 'train'}@latest", out / "eval", "evaluation after RL", settings,
                      progress)]
    said = [c[1] for c in progress.calls if c[0] == "say"]
    assert said[0] == ("stppo demo: 3 warm-start steps, then 2 iteration(s) of ST-PPO (seed 0, float32 forwards) on "
                       "smol with the bundled demo set (BM25, on a GPU when there is one, else the CPU; busy), "
                       "evaluated on 4 test questions per benchmark before and after RL")
    assert said[1] == "summary ['clip_bias_scale_max', 'turn_clip_frac'] [1.0, 0.2] 0.0"
    assert said[2].startswith("evaluation: before RL (after the warm start) -> after RL")
    assert said[3].startswith("check: ") and "answer rate before RL 1.000" in said[3]
    assert said[4] == f"run folder: {out / 'train'}; evaluation: {out / 'eval_before'} (before RL), {out / 'eval'} " \
                      "(after)"
    assert ("phase", "ST-PPO iteration", 2) in progress.calls
    assert figures == pytest.approx({"answer rate before RL": 1.0, "answer rate after RL": 1.0, "turn_clip_frac": 0.1,
                                     "max clip_bias_scale": 2.0, "reward spread": 0.8, "reward": 0.6})
    assert not progress._drawn and progress._thread is not None and not progress._thread.is_alive()


def test_demo_run_without_a_warm_start_evaluates_only_after(monkeypatch, tmp_path):
    calls = fake_phases(monkeypatch, tmp_path)
    progress = Recorder()
    out = tmp_path / "d"
    figures = demo._run_demo(DemoSettings(sft_steps=0), progress, out, "")
    assert [c[0] for c in calls] == ["resolve", "trainer", "train", "means", "evaluate"]
    assert calls[1][1] == "/cache/m"
    said = [c[1] for c in progress.calls if c[0] == "say"]
    assert "else the CPU)," in said[0] and said[0].startswith("stppo demo: 0 warm-start steps, then 1 iteration(s) "
                                                             "of ST-PPO (seed 0, ")
    assert said[2].startswith("evaluation after RL") and said[-1] == f"run folder: {out / 'train'}; evaluation: " \
                                                                     f"{out / 'eval'}"
    assert "answer rate before RL" not in figures
    calls.clear()
    demo._run_demo(DemoSettings(sft_steps=1), Recorder(), out, "")  # one warm-start step is a warm start
    assert [c[0] for c in calls] == ["resolve", "warm_start", "evaluate", "trainer", "train", "means", "evaluate"]


def test_demo_warm_start_hands_the_recipe_to_the_supervised_trainer(monkeypatch, tmp_path):
    from stppo_agent.training import sft

    seen = {}

    def train_sft(config, report, on_step):
        seen.update(config=config, report=report)
        on_step(0, 8, float("nan"))
        on_step(1, 8, 1.23456)
        on_step(2, 8, 0.5)
        return {"demonstrations": 11, "first_loss": 2.345, "last_loss": 0.5}

    monkeypatch.setattr(sft, "train_sft", train_sft)
    progress = Recorder()
    assert demo.warm_start(DemoSettings(sft_steps=8), "/m", tmp_path, progress) == str(tmp_path / "sft")
    config = seen["config"]
    assert (config.model, config.output_dir, tuple(config.benchmarks), config.limit, config.steps) == (
        "/m", str(tmp_path / "sft"), ("nq", "hotpotqa", "medqa"), 11, 8)  # ceil(8 steps x 4 / 3 benchmarks)
    assert (config.batch_size, config.lr, config.max_observation_tokens, config.max_total_tokens, config.progress) == (
        4, 1e-4, 160, 1024, False)
    assert config.seed == 0 and config.autocast_dtype is None  # the warm start runs in float32 everywhere
    assert seen["report"] == progress.note
    assert progress.calls == [("phase", "warm start: the gold-search teacher's demonstrations", 0),
                              ("phase", "warm start", 8), ("step", 1, "loss 1.235"), ("step", 2, "loss 0.500"),
                              ("say", "warm start: 11 demonstrations, loss 2.35 -> 0.50 in 8 steps")]
    demo.warm_start(DemoSettings(sft_steps=6, seed=4), "/m", tmp_path, Recorder())
    assert seen["config"].limit == 8 and seen["config"].steps == 6  # ceil(6 x 4 / 3) = 8: exactly, not 9
    assert seen["config"].seed == 4


# The command line's defaults, and the cores the demo takes and gives back.


def test_the_command_line_defaults_are_the_recipes():
    settings = DemoSettings()
    assert DEMO_DEFAULTS == {"iterations": settings.iterations, "sft_steps": settings.sft_steps,
                             "limit": settings.limit, "lr": settings.lr, "seed": settings.seed,
                             "autocast_dtype": settings.autocast_dtype}


def test_the_demo_leaves_a_core_to_each_other_running_process():
    from stppo_agent.training.demo import cpu_threads

    assert cpu_threads(cores=2, others=0.0, requested=None) == 2  # an idle machine: torch's default
    assert cpu_threads(cores=2, others=0.4, requested=None) == 2  # a blip of another process is not load
    assert cpu_threads(cores=2, others=1.0, requested=None) == 1
    assert cpu_threads(cores=2, others=6.8, requested=None) == 1  # never below one
    assert cpu_threads(cores=8, others=2.6, requested=None) == 5
    assert cpu_threads(cores=2, others=6.8, requested="2") == 2  # OMP_NUM_THREADS decides when set


def test_other_running_processes_reads_procs_running(monkeypatch, tmp_path):
    import builtins

    from stppo_agent.training import demo

    stat = tmp_path / "stat"
    stat.write_text("cpu  1 2 3\nprocs_running 4\nprocs_blocked 0\n")
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: real_open(stat if path == "/proc/stat" else path,
                                                                           *a, **k))
    assert demo.other_running_processes(samples=2, interval_s=0.0) == 3.0  # this process is one of the 4
    stat.write_text("cpu  1 2 3\n")
    assert demo.other_running_processes(samples=2, interval_s=0.0) == 0.0


def test_the_demo_runs_on_the_free_cores_and_gives_the_threads_back(monkeypatch):
    import torch

    from stppo_agent.training import demo

    seen = []
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(demo, "other_running_processes", lambda: 3.0)
    monkeypatch.setattr(demo, "_run_demo", lambda settings, progress, out, busy: seen.append(
        (torch.get_num_threads(), busy)) or {})
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        demo.run_demo(DemoSettings(model="tiny"))
        assert seen == [(1, "; 1 of 2 CPU threads: 3.0 other processes running")]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(previous)
