"""Pins of the per-step diagnostics (issue 27): the values of one optimizer step on a hand-made batch, and of
`stppo demo`'s recipe and display with the trainer, the warm start and the evaluations replaced by recorders (the
real demo, minutes on SmolLM2, runs in tests/test_sft.py). Test names start with the module they pin (the
mutation loop selects by that prefix)."""

from __future__ import annotations

import io
import json
import math
from types import SimpleNamespace

import pytest
import torch

from stppo_agent.monitoring import step_diagnostics
from stppo_agent.monitoring.step_diagnostics import OFF_POLICY_KEYS, StepDiagnostics, StepMeans
from stppo_agent.training import demo
from stppo_agent.training.config_checks import setting
from stppo_agent.training.demo import DemoSettings
from stppo_agent.training.demo_progress import DemoProgress, clock_text

LOW, HIGH = math.log(1 - 0.2), math.log1p(0.28)


def micro(log_ratios, mask, turns):
    """A micro-batch whose old log-probs are 0, so ``logprobs`` are the log ratios; positions off the mask hold
    a huge ratio that must never count."""
    mask = torch.tensor(mask)
    logprobs = torch.where(mask, torch.tensor(log_ratios, dtype=torch.float32), torch.tensor(9.0))
    batch = SimpleNamespace(loss_mask=mask, old_logprobs=torch.zeros(mask.shape), turn_ids=torch.tensor(turns))
    return batch, logprobs


def first_micro():
    return micro([[0.0, 0.1, 0.3, -0.5], [0.0, LOW, HIGH, 0.0]],
                 [[False, True, True, True], [False, True, True, False]], [[0, 0, 0, 1], [0, 0, 1, 1]])


# -- step_diagnostics.py -----------------------------------------------------------------------------------------
def test_step_diagnostics_ratio_tails_and_outside_shares_of_one_step(tmp_path):
    diagnostics = StepDiagnostics(tmp_path / "steps.jsonl", clip_low=0.2, clip_high=0.28, gradients=False)
    diagnostics.begin_iteration(3)
    diagnostics.observe_micro(*first_micro())
    diagnostics.observe_micro(*micro([[0.0, -0.05]], [[True, True]], [[0, 0]]))
    metrics = {"clip_frac": 0.5, "turn_clip_frac": 0.25, "clip_bias_norm": 1.5, "clip_bias_scale": 2.0,
               "grad_norm": 3.0, "pg_grad_norm": 4.0, "loss": 9.0}
    out = diagnostics.finish_step([], metrics, optimizer_steps=6)
    tokens = torch.tensor([0.1, 0.3, -0.5, LOW, HIGH, 0.0, -0.05])
    turns = torch.tensor([0.2, -0.5, LOW, HIGH, -0.025])  # per (row, turn) means, row-major
    assert out["tail/ratio_max"] == pytest.approx(math.exp(0.3)) and out["tail/ratio_min"] == pytest.approx(
        math.exp(-0.5))
    assert out["tail/ratio_p99"] == pytest.approx(math.exp(float(torch.quantile(tokens.double(), 0.99))), rel=1e-6)
    assert out["tail/turn_ratio_max"] == pytest.approx(math.exp(HIGH), rel=1e-6)
    assert out["tail/turn_ratio_min"] == pytest.approx(math.exp(-0.5))
    assert out["tail/turn_ratio_p99"] == pytest.approx(math.exp(float(torch.quantile(turns.double(), 0.99))),
                                                       rel=1e-6)
    # 0.3 and -0.5 are outside [log 0.8, log 1.28]; the two ratios exactly on the bounds are not
    assert out["tail/token_outside_frac"] == pytest.approx(2 / 7)
    assert out["tail/turn_outside_frac"] == pytest.approx(1 / 5)  # -0.5; 0.2 is inside [-0.223, 0.247]
    assert "grad_cos_to_first" not in out and len(out) == 8
    record = json.loads((tmp_path / "steps.jsonl").read_text())
    assert (record["iteration"], record["step"], record["minibatch"], record["on_policy"]) == (3, 7, 0, True)
    assert {k: record[k] for k in metrics if k in record} == {k: v for k, v in metrics.items() if k != "loss"}
    assert record["ratio_max"] == pytest.approx(math.exp(0.3)) and "tail/ratio_max" not in record
    again = diagnostics.finish_step([], {}, optimizer_steps=7)  # nothing observed since: no tails
    assert again == {}
    second = json.loads((tmp_path / "steps.jsonl").read_text().splitlines()[1])
    assert second == {"iteration": 3, "step": 8, "minibatch": 1, "on_policy": False}


