"""agentjax/progress.py: heartbeats while one long call runs, throttled loop lines, and the bar's ETA."""
from __future__ import annotations

import io
import logging
import time

from agentjax.progress import Heartbeat, ProgressBar, Throttle, format_duration, set_quiet


def test_heartbeat_logs_a_start_line_then_a_still_line_while_the_call_runs(caplog):
    logger = logging.getLogger("test.heartbeat")
    with caplog.at_level(logging.INFO, logger="test.heartbeat"):
        with Heartbeat(logger, "compiling the step", doing="compiling", every_s=0.05) as beat:
            time.sleep(0.18)
    messages = [record.getMessage() for record in caplog.records]
    assert messages[0] == "compiling the step"
    assert len([m for m in messages if m.startswith("still compiling (")]) >= 2
    assert beat.elapsed >= 0.18


def test_heartbeat_starts_no_thread_when_its_level_is_off(caplog):
    logger = logging.getLogger("test.heartbeat.off")
    with caplog.at_level(logging.WARNING, logger="test.heartbeat.off"):
        with Heartbeat(logger, "quiet", doing="quiet", every_s=0.01) as beat:
            time.sleep(0.03)
    assert beat._thread is None and not caplog.records


def test_throttle_is_due_once_per_interval():
    throttle = Throttle(every_s=0.05)
    assert not throttle.due()
    time.sleep(0.06)
    assert throttle.due() and not throttle.due()


def test_bar_shows_counts_percent_and_an_eta():
    stream = io.StringIO()
    bar = ProgressBar(40, "kv-sim", unit=" requests", stream=stream)
    bar.started -= 10.0  # ten seconds in
    bar.update(10, "lru")
    line = stream.getvalue()
    assert "[kv-sim] [#######" in line and "10/40 requests  25%" in line and "ETA 30s" in line and "lru" in line


def test_bar_on_a_pipe_prints_a_line_every_few_seconds_and_the_last_one():
    stream = io.StringIO()
    bar = ProgressBar(100, "sweep", stream=stream)
    for done in range(1, 101):
        bar.update(done)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and "1/100" in lines[0] and "100/100 100%" in lines[1]


def test_quiet_turns_bars_off():
    stream = io.StringIO()
    set_quiet(True)
    try:
        bar = ProgressBar(3, "quiet", stream=stream)
        bar.advance(3)
    finally:
        set_quiet(False)
    assert stream.getvalue() == ""


def test_durations_read_naturally():
    assert [format_duration(s) for s in (4.4, 125, 3725)] == ["4s", "2m05s", "1h02m"]
