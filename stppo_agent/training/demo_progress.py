"""The demo's progress display: one status line, never silent for long.

Each phase of ``stppo demo`` is made of steps that take seconds to tens of seconds on a CPU (a warm-start step, a
rollout turn, an update step, an evaluation turn), too coarse for a bar that only moves when a step ends. A
background thread therefore redraws the status -- phase, step, elapsed time, time left when it can be estimated --
every ``refresh_s`` on a terminal, and writes it as a full line every ``line_s`` elsewhere (a log or a pipe, where
carriage-return redraws would pile up on one line). Result lines go through :meth:`DemoProgress.say`, which clears
the status line first so the two never share a line.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable, TextIO


def clock_text(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 60}:{seconds % 60:02d}"


class DemoProgress:
    """Status of a run of phases; ``step(done, total)`` within a phase gives the time-left estimate."""

    def __init__(self, stream: TextIO | None = None, out: Callable[[str], None] | None = None,
                 interactive: bool | None = None, refresh_s: float = 2.0, line_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        self.stream = stream if stream is not None else sys.stderr
        self.out = out or (lambda text: print(text, flush=True))  # flushed: stdout to a pipe is block-buffered
        self.interactive = self.stream.isatty() if interactive is None else interactive
        self.refresh_s, self.line_s, self.clock = refresh_s, line_s, clock
        self.started = self.phase_started = self.last_written = clock()
        self.name, self.detail = "starting", ""
        self.done, self.total, self.step_started = 0, 0, None
        self._drawn = False  # a status line is on the terminal, without its newline
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- what the demo tells it -------------------------------------------------------------------------------
    def phase(self, name: str, total: int = 0) -> None:
        """A new phase of ``total`` steps (0: unknown); written at once."""
        with self._lock:
            self.name, self.detail, self.done, self.total = name, "", 0, total
            self.phase_started = self.step_started = self.clock()
            self._write()

    def step(self, done: int, detail: str = "") -> None:
        """``done`` of the phase's steps are finished; ``detail`` says where it is (a loss, a turn, ...)."""
        with self._lock:
            self.done, self.detail = done, detail
            self.step_started = self.clock()

    def note(self, detail: str) -> None:
        """Where the current step is, without finishing one (a rollout turn, an update step)."""
        with self._lock:
            self.detail = detail

    def say(self, text: str) -> None:
        """A result line, on stdout, never on top of the status line."""
        with self._lock:
            self._clear()
            self.out(text)
            self.last_written = self.clock()

    # -- the display -----------------------------------------------------------------------------------------
    def status(self) -> str:
        now = self.clock()
        parts = [f"[{clock_text(now - self.started)}] {self.name}"]
        if self.total:
            parts.append(f"{self.done}/{self.total}")
        if self.detail:
            parts.append(f"-- {self.detail}")
        tail = f"{clock_text(now - self.phase_started)} in this phase"
        if self.total and self.done:
            per_step = (self.step_started - self.phase_started) / self.done
            tail += f", about {clock_text(per_step * (self.total - self.done))} left"
        return " ".join(parts) + f" ({tail})"

    def tick(self) -> None:
        """Redraw on a terminal; on anything else write a line when ``line_s`` has passed since the last one."""
        with self._lock:
            if self.interactive or self.clock() - self.last_written >= self.line_s:
                self._write()

    def _write(self) -> None:
        text = self.status()
        if self.interactive:
            self.stream.write("\r\x1b[K" + text)  # \x1b[K: erase what a longer previous status left
            self._drawn = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self.last_written = self.clock()

    def _clear(self) -> None:
        if self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._drawn = False

    # -- the thread ----------------------------------------------------------------------------------------------
    def __enter__(self) -> "DemoProgress":
        self._thread = threading.Thread(target=self._run, name="stppo-demo-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            self._clear()

    def _run(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self.tick()