def test_step_diagnostics_a_clip_low_of_one_has_no_lower_bound():
    diagnostics = StepDiagnostics(None, clip_low=1.0, clip_high=0.2, gradients=False)
    assert diagnostics.log_low == -math.inf and diagnostics.log_high == pytest.approx(math.log(1.2))
    diagnostics.observe_micro(*micro([[-5.0, 0.0, 0.18]], [[True, True, True]], [[0, 1, 2]]))
    out = diagnostics.finish_step([], {}, 0)
    assert out["tail/token_outside_frac"] == 0.0 and out["tail/turn_outside_frac"] == 0.0
    narrow = StepDiagnostics(None, clip_low=0.1, clip_high=0.1, gradients=False)
    assert narrow.log_low == pytest.approx(math.log(0.9))
    narrow.observe_micro(*micro([[-0.2, 0.0, 0.19]], [[True, True, True]], [[0, 1, 2]]))
    assert narrow.finish_step([], {}, 0)["tail/token_outside_frac"] == pytest.approx(2 / 3)


def test_step_diagnostics_gradient_cosine_to_the_iterations_first_step():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    diagnostics = StepDiagnostics(None)
    diagnostics.begin_iteration(1)
    a.grad = torch.tensor([2.0, 0.0])  # b has no gradient: zeros of its size
    assert diagnostics.finish_step([a, b], {}, 0) == {"grad_cos_to_first": 1.0}
    a.grad, b.grad = torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0, 1.0])
    assert diagnostics.finish_step([a, b], {}, 1)["grad_cos_to_first"] == pytest.approx(1 / math.sqrt(3))
    a.grad = torch.tensor([-1.0, 0.0])
    assert diagnostics.finish_step([a, b], {}, 2)["grad_cos_to_first"] == pytest.approx(-1 / math.sqrt(2))
    a.grad, b.grad = torch.zeros(2), None
    assert diagnostics.finish_step([a, b], {}, 3)["grad_cos_to_first"] == 0.0  # a zero gradient: no direction
    diagnostics.begin_iteration(2)  # a new iteration: a new reference
    a.grad = torch.tensor([0.0, 3.0])
    assert diagnostics.finish_step([a, b], {}, 4)["grad_cos_to_first"] == 1.0
    assert diagnostics.minibatch == 1 and diagnostics.iteration == 2


def test_step_diagnostics_small_and_zero_gradients():
    a = torch.nn.Parameter(torch.zeros(2))
    diagnostics = StepDiagnostics(None)
    a.grad = torch.zeros(2)  # a zero first gradient: nothing to compare with
    assert diagnostics.finish_step([a], {}, 0)["grad_cos_to_first"] == 0.0
    a.grad = torch.tensor([0.5, 0.0])
    assert diagnostics.finish_step([a], {}, 1)["grad_cos_to_first"] == 0.0
    small = StepDiagnostics(None)
    a.grad = torch.tensor([0.3, 0.4])  # norms below 1 are directions too
    assert small.finish_step([a], {}, 0)["grad_cos_to_first"] == pytest.approx(1.0)
    a.grad = torch.tensor([0.4, -0.3])
    assert small.finish_step([a], {}, 1)["grad_cos_to_first"] == pytest.approx(0.0, abs=1e-12)
    a.grad = torch.tensor([0.0, 0.5])
    assert small.finish_step([a], {}, 2)["grad_cos_to_first"] == pytest.approx(0.8)


