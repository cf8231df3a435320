"""`stppo demo`'s own parts: the progress display, the before/after table with its noise line and the check line
(the command end to end, on a tiny model: tests/test_sft.py)."""

from __future__ import annotations

import io
import math

import pytest

from stppo_agent.cli.demo import DEMO_DEFAULTS
from stppo_agent.training.demo import (
    EXPECTED_RANGES,
    DemoSettings,
    before_after_table,
    demo_figures,
    off_policy_summary,
    range_check,
)
from stppo_agent.training.demo_progress import DemoProgress


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_a_line_per_phase_and_one_each_line_interval_not_more():
    clock, stream, said = FakeClock(), io.StringIO(), []
    progress = DemoProgress(stream=stream, out=said.append, line_s=30.0, clock=clock)
    assert not progress.interactive  # a StringIO is no terminal
    progress.phase("warm start", total=4)
    assert stream.getvalue() == "[0:00] warm start 0/4 (0:00 in this phase)\n"
    clock.now += 29.0
    progress.tick()
    assert stream.getvalue().count("\n") == 1  # not yet a line interval
    clock.now += 1.0
    progress.step(1, "loss 2.400")
    progress.tick()
    lines = stream.getvalue().splitlines()
    assert lines[-1] == "[0:30] warm start 1/4 -- loss 2.400 (0:30 in this phase, about 1:30 left)"
    clock.now += 10.0
    progress.tick()
    assert len(stream.getvalue().splitlines()) == 2
    progress.say("warm start: done")  # results go to stdout, never into the status stream
    assert said == ["warm start: done"] and "done" not in stream.getvalue()


def test_a_terminal_is_redrawn_every_tick_and_cleared_before_a_result_line():
    clock, stream, said = FakeClock(), FakeTerminal(), []
    progress = DemoProgress(stream=stream, out=lambda text: said.append((stream.getvalue(), text)), clock=clock)
    assert progress.interactive
    progress.phase("ST-PPO iteration", total=2)
    progress.note("rollout turn 1/3 done (4 active)")
    for _ in range(3):
        clock.now += 2.0
        progress.tick()
    assert stream.getvalue().count("\r\x1b[K") == 4 and "\n" not in stream.getvalue()
    assert stream.getvalue().endswith("[0:06] ST-PPO iteration 0/2 -- rollout turn 1/3 done (4 active) "
                                      "(0:06 in this phase)")
    progress.say("trained: ...")
    screen_before_result, _ = said[0]
    assert screen_before_result.endswith("\r\x1b[K")  # the status line was erased before the result was printed


def test_the_thread_ticks_until_the_block_ends():
    stream = io.StringIO()
    with DemoProgress(stream=stream, out=lambda _: None, refresh_s=0.01, line_s=0.0) as progress:
        progress.phase("evaluation", total=3)
        import time
        time.sleep(0.2)
    written = stream.getvalue().count("\n")
    assert written >= 3  # the phase line, then the ticks
    assert not progress._thread.is_alive()


def results(em: float, answer: float, n: int = 8) -> list[dict]:
    rows = []
    for benchmark in ("nq", "hotpotqa"):
        rows.append({"benchmark": benchmark, "metrics": {
            "n": n, "em": em, "f1": em, "answer_rate": answer, "invalid_action_rate": 0.0, "mean_search_calls": 1.5,
            "mean_response_tokens": 60.0}})
    rows.append({"benchmark": "medqa", "metrics": {
        "n": n, "acc": 0.25, "answer_rate": answer, "invalid_action_rate": 0.125, "mean_search_calls": 1.0,
        "mean_response_tokens": 50.0}})
    return rows


def test_before_after_table_puts_both_runs_in_each_cell():
    table = before_after_table(results(0.5, 0.875), results(0.75, 1.0)).splitlines()
    assert table[0] == "evaluation: before RL (after the warm start) -> after RL"
    assert table[1].split() == ["benchmark", "n", "EM/acc", "answer", "invalid", "searches", "tokens"]
    assert table[3].split() == ["nq", "8", "0.500", "->", "0.750", "0.875", "->", "1.000", "0.000", "->", "0.000",
                                "1.50", "->", "1.50", "60.0", "->", "60.0"]
    assert table[5].split()[:5] == ["medqa", "8", "0.250", "->", "0.250"]
    assert table[6].split() == ["QA", "avg", "(EM)", "0.500", "->", "0.750"]  # nq and hotpotqa, not medqa's acc
    without_warm_start = before_after_table(None, results(0.0, 0.0)).splitlines()
    assert without_warm_start[0] == "evaluation after RL" and "->" not in "".join(without_warm_start)


