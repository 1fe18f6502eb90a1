"""Engine benchmark on the embedded model: cached vs cold TTFT, host share of step time, and
total tokens/s at several session concurrencies. Writes the "## Engine" section of BENCHMARKS.md.

    .venv/bin/python scripts/bench_engine.py [--repeats 3] [--no-write]

Every figure is taken after a warm-up that compiles the shapes it uses, and is a median of repeats.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentjax import LLM, SamplingParams  # noqa: E402
from agentjax.config import EngineConfig  # noqa: E402
from agentjax.engine import Engine  # noqa: E402
from benchmarks_md import write_section  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Engine (SmolLM2-135M, CPU)"


def _engine(llm: LLM, **settings) -> Engine:
    base = dict(num_kv_blocks=1024, max_num_batched_tokens=2048, max_num_seqs=64)
    return Engine(llm.model_config, llm.params, EngineConfig(**{**base, **settings}), llm.tokenizer)


def _ttft(engine: Engine, prompt: list[int]) -> float:
    started = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    for _ in engine.run_until_done():
        pass
    return time.perf_counter() - started


def bench_ttft(llm: LLM, repeats: int) -> tuple[float, float]:
    """Median TTFT of a 2K-token history plus 64 new tokens: cold, and with the history cached."""
    rng = np.random.default_rng(0)
    cold, cached = [], []
    for repeat in range(repeats + 1):  # the first round compiles
        history = rng.integers(1000, 40000, 2048).tolist()
        turn = history + rng.integers(1000, 40000, 64).tolist()
        engine = _engine(llm)
        cold_s = _ttft(engine, turn)
        engine = _engine(llm)
        _ttft(engine, history)  # turn 1 leaves the history cached
        cached_s = _ttft(engine, turn)
        if repeat:
            cold.append(cold_s)
            cached.append(cached_s)
    return statistics.median(cold), statistics.median(cached)


def bench_sessions(llm: LLM, num_sessions: int, turns: int = 3, new_tokens: int = 48, output_tokens: int = 32):
    """Concurrent sessions whose turns grow by `new_tokens`: total tokens/s and host share."""
    rng = np.random.default_rng(num_sessions)
    engine = _engine(llm)
    contexts = [rng.integers(1000, 40000, 256).tolist() for _ in range(num_sessions)]
    sampling = SamplingParams(max_tokens=output_tokens, temperature=0, ignore_eos=True)
    total_tokens = 0
    step_s = device_s = 0.0
    started = time.perf_counter()
    for _ in range(turns):
        ids = {}
        for index, context in enumerate(contexts):
            ids[engine.add_request(context, sampling, session_id=f"s{index}")] = index
            total_tokens += len(context)
        replies = {rid: [] for rid in ids}
        while engine.has_unfinished():
            step_started = time.perf_counter()
            outputs = engine.step()
            step_s += time.perf_counter() - step_started
            device_s += engine.runner.last_device_s
            for out in outputs:
                replies[out.request_id].extend(out.new_token_ids)
        for rid, index in ids.items():
            total_tokens += len(replies[rid])
            contexts[index] = contexts[index] + replies[rid] + rng.integers(1000, 40000, new_tokens).tolist()
    wall = time.perf_counter() - started
    return total_tokens / wall, 1 - device_s / step_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = parser.parse_args()
    llm = LLM()
    cold, cached = bench_ttft(llm, args.repeats)
    print(f"TTFT 2K history + 64 new: cold {cold:.3f}s, cached {cached:.3f}s, speed-up {cold / cached:.1f}x")
    rows = []
    for sessions in (1, 4, 16):
        bench_sessions(llm, sessions, turns=1)  # warm-up: compile this concurrency's shapes
        runs = [bench_sessions(llm, sessions) for _ in range(args.repeats)]
        tps = statistics.median(r[0] for r in runs)
        host = statistics.median(r[1] for r in runs)
        rows.append((sessions, tps, host))
        print(f"{sessions:>2} sessions: {tps:8.1f} total tokens/s, host share of step time {100 * host:.1f}%")
    if args.no_write:
        return 0
    lines = [
        SECTION,
        "",
        f"Command: `.venv/bin/python scripts/bench_engine.py --repeats {args.repeats}` ({datetime.date.today()}; "
        f"{platform.machine()} VM, 2 cores, Python {platform.python_version()}, numerics fast, float32). "
        "Medians of the repeats, each after a compiling warm-up. The machine was shared with other work.",
        "",
        "| figure | value | goal |",
        "|---|---|---|",
        f"| TTFT, 2K-token history + 64 new tokens, cold | {cold * 1000:.0f} ms | |",
        f"| TTFT, same turn with the history cached | {cached * 1000:.0f} ms | |",
        f"| cached speed-up | {cold / cached:.1f}x | >= 5x |",
    ]
    for sessions, tps, host in rows:
        lines.append(f"| total tokens/s (input incl. cached + output), {sessions} concurrent sessions | {tps:.0f} | |")
    for sessions, tps, host in rows:
        goal = "< 15%" if sessions == 16 else ""
        lines.append(f"| host share of step time, {sessions} sessions | {100 * host:.1f}% | {goal} |")
    lines += [
        "",
        "Sessions: 256-token start, 3 turns, each turn adds the reply and 48 new tokens, 32 output tokens. "
        "Host share = 1 - (time from dispatching the jitted step to its tokens on the host) / (engine.step wall time).",
        "",
    ]
    write_section("\n".join(lines), ROOT / "BENCHMARKS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