def test_step_diagnostics_sharded_gradients_sum_the_products_over_ranks(monkeypatch):
    from stppo_agent.distributed import process_group

    reduced = []

    def all_reduce_sum(sums):  # the other rank's shard: gradient (0, 1) now, (0, 1) first
        reduced.append(sums.tolist())
        return sums + torch.tensor([1.0, 1.0, 1.0], dtype=sums.dtype)

    monkeypatch.setattr(process_group, "all_reduce_sum", all_reduce_sum)
    a = torch.nn.Parameter(torch.zeros(1))
    sharded = StepDiagnostics(None, sharded=True)
    a.grad = torch.tensor([1.0])
    assert sharded.finish_step([a], {}, 0)["grad_cos_to_first"] == pytest.approx(1.0)
    a.grad = torch.tensor([-1.0])
    assert sharded.finish_step([a], {}, 1)["grad_cos_to_first"] == pytest.approx(0.0)  # (-1, 1) . (1, 1)
    assert reduced == [[1.0, 1.0, 1.0], [-1.0, 1.0, 1.0]]
    reduced.clear()
    a.grad = torch.tensor([1.0])
    StepDiagnostics(None).finish_step([a], {}, 0)  # not sharded (the default): no collective
    assert reduced == []


def test_step_diagnostics_defaults(tmp_path):
    fresh = StepDiagnostics(None)
    assert (fresh.log_low, fresh.log_high) == (pytest.approx(math.log(0.8)), pytest.approx(math.log(1.2)))
    assert not fresh.sharded and fresh.gradients and fresh.reference is None
    path = tmp_path / "steps.jsonl"
    path.write_text('{"iteration": 0}\n{"iteration": 1}\n')
    fresh = StepDiagnostics(path, gradients=False)  # a new run (start_iteration 0) keeps nothing after 0
    assert path.read_text() == '{"iteration": 0}\n'
    fresh.finish_step([], {}, 0)
    assert json.loads(path.read_text().splitlines()[-1]) == {"iteration": 0, "step": 1, "minibatch": 0,
                                                             "on_policy": True}


def test_step_diagnostics_gathers_every_ranks_ratios(monkeypatch):
    from stppo_agent.distributed import process_group

    other = [torch.tensor([0.5, -0.7]), torch.tensor([0.5])]
    monkeypatch.setattr(process_group, "world_size", lambda: 2)
    monkeypatch.setattr(process_group, "all_gather_objects", lambda local: [local, other])
    diagnostics = StepDiagnostics(None, gradients=False)
    diagnostics.observe_micro(*micro([[0.1]], [[True]], [[0]]))
    out = diagnostics.finish_step([], {}, 0)
    assert out["tail/ratio_max"] == pytest.approx(math.exp(0.5)) and out["tail/ratio_min"] == pytest.approx(
        math.exp(-0.7))
    assert out["tail/turn_ratio_min"] == pytest.approx(math.exp(0.1)) and out["tail/turn_outside_frac"] == 0.5