def test_range_check_names_each_figure_outside_its_range():
    means = {"turn_clip_frac": 0.1, "clip_bias_scale": 1.3, "clip_bias_scale_max": 2.0}
    good = demo_figures(results(0.5, 0.9), results(0.75, 1.0), means, [1.0, 0.2, 0.2, 0.0])
    assert good == {"answer rate before RL": 0.9, "answer rate after RL": 1.0, "turn_clip_frac": 0.1,
                    "max clip_bias_scale": 2.0, "reward spread": 1.0, "reward": 0.35}
    assert range_check(good).startswith("check: passed")
    assert all(name in range_check(good) for name in EXPECTED_RANGES)
    # no clipping acted (an on-policy-only run: no off-policy means), and the warm start taught no tags
    bad = demo_figures(results(0.0, 0.1), results(0.75, 1.0), {})
    line = range_check(bad)
    assert line.startswith("check: FAILED")
    assert "turn_clip_frac 0.000 (expected 0.01-0.5): no turn's ratio left the clip range" in line
    assert "answer rate before RL 0.100 (expected 0.75-1): the warm start did not teach" in line
    assert "max clip_bias_scale 1.000 (expected 1.01-10)" in line and "answer rate after RL" not in line
    nan = dict(good, **{"max clip_bias_scale": math.nan})  # a figure no step measured is never "within"
    assert "max clip_bias_scale nan (expected 1.01-10): no off-policy step measured it" in range_check(nan)
    # without a warm start there is no "before" figure to check, without the batch's rewards no spread
    assert "before RL" not in range_check(demo_figures(None, results(0.75, 1.0), means))
    assert "reward spread" not in range_check(demo_figures(None, results(0.75, 1.0), means))


# Figures real runs printed: a run of the earlier recipe with a mix of rewards, where clipping acted (its largest
# clip_bias_scale is above its mean of 1.831), and a run of the same recipe on another CPU, in bfloat16, whose 4
# trajectories all earned 0.200 (with nothing clipped by the correction, every step's scale was 1).
PASSED_RUN = {"answer rate before RL": 1.0, "reward spread": 0.2, "reward": 0.15, "turn_clip_frac": 0.133,
              "max clip_bias_scale": 1.831, "answer rate after RL": 1.0}
NO_SIGNAL_RUN = {"answer rate before RL": 1.0, "reward spread": 0.0, "reward": 0.2, "turn_clip_frac": 0.067,
                 "max clip_bias_scale": 1.0, "answer rate after RL": 1.0}


def test_the_check_passes_a_run_that_showed_the_mechanism():
    assert range_check(PASSED_RUN) == (
        "check: passed, each figure within its range (docs/demo.md): answer rate before RL 1.000, reward spread "
        "0.200, turn_clip_frac 0.133, max clip_bias_scale 1.831, answer rate after RL 1.000")


def test_the_check_names_no_learning_signal_as_the_reason_the_correction_did_not_act():
    line = range_check(NO_SIGNAL_RUN)
    assert line == (
        "check: FAILED: reward spread 0.000 (expected 0.01-1): every RL trajectory earned the same reward (0.200), "
        "so no advantage told them apart: no learning signal, nothing for the update to push; max clip_bias_scale "
        "1.000 (expected 1.01-10): nothing to learn, so nothing to clip (the reward spread above) -- docs/demo.md "
        "says what each figure shows")
    # a spread but no clipping: the reason is the policy's movement, not the signal
    moved_little = dict(PASSED_RUN, **{"max clip_bias_scale": 1.0})
    assert "max clip_bias_scale 1.000 (expected 1.01-10): the clipped turns' bias ||C|| stayed under 1.01" in \
        range_check(moved_little)


@pytest.mark.parametrize("name", list(EXPECTED_RANGES))
def test_each_check_boundary_holds_on_its_side(name):
    low, high = EXPECTED_RANGES[name]
    for value, passes in ((low, True), (high, True), (low - 1e-4, False), (high + 1e-4, False)):
        line = range_check(dict(PASSED_RUN, **{name: value}))
        assert line.startswith("check: passed") is passes, (name, value, line)
        if not passes:
            outside = line.split("check: FAILED: ", 1)[1]
            assert outside.startswith(f"{name} {value:.3f} (expected {low:g}-{high:g}): ")
            reason = outside.split("): ", 1)[1].split(" -- docs/demo.md", 1)[0]
            assert len(reason) > 20  # a reason, not only the range


def test_answer_noise_says_how_much_one_answer_moves_a_score():
    from stppo_agent.training.demo_report import answer_noise

    table = before_after_table(results(0.75, 1.0), results(0.25, 1.0)).splitlines()
    assert table[-1] == ("noise: one answer moves a benchmark's EM/acc by 1/8 = 0.125 and the QA average by 0.062; "
                         "a change of a few answers either way is noise, not a result of RL")
    assert answer_noise(results(0.5, 1.0, n=4), 1).startswith("noise: one answer moves a benchmark's EM/acc by "
                                                              "1/4 = 0.250;")
    mixed = results(0.5, 1.0, n=8)
    mixed[2]["metrics"]["n"] = 5
    assert answer_noise(mixed, 2).startswith("noise: one answer moves a benchmark's EM/acc by 1/8 to 1/5;")


def test_off_policy_summary_without_off_policy_steps():
    assert off_policy_summary({}, [1.0, 0.2, 0.2, 0.6]) == (
        "trained on 4 trajectories, reward 0.500 (1 x 1.000, 1 x 0.600, 2 x 0.200); no off-policy step (one "
        "mini-batch per iteration)")
    assert off_policy_summary({}, [0.0, 1.0], resampled=2.0) == (
        "trained on 2 trajectories, reward 0.500 (1 x 1.000, 1 x 0.000) after 2 more rollout round(s) for groups "
        "whose samples all earned the same reward; no off-policy step (one mini-batch per iteration)")


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
