"""The compile-and-step timing of the compile benchmarks (bench_compile.py, bench_presets.py), run inside
their measuring subprocess: it only times `runner.execute` on the rows it is given, never builds a runner."""
from __future__ import annotations

import statistics
import time

# How the sections these benchmarks write define their two figures.
DEFINITIONS = "Compile = first call minus the steady median; step = median of the steady calls."


def time_cases(runner, cases: dict[str, list], repeats: int) -> dict[str, dict[str, float]]:
    """Per case: compile_s = the first call less the steady median, step_s = the median of `repeats`
    calls after it (greedy sampling for every row)."""
    greedy = (0.0, 0, 1.0, 0, 0)
    out = {}
    for name, rows in cases.items():
        started = time.perf_counter()
        runner.execute(rows, [greedy] * len(rows))
        first = time.perf_counter() - started
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            runner.execute(rows, [greedy] * len(rows))
            times.append(time.perf_counter() - started)
        step = statistics.median(times)
        out[name] = {"compile_s": first - step, "step_s": step}
    return out