def test_step_diagnostics_on_resume_drops_the_steps_of_redone_iterations(tmp_path):
    path = tmp_path / "steps.jsonl"
    lines = [{"iteration": 1, "step": 1}, {"iteration": 2, "step": 2}, {"iteration": 3, "step": 3}]
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n\n" + '{"iteration": 1, "st')
    StepDiagnostics(path, start_iteration=2)
    assert [json.loads(x) for x in path.read_text().splitlines()] == lines[:2]  # the torn line goes too
    assert path.read_text().endswith("}\n")
    StepDiagnostics(path, start_iteration=0)
    assert path.read_text() == ""
    assert not (tmp_path / "new.jsonl").exists() and StepDiagnostics(tmp_path / "new.jsonl").path.name == "new.jsonl"
    assert step_diagnostics._iteration_of('{"step": 1}') == 0 and step_diagnostics._iteration_of('{"st') == 1 << 62
    assert step_diagnostics._iteration_of('{"iteration": null}') == step_diagnostics._iteration_of(
        '{"iteration": "x"}') == 1 << 62 and step_diagnostics._iteration_of('{"iteration": 7}') == 7
    # a line that is JSON but not an object (a hand edit) is dropped like a torn one, not a crash of the resume
    assert step_diagnostics._iteration_of("[1]") == step_diagnostics._iteration_of("7") == 1 << 62


def test_step_diagnostics_for_a_run_follow_its_config(tmp_path):
    from stppo_agent.algorithms import AlgorithmConfig

    algo = AlgorithmConfig(clip_low=0.1, clip_high=0.3)

    def diagnostics(diagnose, on_collapse):
        return StepDiagnostics.for_run(tmp_path, algo, step_diagnostics=diagnose, on_collapse=on_collapse,
                                       sharded=True, iteration=4)

    assert diagnostics(False, "none") is None
    full = diagnostics(True, "none")
    assert full.path == tmp_path / "steps.jsonl" and full.gradients and full.sharded
    assert (full.log_low, full.log_high) == (pytest.approx(math.log(0.9)), pytest.approx(math.log(1.3)))
    tails = diagnostics(False, "warn")
    assert tails.path is None and not tails.gradients


def test_step_diagnostics_resume_keeps_the_start_iterations_steps(tmp_path):
    from stppo_agent.algorithms import AlgorithmConfig

    path = tmp_path / "steps.jsonl"
    path.write_text('{"iteration": 4}\n{"iteration": 5}\n')
    StepDiagnostics.for_run(tmp_path, AlgorithmConfig(clip_low=0.2, clip_high=0.2), step_diagnostics=True,
                            on_collapse="none", iteration=4)
    assert path.read_text() == '{"iteration": 4}\n'


def test_step_diagnostics_step_means_count_off_policy_steps_apart():
    means = StepMeans()
    means.add({"clip_frac": 0.0, "grad_norm": 1.0}, on_policy=True)
    means.add({"clip_frac": 0.2, "grad_norm": 3.0, "tail/ratio_max": 2.0}, on_policy=False)
    means.add({"clip_frac": 0.4, "grad_norm": 5.0}, on_policy=False)
    assert means.means() == pytest.approx({"clip_frac": 0.2, "grad_norm": 3.0, "tail/ratio_max": 2.0,
                                           "offpolicy/clip_frac": 0.3, "offpolicy/tail/ratio_max": 2.0,
                                           "offpolicy/steps": 2.0})
    only_on = StepMeans()
    only_on.add({"clip_frac": 0.1}, on_policy=True)
    assert only_on.means() == {"clip_frac": 0.1}
    assert "grad_norm" not in OFF_POLICY_KEYS and {"clip_bias_scale", "tail/turn_outside_frac"} <= set(OFF_POLICY_KEYS)
    assert {"dual_clip_frac", "ratio/ess", "clip_bias_changed"} <= set(OFF_POLICY_KEYS)
    assert len(OFF_POLICY_KEYS) == 14


# -- demo_progress.py --------------------------------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.now = 50.0

    def __call__(self):
        return self.now


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_demo_progress_clock_text_rounds_to_seconds():
    assert [clock_text(s) for s in (-3, 0, 0.4, 0.6, 59, 61, 600, 3599.6)] == [
        "0:00", "0:00", "0:00", "0:01", "0:59", "1:01", "10:00", "60:00"]


