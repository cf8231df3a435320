"""``stppo_agent.training.demo_progress``: one status line, redrawn on a
terminal and a line per phase in a log, never silent for long."""

from __future__ import annotations

import io

from stppo_agent.training import demo
from stppo_agent.training.demo_progress import DemoProgress, clock_text
from tests.support.demo import CountingAgent, Recorder


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


# The display's lines in a log, its redraws on a terminal, and its thread.


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
