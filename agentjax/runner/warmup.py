"""Warm-up: build the executables an engine's steps can reach before it serves, so serving compiles nothing.

`step_shapes(engine, level)` lists the compiled step shapes an engine's settings allow: token buckets up
to max_num_batched_tokens, row buckets up to max_num_seqs (never more rows than tokens), and each KV
group's page-table width for contexts up to max_model_len, all from the engine's `step_buckets`. Level
"decode" keeps the decode shapes (one token per row), "steps" and "all" every reachable pair of them.
`warm_up(engine, level)` builds each shape's executable, greedy and sampled, from rows that read and
write only the null page, without running it (`ModelRunner.compile_step`); "all" also runs the
log-probability and penalty variants of each shape (the smallest penalty table) and, with KV offload
tiers, their page movers. It never touches a request's pages.
Not covered yet: speculative decoding's sample-count variants, prompt log probabilities' position
buckets, penalty tables past the smallest bucket.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from agentjax.buckets import StepBuckets, bucket, bucket_below
from agentjax.errors import InvalidRequestError

logger = logging.getLogger(__name__)

WARMUP_LEVELS = ("none", "decode", "steps", "all")
NULL_PAGE = 0
GREEDY, SAMPLED = (0.0, 0, 1.0, 0, 0), (1.0, 0, 1.0, 0, 0)


@dataclass(frozen=True)
class StepShape:
    """One compiled step shape: padded tokens and rows, and the longest row's context (which sets
    each KV group's page-table width)."""

    tokens: int
    rows: int
    context: int


def token_row_buckets(max_tokens: int, max_rows: int, decode_only: bool = False,
                      buckets: StepBuckets = StepBuckets()) -> list[tuple[int, int]]:
    """(token bucket, row bucket) pairs a step can pad to: a step of n rows has at least n tokens."""
    pairs = []
    for tokens in _buckets_up_to(max_tokens, buckets.tokens):
        for rows in _buckets_up_to(min(max_rows, tokens), buckets.rows):
            fewest_rows = bucket_below(rows, buckets.rows) + 1
            if fewest_rows <= min(max_rows, tokens) and (
                    not decode_only or _decode_fits(tokens, rows, max_rows, buckets)):
                pairs.append((tokens, rows))
    return pairs


def _decode_fits(tokens: int, rows: int, max_rows: int, buckets: StepBuckets) -> bool:
    """Whether a step of one token per row can pad to (tokens, rows): some row count n <= max_rows has both."""
    low = max(bucket_below(tokens, buckets.tokens), bucket_below(rows, buckets.rows)) + 1
    return low <= min(tokens, rows, max_rows)


def _buckets_up_to(value: int, buckets) -> list[int]:
    out, size = [], bucket(1, buckets)
    while True:
        out.append(size)
        if size >= value:
            return out
        size = bucket(size + 1, buckets)


def context_buckets(kv, max_context: int, page_buckets=StepBuckets().pages) -> list[int]:
    """The longest context (up to `max_context`) of each distinct tuple of page-table widths: the most
    room a shape's rows can have."""
    candidates = {max_context}
    for group in kv.plan.groups:
        for pages in page_buckets:
            if pages * group.tokens_per_page < max_context:
                candidates.add(pages * group.tokens_per_page)
    longest: dict[tuple[int, ...], int] = {}
    for context in sorted(candidates):
        longest[tuple(bucket(max(1, n), page_buckets) for n in kv.page_table_lengths(context))] = context
    return sorted(longest.values())


def step_shapes(engine, level: str = "all") -> list[StepShape]:
    """The step shapes `warm_up` builds at `level` (see the module docstring)."""
    if level not in WARMUP_LEVELS:
        raise InvalidRequestError(f"warm-up level must be one of {', '.join(WARMUP_LEVELS)}; got {level!r}")
    if level == "none":
        return []
    cfg = engine.config
    pairs = token_row_buckets(cfg.max_num_batched_tokens, cfg.max_num_seqs, decode_only=level == "decode",
                              buckets=cfg.step_buckets)
    contexts = context_buckets(engine.kv, engine.max_model_len, cfg.step_buckets.pages)
    return [StepShape(tokens, rows, context) for tokens, rows in pairs for context in contexts]


def _rows_for(engine, shape: StepShape) -> list | None:
    """Null-page rows that pad to `shape` (None where no such rows exist: more tokens than the rows'
    contexts hold). Every row has the shape's context, so the widths are the context's."""
    tables = [[NULL_PAGE] * n for n in engine.kv.page_table_lengths(shape.context)]
    total = shape.tokens
    if total > shape.rows * shape.context:  # the fewest tokens of the bucket, then
        total = bucket_below(shape.tokens, engine.config.step_buckets.tokens) + 1
        if total > shape.rows * shape.context:
            return None
    per_row = [total // shape.rows + (1 if r < total % shape.rows else 0) for r in range(shape.rows)]
    return [([0] * count, shape.context - count, tables) for count in per_row]


@dataclass
class WarmupReport:
    """What a warm-up built: shapes run, shapes with no rows that fit them, executables and seconds."""

    level: str
    shapes: int = 0
    skipped: int = 0
    executables: int = 0
    seconds: float = 0.0


def warm_up(engine, level: str = "all") -> WarmupReport:
    """Run every step shape of `level` (and at "all" the extras variants and page movers) once."""
    from agentjax.runner.extras import RowPenalties, StepExtras

    report = WarmupReport(level)
    started, before = time.perf_counter(), engine.compiles.executables
    runner = engine.runner
    with engine.compiles.counting():
        for shape in step_shapes(engine, level):
            rows = _rows_for(engine, shape)
            if rows is None:
                report.skipped += 1
                continue
            report.shapes += 1
            for sampling in (GREEDY, SAMPLED):
                runner.compile_step(rows, [sampling] * len(rows))
                if level == "all":
                    runner.execute_extended(rows, [sampling] * len(rows), StepExtras(logprobs={0}))
                    penalty = RowPenalties(0.5, 0.0, 1.0, np.zeros(1, np.int32), np.ones(1, np.int32),
                                           np.zeros(1, np.int32), np.zeros(1, np.float32))
                    runner.execute_extended(rows, [sampling] * len(rows), StepExtras(penalties={0: penalty}))
        if level == "all" and engine.offload_worker is not None:
            warm_page_movers(engine)
    report.executables = engine.compiles.executables - before
    report.seconds = time.perf_counter() - started
    logger.info("warm-up (%s): %d step shapes (%d unreachable), %d executables built in %.1f s", level,
                report.shapes, report.skipped, report.executables, report.seconds)
    return report


def warm_page_movers(engine) -> None:
    """The offload worker's page gather, host store and load, and device write at each transfer bucket up
    to one request's pages, on the null page."""
    from agentjax.runner.offload_worker import TRANSFER_BUCKETS

    worker, runner = engine.offload_worker, engine.runner
    mover = worker.mover
    most = max(engine.kv.page_table_lengths(engine.max_model_len))
    for size in _buckets_up_to(most, TRANSFER_BUCKETS):
        nulls = np.zeros(size, np.int32)
        for group in range(mover.num_groups):
            gathered = mover.gather(runner.kv_pages, group, nulls)
            if worker.host_pools:
                worker.host_pools[group] = mover.host_put(worker.host_pools[group], gathered, nulls)
                runner.kv_pages = mover.host_load(runner.kv_pages, group, worker.host_pools[group], nulls, nulls)
            runner.kv_pages = mover.scatter(runner.kv_pages, group, mover.to_device(np.asarray(gathered)), nulls)