def test_demo_progress_defaults(monkeypatch, capsys):
    progress = DemoProgress(stream=Terminal())
    assert progress.interactive and (progress.refresh_s, progress.line_s) == (2.0, 30.0)
    assert (progress.name, progress.detail, progress.done, progress.total) == ("starting", "", 0, 0)
    assert DemoProgress(stream=Terminal(), interactive=False).interactive is False
    assert DemoProgress(stream=io.StringIO(), interactive=True).interactive is True
    progress.say("result")
    assert capsys.readouterr().out == "result\n"
    import builtins

    printed = []
    monkeypatch.setattr(builtins, "print", lambda *args, **kwargs: printed.append((args, kwargs)))
    DemoProgress(stream=Terminal()).say("piped")
    assert printed == [(("piped",), {"flush": True})]  # stdout to a pipe is block-buffered
    monkeypatch.undo()
    import sys

    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    DemoProgress(interactive=False).phase("p")
    assert err.getvalue() == "[0:00] p (0:00 in this phase)\n"


def test_demo_progress_status_line_and_time_left():
    clock = Clock()
    progress = DemoProgress(stream=io.StringIO(), out=lambda _: None, clock=clock)
    clock.now += 65
    assert progress.status() == "[1:05] starting (1:05 in this phase)"
    progress.phase("warm start", total=5)
    clock.now += 20
    progress.step(2, "loss 1.000")
    clock.now += 7
    # 2 steps in 20 s: 10 s a step, 3 left -- measured to the last step's end, not to now
    assert progress.status() == "[1:32] warm start 2/5 -- loss 1.000 (0:27 in this phase, about 0:30 left)"
    progress.note("turn 2")
    assert progress.status().endswith("-- turn 2 (0:27 in this phase, about 0:30 left)") and progress.done == 2
    progress.phase("eval")
    assert progress.status() == "[1:32] eval (0:00 in this phase)"
    progress.step(3)
    assert progress.status() == "[1:32] eval (0:00 in this phase)"  # no total: no count and no estimate


def test_demo_progress_a_log_gets_a_line_at_each_phase_and_once_a_line_interval():
    clock, stream, said = Clock(), io.StringIO(), []
    progress = DemoProgress(stream=stream, out=said.append, line_s=10.0, clock=clock)
    progress.phase("a", total=2)
    clock.now += 9.9
    progress.tick()
    assert stream.getvalue() == "[0:00] a 0/2 (0:00 in this phase)\n"
    clock.now += 0.1
    progress.tick()  # exactly one interval since the last line
    assert stream.getvalue().splitlines()[-1] == "[0:10] a 0/2 (0:10 in this phase)"
    clock.now += 5
    progress.say("half")  # a result line restarts the interval
    clock.now += 9
    progress.tick()
    assert len(stream.getvalue().splitlines()) == 2 and said == ["half"]
    clock.now += 1
    progress.tick()
    assert len(stream.getvalue().splitlines()) == 3 and "\r" not in stream.getvalue()


def test_demo_progress_a_terminal_redraws_in_place_and_is_cleared_once_before_results():
    clock, stream = Clock(), Terminal()
    seen = []
    progress = DemoProgress(stream=stream, out=lambda text: seen.append(stream.getvalue()), clock=clock)
    progress.tick()
    assert stream.getvalue() == "\r\x1b[K[0:00] starting (0:00 in this phase)"
    progress.say("x")
    progress.say("y")  # nothing drawn since: nothing to clear
    assert seen == ["\r\x1b[K[0:00] starting (0:00 in this phase)\r\x1b[K"] * 2
    with progress:
        pass
    assert stream.getvalue().count("\r\x1b[K") == 2  # the exit clears only a drawn line


