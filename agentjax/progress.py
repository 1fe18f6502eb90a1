"""What a user sees while agentjax works: log lines for long calls and loops, and a bar with an ETA.

`Heartbeat` logs a line when one long call starts (a compile, a checkpoint write), a "still ..." line
every few seconds while it runs, and records how long it took; `Throttle` paces a loop's progress lines;
`ProgressBar` redraws one line on a terminal (elsewhere it prints a line every few seconds) with the
elapsed time and an ETA. `set_quiet(True)` (the CLI's `--quiet`) turns the bars off; log lines follow the
log level. Never imports jax, never writes to stdout (results go there).
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from typing import TextIO

HEARTBEAT_S = 4.0  # a long call shows a line at least this often
THROTTLE_S = 2.0  # a loop's progress lines come at most this often
PLAIN_BAR_S = 5.0  # a bar written to a file or pipe prints a line at most this often

_quiet = False


def set_quiet(quiet: bool) -> None:
    """`--quiet`: no progress bars (log lines follow the log level, which `--quiet` raises to WARNING)."""
    global _quiet
    _quiet = quiet


def is_quiet() -> bool:
    return _quiet


def format_duration(seconds: float) -> str:
    """45.2 -> '45s', 125 -> '2m05s', 3725 -> '1h02m'."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Heartbeat:
    """Logs `start` on entry and `still <doing> (N s)` every `every_s` until the block ends; `elapsed`
    holds the block's duration afterwards. No thread runs when the logger would drop the lines."""

    def __init__(self, logger: logging.Logger, start: str, *, doing: str, every_s: float = HEARTBEAT_S,
                 level: int = logging.INFO) -> None:
        self.logger, self.start, self.doing, self.every_s, self.level = logger, start, doing, every_s, level
        self.elapsed = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = 0.0

    def __enter__(self) -> Heartbeat:
        self._started = time.perf_counter()
        if self.logger.isEnabledFor(self.level):
            self.logger.log(self.level, "%s", self.start)
            self._thread = threading.Thread(target=self._beat, name="agentjax-heartbeat", daemon=True)
            self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.every_s):
            self.logger.log(self.level, "still %s (%s)", self.doing,
                            format_duration(time.perf_counter() - self._started))

    def __exit__(self, *exc_info) -> None:
        self.elapsed = time.perf_counter() - self._started
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


class Throttle:
    """`due()` is True at most once every `every_s` seconds (and on the first call after that long)."""

    def __init__(self, every_s: float = THROTTLE_S) -> None:
        self.every_s = every_s
        self.started = self._last = time.perf_counter()

    def due(self) -> bool:
        now = time.perf_counter()
        if now - self._last < self.every_s:
            return False
        self._last = now
        return True

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started


class ProgressBar:
    """`[label] [#####.....] 12/40 30%  1m05s, ETA 2m30s  note` on stderr: redrawn in place on a terminal,
    a line every `PLAIN_BAR_S` seconds elsewhere, nothing under `--quiet` or with `enabled=False`.
    `done` and `total` may be counts or seconds (`unit` follows the numbers)."""

    WIDTH = 30

    def __init__(self, total: float, label: str, *, unit: str = "", enabled: bool = True,
                 stream: TextIO | None = None) -> None:
        self.total, self.label, self.unit = max(total, 1e-9), label, unit
        self.enabled = enabled and not _quiet
        self.stream = stream or sys.stderr
        self.done = 0.0
        self.started = time.perf_counter()
        self._interactive = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_plain = float("-inf")
        self._closed = False

    def eta_s(self) -> float | None:
        """Seconds left at the rate so far (None before any progress)."""
        if self.done <= 0:
            return None
        elapsed = time.perf_counter() - self.started
        return elapsed * (self.total - self.done) / self.done

    def render(self, note: str = "") -> str:
        fraction = min(1.0, self.done / self.total)
        filled = int(self.WIDTH * fraction)
        eta = self.eta_s()
        timing = format_duration(time.perf_counter() - self.started)
        timing += f", ETA {format_duration(eta)}" if eta is not None and fraction < 1 else ""
        count = (f"{self.done:.0f}/{self.total:.0f}{self.unit}" if self.unit or float(self.total).is_integer()
                 else f"{self.done:.1f}/{self.total:.1f}")
        return (f"[{self.label}] [{'#' * filled}{'.' * (self.WIDTH - filled)}] {count} {100 * fraction:3.0f}%  "
                f"{timing}  {note[:70]}").rstrip()

    def update(self, done: float, note: str = "") -> None:
        self.done = min(self.total, max(0.0, done))
        self._draw(note, final=False)

    def advance(self, count: float = 1, note: str = "") -> None:
        self.update(self.done + count, note)
        if self.done >= self.total:
            self.close(note)

    def close(self, note: str = "") -> None:
        if not self._closed:
            self._closed = True
            self._draw(note, final=True)

    def _draw(self, note: str, final: bool) -> None:
        if not self.enabled:
            return
        line = self.render(note)
        if self._interactive:
            self.stream.write(f"\r{line:<120}" + ("\n" if final else ""))
        else:
            now = time.perf_counter()
            if not final and now - self._last_plain < PLAIN_BAR_S:
                return
            self._last_plain = now
            self.stream.write(line + "\n")
        self.stream.flush()
