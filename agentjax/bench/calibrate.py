"""Calibration: time the real runner's steps at a few batch shapes and fit the cost model's
efficiency factors to them (`costmodel.fit_efficiency`), so the simulator's CPU projections rest
on measured step times. It runs the model on synthetic page tables (garbage KV, real cost) and
never touches the engine's KV manager or scheduler.
"""
from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from agentjax.bench.costmodel import CostModel, fit_efficiency
from agentjax.bench.gpus import DeviceSpec, Efficiency
from agentjax.bench.model_shapes import shape_from_model_config

logger = logging.getLogger(__name__)

# (new tokens, context) rows of one step: decodes, prefill chunks at cached contexts, and mixes,
# over the token, row and page buckets an AgentX replay at context scale 0.01 meets.
DEFAULT_SHAPES: tuple[tuple[tuple[int, int], ...], ...] = (
    ((16, 0),),
    ((256, 0),),
    ((1024, 0),),
    ((2048, 1024),),
    ((128, 2048),),
    ((40, 3000),),
    ((1, 600),) * 4,
    ((1, 1500),) * 4,
    ((1, 3000),) * 2,
    ((1, 1800),) * 8,
    ((1, 5000),) * 4,
    ((30, 2500), (1, 1200), (1, 2000), (1, 800)),
    ((200, 1500), (1, 3000), (1, 900)),
    ((900, 100), (1, 2600), (1, 1500), (1, 4000)),
)


@dataclass(frozen=True)
class StepTiming:
    rows: tuple[tuple[int, int], ...]
    first_s: float  # includes compiling the shape (or loading it from the compilation cache)
    steady_s: float  # median of the later calls


def synthetic_rows(spec: Sequence[tuple[int, int]], page_size: int, num_groups: int, num_pages: int) -> list:
    """Runner rows with fresh page tables (pages 1, 2, ... in order) for `spec`."""
    rows, next_page = [], 1
    for count, context in spec:
        pages = -(-(count + context) // page_size)
        if next_page + pages > num_pages:
            raise ValueError(f"the pool has {num_pages} pages; {spec} needs more")
        table = list(range(next_page, next_page + pages))
        rows.append(([300] * count, context, [table] * num_groups))
        next_page += pages
    return rows


def time_steps(runner, specs: Sequence[Sequence[tuple[int, int]]] = DEFAULT_SHAPES, repeats: int = 2,
               progress: bool = False) -> list[StepTiming]:
    """Times `runner.execute` on each spec: a first call per shape (compiling it), then `repeats`
    rounds over all the shapes (round-robin, so a burst of load on a shared machine spreads over
    shapes instead of skewing one), reporting each shape's median."""
    from agentjax.kv_buffers import num_page_tables

    prepared, firsts = [], []
    for spec in specs:
        tables = num_page_tables(runner.kv_pages) or len(runner.kv_pages)  # a pool's page groups, or buffers
        rows = synthetic_rows(spec, runner.page_size, tables, runner.num_pages)
        prepared.append((rows, [(0.0, 0, 1.0, 0, 0)] * len(rows)))
        started = time.perf_counter()
        runner.execute(*prepared[-1])
        firsts.append(time.perf_counter() - started)
        if progress:
            print(f"[calibrate] compiled {len(firsts)}/{len(specs)}: rows={len(spec)} "
                  f"tokens={sum(n for n, _ in spec)} first call {firsts[-1]:.2f}s", flush=True)
    seconds: list[list[float]] = [[] for _ in specs]
    for round_index in range(repeats):
        for index, (rows, sampling) in enumerate(prepared):
            started = time.perf_counter()
            runner.execute(rows, sampling)
            seconds[index].append(time.perf_counter() - started)
        if progress:
            print(f"[calibrate] round {round_index + 1}/{repeats} done", flush=True)
    return [StepTiming(tuple(tuple(r) for r in spec), first, statistics.median(times))
            for spec, first, times in zip(specs, firsts, seconds)]


def fit_cpu(model_cfg, device: DeviceSpec, timings: Sequence[StepTiming], page_tokens: int) -> tuple[Efficiency, list[dict]]:
    """CPU efficiency factors from `timings` (reference kernel, padded batches) and a per-shape
    table of measured against fitted seconds."""
    model = CostModel(shape_from_model_config(model_cfg, page_tokens), device, kernel="reference")
    compile_s = statistics.median(max(0.0, t.first_s - t.steady_s) for t in timings)
    efficiency = fit_efficiency(model, [(t.rows, t.steady_s) for t in timings], compile_s=compile_s,
                                source=f"fitted to {len(timings)} timed {model_cfg.name} steps on this CPU")
    model.efficiency = efficiency
    table = [{"rows": list(t.rows), "measured_s": t.steady_s, "fitted_s": model.step_time([t.rows]),
              "first_call_s": t.first_s} for t in timings]
    return efficiency, table