def test_demo_progress_the_thread_redraws_every_refresh_and_stops_and_clears_at_the_end():
    stream = Terminal()
    ticks = []
    progress = DemoProgress(stream=stream, out=lambda _: None, refresh_s=0.02)
    progress.tick = lambda: ticks.append(1) or DemoProgress.tick(progress)
    import time

    started = time.monotonic()
    with progress:
        assert progress._thread.daemon and progress._thread.name == "stppo-demo-progress"
        time.sleep(0.3)
    elapsed = time.monotonic() - started
    # one tick per refresh_s: never more often (a loaded machine may give fewer)
    assert 3 <= len(ticks) <= elapsed / 0.02 + 1 and not progress._thread.is_alive()
    assert stream.getvalue().endswith("\r\x1b[K") and not progress._drawn
    count = len(ticks)
    time.sleep(0.05)
    assert len(ticks) == count
    DemoProgress(stream=io.StringIO()).__exit__(None, None, None)  # never entered: nothing to join


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


class Recorder(DemoProgress):
    def __init__(self):
        super().__init__(stream=io.StringIO(), out=lambda text: self.calls.append(("say", text)), clock=lambda: 0.0)
        self.calls = []

    def phase(self, name, total=0):
        self.calls.append(("phase", name, total))
        super().phase(name, total)

    def step(self, done, detail=""):
        self.calls.append(("step", done, detail))
        super().step(done, detail)

    def note(self, detail):
        self.calls.append(("note", detail))
        super().note(detail)


def test_demo_trainer_counts_an_iteration_done_at_the_next_iterations_first_phase(monkeypatch):
    from stppo_agent.training.trainer import Trainer

    made, phases = [], []
    monkeypatch.setattr(Trainer, "__init__", lambda self, config, report, overwrite: made.append(
        (config, report, overwrite)))
    monkeypatch.setattr(Trainer, "phase", lambda self, text: phases.append(text))
    progress = Recorder()
    trainer = demo.DemoTrainer("config", progress)
    assert made == [("config", progress.say, True)] and trainer.progress is progress
    from .training_states import linear_state

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


class CountingAgent:
    def __init__(self):
        self.generated = {}

    def act(self, episodes):
        for episode in episodes:
            if episode.turn == 0:  # as the hf: agent does, a new episode's count starts again
                self.generated[episode.episode_id] = 0
            self.generated[episode.episode_id] = self.generated.get(episode.episode_id, 0) + 10
        return ["a"] * len(episodes)

    def generated_tokens(self, episode_id):
        return self.generated.get(episode_id, 0)


def test_demo_progress_agent_says_the_turn_and_the_speed(monkeypatch):
    import time

    from stppo_agent.evaluation.agents import EpisodeView

    ticks = iter([10.0, 12.0, 20.0, 23.0])
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks))
    progress, inner = Recorder(), CountingAgent()
    agent = demo.ProgressAgent(inner, progress, max_turns=3)
    agent.benchmark = "nq"
    first = [EpisodeView(f"q{i}", "q", None, (), 0) for i in range(2)]
    assert agent.act(first) == ["a", "a"]
    assert progress.calls[-1] == ("note", "nq: turn 1/3 of 2 episodes")
    assert (agent.tokens, agent.seconds) == (20, 2.0)
    second = [EpisodeView("q0", "q", None, (), 1), EpisodeView("q1", "q", None, (), 0)]
    agent.act(second)
    assert progress.calls[-1] == ("note", "nq: turn 2/3 of 2 episodes, 10 tokens/s")
    assert (agent.tokens, agent.seconds) == (40, 5.0)  # q1 restarted at turn 0: its earlier tokens don't count
    assert agent.generated_tokens("q0") == 20


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


