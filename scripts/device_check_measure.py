"""What every device check uses inside its subprocess: a `Recorder` of its figures (rewritten after each
record, so a timeout keeps them), the median time of a jitted call, and error measures against a reference.
Used by scripts/device_check.py and its check modules; never imported by the agentjax package.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from call_timing import call_seconds

class Recorder:
    """A check's figures, rewritten to its result file after every `record`, so a timeout keeps them."""

    def __init__(self, path: str, deadline: float):
        self.path, self.deadline, self.figures = path, deadline, {}

    def record(self, **figures):
        self.figures.update(figures)
        Path(self.path).write_text(json.dumps(self.figures, default=float))

    def time_left(self) -> float:
        return self.deadline - time.monotonic()


def timed(fn, *args, iters: int):
    """Median seconds of `fn(*args)` after a compile and a warm-up call."""
    times = sorted(call_seconds(fn, *args, repeats=iters, warmups=2))
    return times[len(times) // 2]


def relative_error(got, want) -> float:
    import numpy as np

    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def lse_error(got, want) -> float:
    import numpy as np

    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    finite = np.isfinite(want)
    if (np.isfinite(got) != finite).any():
        return float("inf")
    return float(np.abs(got[finite] - want[finite]).max()) if finite.any() else 0.0
