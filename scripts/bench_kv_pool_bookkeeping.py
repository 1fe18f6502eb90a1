"""Benchmark: the KV manager's host cost per request on the byte pool ("pool" layout) against the shared layout.

Builds each preset's KV manager the way the engine does (`engine_kv_layout`, the engine's eviction
order) for a `kv_cache_memory_gb`, keeps `--live` requests running, and times one request's life:
allocate a `--prompt`-token prompt, cache it, `--appends` one-token appends (each cached), free; on
the pool as built and on the pool full of cached pages. The pool's bookkeeping should not grow with
the pool: the larger memories have more page ids than a full-size device's pool. Also lists the page
ids per group of the full-size presets' pools (abstract shapes).

`--base-repo` runs the same measurements in another checkout first (a subprocess whose imports come
from there) and writes both, "before" and "after", to the "## KV pool bookkeeping" section of
BENCHMARKS.md:

    python scripts/bench_kv_pool_bookkeeping.py --base-repo ../base
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SECTION = "## KV pool bookkeeping"
PRESETS = ("tiny-dense", "tiny-kimi-k3")
MEMORIES_GB = (1.0, 16.0)
FULL_SIZE = ("minimax-m3", "kimi-k3", "deepseek-v4-pro")
FULL_SIZE_MEMORY_GB = 40.0  # an H100's KV share per device; timed too, on one device's layout


def model_config(preset: str):
    """A preset's config; the full-size ones with abstract shapes and KV in the model's dtype (the format
    the engine runs)."""
    import dataclasses

    from agentjax.models import preset_config

    if preset not in FULL_SIZE:
        return preset_config(preset)
    cfg = preset_config(preset, abstract=True)
    if cfg.compressed_attention is not None:
        cfg = cfg.replace(compressed_attention=dataclasses.replace(cfg.compressed_attention, kv_format="model_dtype"))
    return cfg


def build_manager(preset: str, memory_gb: float, layout_mode: str, parallel: dict | None = None):
    from agentjax.config import EngineConfig
    from agentjax.engine_kv import engine_kv_layout
    from agentjax.kv import KVCacheManager
    from agentjax.kv.policy_order import engine_eviction_order

    engine_cfg = EngineConfig(kv_cache_memory_gb=memory_gb, kv_layout=layout_mode, **(parallel or {}))
    layout = engine_kv_layout(model_config(preset), engine_cfg)
    branch_states = engine_cfg.kv_policy != "lru" or engine_cfg.kv_offload_retention == "marconi"
    manager = KVCacheManager.from_layout(layout, enable_caching=engine_cfg.enable_prefix_caching,
                                         eviction_order=engine_eviction_order(engine_cfg.kv_policy),
                                         branch_states=branch_states)
    return manager, layout


def fill(manager, prompt: int = 8192, limit: int = 5000) -> int:
    """Sessions of `prompt` random tokens, cached and freed, until the pool evicts (its memory is full of
    cached pages: the steady state of a long-running server); returns how many it took."""
    import numpy as np

    rng = np.random.default_rng(1)
    for i in range(limit):
        tokens = rng.integers(1, 30_000, size=prompt).tolist()
        if not manager.allocate(f"fill{i}", tokens):
            return i
        manager.cache_blocks(f"fill{i}", prompt)
        manager.take_pending_copies()
        manager.free(f"fill{i}")
        if manager.stats()["evictions"]:
            return i + 1
    raise RuntimeError(f"{limit} sessions of {prompt} tokens did not fill the pool")


def time_requests(manager, requests: int, prompt: int, appends: int, live: int, seed: int = 0) -> list[float]:
    """Seconds per request life (allocate, cache, appends, free) with `live` other requests running."""
    import random

    rng = random.Random(seed)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(1, 30_000) for _ in range(count)]

    running = []
    for i in range(live):
        assert manager.allocate(f"live{i}", tokens(prompt))
        manager.cache_blocks(f"live{i}", prompt)
        running.append(f"live{i}")
    times = []
    for i in range(requests):
        prompt_tokens = tokens(prompt)
        extra = tokens(appends)
        start = time.perf_counter()
        if not manager.allocate(f"r{i}", prompt_tokens):
            raise RuntimeError(f"request {i} did not fit the pool")
        manager.cache_blocks(f"r{i}", prompt)
        for j in range(appends):
            if not manager.append(f"r{i}", extra[j:j + 1]):
                raise RuntimeError(f"request {i}'s append did not fit the pool")
            manager.cache_blocks(f"r{i}", prompt + j + 1)
        manager.take_pending_copies()
        manager.free(f"r{i}")
        times.append(time.perf_counter() - start)
    for request in running:
        manager.free(request)
    return times


def full_size_pools() -> list[dict]:
    """Page ids per group of the full-size presets' pools at the engine's default memory per device."""
    from agentjax.config import EngineConfig
    from agentjax.engine_kv import engine_kv_layout

    rows = []
    for name in FULL_SIZE:
        for parallel in ("tp1", "tp8"):
            for memory_gb in (1.0, FULL_SIZE_MEMORY_GB):
                engine_cfg = EngineConfig(kv_cache_memory_gb=memory_gb, tensor_parallel_size=int(parallel[2:]))
                layout = engine_kv_layout(model_config(name), engine_cfg)
                rows.append({"model": name, "parallel": parallel, "memory_gb": memory_gb, "layout": layout.mode,
                             "slabs": layout.num_slabs, "ids_per_group": [g.num_ids for g in layout.groups]
                             if layout.mode == "pool" else [layout.num_slabs]})
    return rows


def measure(args) -> dict:
    rows = []
    cases = [(preset, memory_gb, mode, False) for preset in PRESETS for memory_gb in args.memories
             for mode in ("shared", "pool")]
    cases += [(preset, FULL_SIZE_MEMORY_GB, "pool", False) for preset in ("kimi-k3", "deepseek-v4-pro")]
    # the pool full of cached pages: every allocation evicts (the policy scores the cached free pages)
    cases += [(preset, min(args.memories), mode, True) for preset in PRESETS for mode in ("shared", "pool")]
    cases += [(preset, FULL_SIZE_MEMORY_GB, "pool", True) for preset in ("kimi-k3", "deepseek-v4-pro")]
    for preset, memory_gb, mode, full in cases:
        manager, layout = build_manager(preset, memory_gb, mode)
        sessions = fill(manager) if full else 0
        time_requests(manager, 3, args.prompt, args.appends, 0, seed=99)  # warm-up
        times = time_requests(manager, args.requests, args.prompt, args.appends, args.live)
        manager.check_invariants()
        times.sort()
        row = {"preset": preset, "memory_gb": memory_gb, "layout": layout.mode, "page_ids": int(manager.num_pages),
               "pool_state": f"full of cache ({sessions} sessions of 8,192 tokens)" if full else "mostly empty",
               "median_ms": 1e3 * statistics.median(times), "p90_ms": 1e3 * times[int(0.9 * (len(times) - 1))]}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return {"rows": rows, "full_size": full_size_pools(), "load": os.getloadavg()[0]}


def markdown(after: dict, before: dict | None, command: str, args) -> str:
    from base_checkout import before_then_after
    from benchmarks_md import run_line

    lines = [SECTION, "",
             run_line(command, after["load"])
             + "Host only: the engine's KV manager (its layout from `kv_cache_memory_gb`, "
             f"its eviction order), {args.live} requests running, then per request: allocate a {args.prompt}-token "
             f"prompt, cache it, {args.appends} one-token appends (each cached), free; median and p90 over "
             f"{args.requests} requests. *Mostly empty*: the pool as built; *full of cache*: 8,192-token sessions "
             "cached and freed until the pool evicts, so every allocation evicts a cached page (the engine's "
             "default `hints` policy then scores every cached free page of the group)."
             + (f" *before*: the code at {before['commit']} (`--base-repo`); *after*: this checkout."
                if before else ""),
             "", "| preset | memory GB | layout | page ids | pool | code | median ms / request | p90 ms |",
             "|---|---|---|---|---|---|---|---|"]
    for _, code, r in before_then_after(before, after, "rows"):
        lines.append(f"| {r['preset']} | {r['memory_gb']:g} | {r['layout']} | {r['page_ids']:,} | "
                     f"{r['pool_state']} | {code} | **{r['median_ms']:.3f}** | {r['p90_ms']:.3f} |")
    lines += ["", "Page ids per group of the full-size presets' pools (abstract shapes, KV in the model's dtype, the "
              "engine's default layout; one device's part under tp8):", "",
              "| model | parallel | memory GB per device | layout | slabs | page ids per group |",
              "|---|---|---|---|---|---|"]
    for r in after["full_size"]:
        lines.append(f"| {r['model']} | {r['parallel']} | {r['memory_gb']:g} | {r['layout']} | {r['slabs']:,} | "
                     f"{', '.join(f'{n:,}' for n in r['ids_per_group'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(REPO / "scripts"))
    import base_checkout
    from benchmarks_md import publish

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--appends", type=int, default=8)
    parser.add_argument("--live", type=int, default=16)
    parser.add_argument("--memories", type=float, nargs="+", default=list(MEMORIES_GB))
    base_checkout.add_arguments(parser, REPO / "BENCHMARKS.md")
    args = parser.parse_args(argv)
    passed = [f"--requests {args.requests}", f"--prompt {args.prompt}", f"--appends {args.appends}",
              f"--live {args.live}", "--memories " + " ".join(f"{m:g}" for m in args.memories)]
    before, after = base_checkout.before_and_after(args, __file__, lambda: measure(args), " ".join(passed).split())
    if after is None:
        return 0
    command = "python scripts/bench_kv_pool_bookkeeping.py " + " ".join(passed) + (
        " --base-repo ../base" if before else "")
    publish(markdown(after, before, command, args), not args.no_write, args.benchmarks_md)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] or str(REPO))
    raise SystemExit(main())