def test_demo_off_policy_means_average_the_off_policy_records(tmp_path):
    assert demo.off_policy_means(tmp_path) == {}
    records = [{"iteration": 1, "offpolicy/steps": 0},
               {"iteration": 2, "offpolicy/steps": 3, "offpolicy/clip_frac": 0.1, "offpolicy/turn_clip_frac": 0.2,
                "offpolicy/clip_bias_scale": 2.0, "offpolicy/clip_bias_norm": 1.0,
                "offpolicy/tail/token_outside_frac": 0.3, "offpolicy/tail/ratio_max": 3.0,
                "offpolicy/tail/turn_ratio_max": 1.5},
               {"iteration": 3, "offpolicy/steps": 1, "offpolicy/clip_frac": 0.3, "offpolicy/turn_clip_frac": None}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    steps = [{"step": 1, "on_policy": True, "clip_bias_scale": 9.0}, {"step": 2, "on_policy": False,
                                                                       "clip_bias_scale": 1.5},
             {"step": 3, "on_policy": False, "clip_bias_scale": 2.5}, {"step": 4, "on_policy": False,
                                                                        "clip_bias_scale": None}]
    (tmp_path / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    means = demo.off_policy_means(tmp_path)
    assert means == pytest.approx({"steps": 4, "clip_frac": 0.2, "turn_clip_frac": 0.2, "clip_bias_scale": 2.0,
                                   "clip_bias_norm": 1.0, "tail/token_outside_frac": 0.3, "tail/ratio_max": 3.0,
                                   "tail/turn_ratio_max": 1.5, "clip_bias_scale_max": 2.5})  # not the on-policy 9
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"offpolicy/steps": 2}) + "\n")
    (tmp_path / "steps.jsonl").unlink()
    assert math.isnan(demo.off_policy_means(tmp_path)["clip_frac"])
    assert math.isnan(demo.off_policy_means(tmp_path)["clip_bias_scale_max"])


def test_demo_off_policy_summary_names_every_figure():
    means = {"steps": 3.0, "clip_frac": 0.1234, "turn_clip_frac": 0.25, "clip_bias_scale": 1.8, "clip_bias_norm": 0.5,
             "tail/token_outside_frac": 0.4, "tail/ratio_max": 2.345, "tail/turn_ratio_max": 1.5,
             "clip_bias_scale_max": 2.25}
    assert demo.off_policy_summary(means, [0.2, 0.0]) == (
        "trained on 2 trajectories, reward 0.100 (1 x 0.200, 1 x 0.000); on 3 off-policy steps: clip_frac 0.123 "
        "(turn-level), turn_clip_frac 0.250, clip_bias_scale 1.800 (max 2.250; ||C|| 0.500); token ratios outside the "
        "clip range 0.400 (what token-level PPO would clip), max 2.35 vs turn ratios max 1.50")
    assert demo.off_policy_summary({}, []) == "trained; no off-policy step (one mini-batch per iteration)"
    assert demo.off_policy_summary({}, [1.0, 1.0], 1.0).startswith(
        "trained on 2 trajectories, reward 1.000 (2 x 1.000) after 1 more rollout round(s) for groups whose")


def metrics_rows(em, answer, tokens=True):
    rows = []
    for benchmark, score in (("nq", {"em": em}), ("hotpotqa", {"em": em / 2}), ("medqa", {"acc": 0.25})):
        metrics = {"n": 8, **score, "answer_rate": answer, "invalid_action_rate": 0.125, "mean_search_calls": 1.25}
        if tokens:
            metrics["mean_response_tokens"] = 40.0
        rows.append({"benchmark": benchmark, "metrics": metrics})
    return rows


