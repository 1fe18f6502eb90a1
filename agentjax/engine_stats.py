"""The engine's counters: `EngineMetrics` (tokens, requests, latency samples), `StepRecord` (one scheduled
step, for the step log), and `engine_stats`, the flat snapshot `Engine.stats()` returns to the server's
metrics and the benchmarks. Reads only: nothing here changes the engine, its scheduler or its KV manager.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from agentjax.kv.usage import group_memory

# Latency samples kept for percentiles (the server exports its own histograms).
LATENCY_WINDOW = 10_000


@dataclass
class EngineMetrics:
    """Counters and recent latency samples of the engine."""

    prompt_tokens_total: int = 0  # prompt tokens received (a parallel sample's prompt once)
    prompt_tokens_computed: int = 0  # prompt tokens run through the model (not read from the cache)
    generation_tokens_total: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    ttft_s: deque = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))
    itl_s: deque = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))
    e2e_s: deque = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))


@dataclass(frozen=True)
class StepRecord:
    """One step as scheduled: `(request_id, num_tokens, is_prefill)` rows, admissions, preemptions."""

    step_index: int
    rows: tuple[tuple[str, int, bool], ...]
    admitted: tuple[str, ...]
    preempted: tuple[str, ...]
    admissions_allowed: bool


def engine_stats(engine) -> dict:
    """Scheduler, KV pool, token, compile and (where present) speculative-decoding and offload counters
    of `engine` (an `agentjax.engine.Engine`)."""
    kv = engine.kv.stats()
    total = engine.kv.capacity_units
    free = engine.kv.num_free_blocks
    return {
        "num_running": len(engine.scheduler.running),
        "num_waiting": engine.scheduler.num_waiting,
        "num_preemptions": engine.scheduler.num_preemptions,
        "kv_total_blocks": total,
        "kv_free_blocks": free,
        "kv_used_blocks": kv.get("used_blocks", total - free),
        "kv_cached_blocks": kv.get("cached_blocks", 0),
        "kv_cached_blocks_by_group": engine.kv.cached_blocks_by_group(),
        "kv_usage": kv.get("used_blocks", total - free) / total,
        "prefix_query_tokens": kv.get("queries", 0),
        "prefix_hit_tokens": kv.get("hits", 0),
        "prefix_turn_end_hit_tokens": kv.get("turn_end_hits", 0),
        "prompt_tokens_total": engine.metrics.prompt_tokens_total,
        "prompt_tokens_computed_total": engine.metrics.prompt_tokens_computed,
        "generation_tokens_total": engine.metrics.generation_tokens_total,
        "requests_finished": engine.metrics.requests_finished,
        "requests_aborted": engine.metrics.requests_aborted,
        "num_steps": engine.num_steps,
        "compiled_shapes": len(engine.runner.compiled_shapes),
        "kv_layout": engine.kv_layout.mode if engine.kv_layout is not None else "shared",
        "kv_groups": group_memory(engine.kv),
        "compiled_executables": engine.compiles.executables,
        **({"spec_decode": engine.speculator.stats.snapshot()} if engine.speculator is not None else {}),
        **({"kv_offload": engine.offload.snapshot()} if engine.offload is not None else {}),
    }
