"""Benchmark: the host's share of a decode step at real size, with the device stubbed out.

Builds an `Engine` whose runner is the real `ModelRunner` host path (`execute`: page copies, the
`RaggedBatch`, the sampling metadata) with the jitted step replaced by a stub that returns token 0 at
once, over a KV manager of `--groups` full-attention page groups (`--page-tokens` tokens per page, the
engine's default eviction order). `--rows` requests of `--context` tokens each are admitted and
prefilled by host bookkeeping alone, then every timed step is one `Engine.step()` (scheduler, KV
manager, batch building, the stub call, the outputs) plus the `Engine.stats()` the server's engine
thread publishes after each step. Reports the median and p99 host milliseconds per step next to the
planner's per-step host charge (`Efficiency.step_overhead_s`, agentjax/bench/gpus.py).

`--base-repo` runs the same measurement in another checkout first and writes both, "before" and
"after", to the "## Host step" section of BENCHMARKS.md:

    python scripts/bench_host_step.py --base-repo ../base

Times taken on a loaded machine are indicative only (`os.getloadavg` is written next to them).
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
SECTION = "## Host step"
# (rows, KV groups): the real-size case and a mid-size one
CASES = ((256, 7), (48, 2))
VOCAB_PRESET = "minimax-m3"  # the sampling metadata (token bitmask) is sized by a real vocabulary


def build_manager(groups: int, page_tokens: int, num_pages: int):
    """`groups` full-attention page groups of `page_tokens` tokens per page in one page-id space."""
    from agentjax.config import EngineConfig
    from agentjax.kv import KVCacheManager
    from agentjax.kv.policy_order import engine_eviction_order
    from agentjax.kv.specs import FullAttentionSpec

    specs = [FullAttentionSpec(head_dim=64 * (g + 1)) for g in range(groups)]  # distinct specs: one group each
    engine_cfg = EngineConfig()
    manager = KVCacheManager.from_specs(specs, num_pages, page_tokens, scale_tokens_per_page=False,
                                        cache_on_allocate=False,
                                        eviction_order=engine_eviction_order(engine_cfg.kv_policy))
    assert len(manager.plan.groups) == groups, len(manager.plan.groups)
    return manager


def stub_runner(model_cfg, manager, page_tokens: int):
    """A `ModelRunner` whose host path is the real one and whose device step is a stub (no KV buffers,
    no compile): it returns token 0 for every sampled position."""
    import numpy as np

    from agentjax.buckets import StepBuckets
    from agentjax.runner.model_runner import ModelRunner

    def step(params, kv_pages, batch, meta, *spec):
        return np.zeros(batch.num_samples, np.int32), kv_pages

    runner = ModelRunner.__new__(ModelRunner)
    runner.cfg = model_cfg
    runner.logprobs_mode = "raw_logprobs"
    runner.params = None
    runner.page_size = page_tokens
    runner.kv_layout = None
    runner.num_pages = manager.num_pages
    runner.page_sizes = page_tokens
    runner.numerics = "batch_invariant"
    runner.step_buckets = StepBuckets()
    runner.drafting = None
    runner.drafter = None
    runner.kv_pages = ()
    runner.state_groups = ()
    runner.state_interval = 0
    runner._steps = {True: step, False: step}
    runner.compiled_shapes = set()
    runner.last_device_s = 0.0
    runner.copy_pages = lambda copies: None
    return runner


def start_decoding(engine, rows: int, context: int, seed: int) -> None:
    """`rows` requests of `context` prompt tokens, admitted and prefilled by host bookkeeping alone (one
    scheduler pass with a budget that holds every prompt, its output handed back as if the device ran it),
    so that every later step is a decode step of all rows."""
    import dataclasses

    import numpy as np

    from agentjax.sampling_params import SamplingParams

    rng = np.random.default_rng(seed)
    sampling = SamplingParams(max_tokens=1_000_000, temperature=0.0, ignore_eos=True)
    for i in range(rows):
        # small token ids: Python keeps one object per value, so 256 long prompts stay small in memory
        # rows end `i % page_tokens` tokens short of `context`, so they fill pages on different steps
        prompt = rng.integers(1, 250, size=context - i % engine.kv.block_size).tolist()
        engine.add_request(prompt, sampling, request_id=f"row{i}")
    config = engine.scheduler.config
    engine.scheduler.config = dataclasses.replace(config, max_num_batched_tokens=rows * context,
                                                  long_prefill_token_threshold=0, trim_prefill_to_buckets=False)
    plan = engine.scheduler.schedule()
    assert len(plan.scheduled) == rows, f"{len(plan.scheduled)} of {rows} rows admitted"
    assert all(item.num_new_tokens == len(item.request.prompt_token_ids) for item in plan.scheduled)
    engine.scheduler.update_from_output(plan, [0] * rows)
    engine.scheduler.config = config


def measure_case(rows: int, groups: int, context: int, page_tokens: int, steps: int, warmup: int) -> dict:
    import gc

    from agentjax.config import EngineConfig
    from agentjax.engine import Engine
    from agentjax.models import preset_config

    model_cfg = preset_config(VOCAB_PRESET, abstract=True)
    pages_per_row = -(-(context + warmup + steps + 8) // page_tokens)
    # the scheduler keeps 1% of the pool free while others run (its watermark): room above that
    manager = build_manager(groups, page_tokens, int(1.02 * rows * groups * pages_per_row) + 64)
    engine_cfg = EngineConfig(block_size=page_tokens, max_num_seqs=rows, max_num_batched_tokens=max(2048, rows),
                              max_model_len=context + warmup + steps + 64)
    engine = Engine(model_cfg, None, engine_cfg, kv=manager, runner=stub_runner(model_cfg, manager, page_tokens))
    started = time.perf_counter()
    start_decoding(engine, rows, context, seed=rows * 31 + groups)
    setup_s = time.perf_counter() - started
    gc.collect()
    times, step_only = [], []
    for i in range(warmup + steps):
        begin = time.perf_counter()
        outputs = engine.step()
        middle = time.perf_counter()
        engine.stats()
        end = time.perf_counter()
        assert len(outputs) == rows, f"step {i} produced {len(outputs)} outputs for {rows} rows"
        if i >= warmup:
            times.append(end - begin)
            step_only.append(middle - begin)
    times.sort()
    step_only.sort()
    return {"rows": rows, "groups": groups, "context": context, "page_tokens": page_tokens,
            "pages_per_row": -(-context // page_tokens), "steps": steps, "setup_s": setup_s,
            "median_ms": 1e3 * statistics.median(times), "p99_ms": 1e3 * times[round(0.99 * (len(times) - 1))],
            "step_median_ms": 1e3 * statistics.median(step_only), "load": os.getloadavg()[0]}


def planner_charge_ms() -> float:
    from agentjax.bench.gpus import Efficiency

    return 1e3 * Efficiency().step_overhead_s


def measure(args) -> dict:
    rows = []
    for count, groups in args.cases:
        row = measure_case(count, groups, args.context, args.page_tokens, args.steps, args.warmup)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return {"rows": rows, "planner_ms": planner_charge_ms(), "load": os.getloadavg()[0]}


def markdown(after: dict, before: dict | None, command: str, args) -> str:
    from base_checkout import before_then_after
    from benchmarks_md import run_line

    lines = [SECTION, "",
             run_line(command, after["load"], "; timings on a loaded machine are indicative only")
             + "The device is stubbed out: an `Engine` over the real `ModelRunner` host path whose jitted step "
             f"returns at once, {args.context:,}-token contexts (row i {args.context:,} - i mod "
             f"{args.page_tokens}, so rows fill pages on different steps) in pages of {args.page_tokens} tokens, "
             "every row decoding, the engine's default "
             "`hints` eviction order. A "
             f"step is `Engine.step()` plus the `Engine.stats()` the server publishes after it; median and p99 "
             f"over {args.steps} steps after {args.warmup} warm-up steps. The planner charges "
             f"{after['planner_ms']:.3f} ms of host time per step (`Efficiency.step_overhead_s`, agentjax/bench/gpus.py"
             + (f"; {before['planner_ms']:.3f} ms at {before['commit']}" if before else "") + ")."
             + (f" *before*: the code at {before['commit']} (`--base-repo`); *after*: this checkout."
                if before else ""),
             "", "| rows | KV groups | pages per row | code | median ms / step | p99 ms | step alone, median ms |",
             "|---|---|---|---|---|---|---|"]
    for _, code, r in before_then_after(before, after, "rows"):
        lines.append(f"| {r['rows']} | {r['groups']} | {r['pages_per_row']:,} | {code} | **{r['median_ms']:.2f}** | "
                     f"{r['p99_ms']:.2f} | {r['step_median_ms']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(REPO / "scripts"))
    import base_checkout
    from benchmarks_md import publish

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=142_000)
    parser.add_argument("--page-tokens", type=int, default=16, help="tokens per page (the engine's block_size)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--cases", type=lambda s: tuple(int(x) for x in s.split("x")), nargs="+",
                        default=list(CASES), help="ROWSxGROUPS, e.g. 256x7 48x2")
    base_checkout.add_arguments(parser, REPO / "BENCHMARKS.md")
    args = parser.parse_args(argv)
    passed = [f"--context {args.context}", f"--page-tokens {args.page_tokens}", f"--steps {args.steps}",
              f"--warmup {args.warmup}", "--cases " + " ".join(f"{r}x{g}" for r, g in args.cases)]
    before, after = base_checkout.before_and_after(args, __file__, lambda: measure(args), " ".join(passed).split())
    if after is None:
        return 0
    command = "python scripts/bench_host_step.py " + " ".join(passed) + (" --base-repo ../base" if before else "")
    publish(markdown(after, before, command, args), not args.no_write, args.benchmarks_md)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] or str(REPO))
    raise SystemExit(main())