def test_demo_before_after_table_cells_and_qa_average():
    table = demo.before_after_table(metrics_rows(0.5, 0.75), metrics_rows(1.0, 1.0, tokens=False)).splitlines()
    assert table[1].split() == ["benchmark", "n", "EM/acc", "answer", "invalid", "searches", "tokens"]
    assert table[3].split() == ["nq", "8", "0.500", "->", "1.000", "0.750", "->", "1.000", "0.125", "->", "0.125",
                                "1.25", "->", "1.25", "40.0", "->", "0.0"]
    assert table[4].split()[2:5] == ["0.250", "->", "0.500"] and table[5].split()[2:5] == ["0.250", "->", "0.250"]
    assert table[6].split() == ["QA", "avg", "(EM)", "0.375", "->", "0.750"] and len(table) == 8
    assert table[7] == ("noise: one answer moves a benchmark's EM/acc by 1/8 = 0.125 and the QA average by 0.062; a "
                        "change of a few answers either way is noise, not a result of RL")
    after = demo.before_after_table(None, metrics_rows(1.0, 1.0)).splitlines()
    assert after[0] == "evaluation after RL" and after[-2].split() == ["QA", "avg", "(EM)", "0.750"]
    assert after[3].split() == ["nq", "8", "1.000", "1.000", "0.125", "1.25", "40.0"]
    one_qa = demo.before_after_table(None, metrics_rows(1.0, 1.0)[:1] + metrics_rows(1.0, 1.0)[2:]).splitlines()
    assert len(one_qa) == 6 and "QA avg" not in one_qa[-2]  # one QA benchmark: no average, nor its noise
    assert one_qa[-1].startswith("noise: one answer moves a benchmark's EM/acc by 1/8 = 0.125;")
    unscored = [{"benchmark": "x", "metrics": {"n": 1, "answer_rate": 0.5, "invalid_action_rate": 0.0,
                                               "mean_search_calls": 0.0}}]
    assert demo.before_after_table(None, unscored).splitlines()[3].split()[:3] == ["x", "1", "0.000"]
    from stppo_agent.training.demo_report import answer_noise

    assert answer_noise([{"benchmark": "x", "metrics": {"n": 0}}], 0) == "noise: no questions were scored"


def test_demo_figures_and_the_range_check_bounds():
    after, before = metrics_rows(1.0, 0.9), metrics_rows(1.0, 0.6)
    figures = demo.demo_figures(before, after, {"turn_clip_frac": 0.5, "clip_bias_scale": 1.02,
                                                "clip_bias_scale_max": 1.05})
    assert figures == pytest.approx({"answer rate after RL": 0.9, "answer rate before RL": 0.6,
                                     "turn_clip_frac": 0.5, "max clip_bias_scale": 1.05})
    assert demo.demo_figures(None, after, {}) == pytest.approx({"answer rate after RL": 0.9, "turn_clip_frac": 0.0,
                                                                "max clip_bias_scale": 1.0})
    assert demo.demo_figures(None, after, {}, [0.2, 0.2, 1.0])["reward spread"] == pytest.approx(0.8)
    edges = {"answer rate before RL": 0.75, "reward spread": 0.01, "turn_clip_frac": 0.5,
             "max clip_bias_scale": 10.0, "answer rate after RL": 1.0}
    assert demo.range_check(edges) == ("check: passed, each figure within its range (docs/demo.md): answer rate "
                                       "before RL 0.750, reward spread 0.010, turn_clip_frac 0.500, max "
                                       "clip_bias_scale 10.000, answer rate after RL 1.000")
    low = dict(edges, **{"answer rate before RL": 0.7499, "turn_clip_frac": 0.0099})
    assert demo.range_check(low) == (
        "check: FAILED: answer rate before RL 0.750 (expected 0.75-1): the warm start did not teach Search-R1's tags "
        "(more --sft-steps); turn_clip_frac 0.010 (expected 0.01-0.5): no turn's ratio left the clip range on the "
        "off-policy steps: the policy moved too little between them (a higher --lr moves it more) -- docs/demo.md "
        "says what each figure shows")
    high = {"max clip_bias_scale": 10.01, "answer rate after RL": 1.001}
    assert demo.range_check(high).count("(expected") == 2 and "clip_bias_scale 10.010 (expected 1.01-10): the " \
        "clipped part dwarfed the gradient" in demo.range_check(high)
    assert demo.range_check({"turn_clip_frac": 0.3}) == ("check: passed, each figure within its range "
                                                         "(docs/demo.md): turn_clip_frac 0.300")
