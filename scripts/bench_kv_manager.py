"""Benchmark: agentjax's KV cache manager side by side with vLLM 0.33's, on the agent traces.

Drives ../shared/bench/vllm_baseline/bench.py (`--mode kv --engine vllm agentjax`) in the vLLM
venv that its setup.sh builds, so both managers replay the identical closed-loop stream in one
process; repeats that process, and writes medians and ratios to the "## KV cache manager" section
of BENCHMARKS.md. A benchmark, not a test: CI does not run it.

    python scripts/bench_kv_manager.py --num-traces 20 -C 16 64 --num-blocks 20000 --repeats 5
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks_md import write_section

REPO = Path(__file__).resolve().parents[1]
HARNESS = REPO.parent / "shared" / "bench" / "vllm_baseline"
SECTION = "## KV cache manager"
def run_harness(args: argparse.Namespace) -> list[dict]:
    command = [str(args.vllm_python), "bench.py", "--mode", "kv", "--engine", "vllm", "agentjax",
               "-C", *map(str, args.concurrency), "--num-blocks", str(args.num_blocks),
               "--block-size", str(args.block_size), "--num-traces", str(args.num_traces),
               "--tokens-per-block", str(args.tokens_per_block)]
    # agentjax needs Python >= 3.12 to pip-install; its kv package runs on the venv's 3.11 from the path.
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, cwd=args.harness, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"bench.py failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def summarise(runs: list[list[dict]], concurrency: list[int]) -> list[dict]:
    rows = []
    for c in concurrency:
        per_engine: dict[str, list[dict]] = {}
        ratios = []
        for results in runs:
            by_engine = {r["engine"]: r for r in results if r["concurrency"] == c}
            for engine, r in by_engine.items():
                per_engine.setdefault(engine, []).append(r)
            vllm, ours = by_engine["vllm-kvcachemanager"], by_engine["agentjax-kvcachemanager"]
            ratios.append(ours["turn_total_us_mean"] / vllm["turn_total_us_mean"])
        row = {"C": c, "ratio_median": statistics.median(ratios), "ratios": ratios}
        for engine, results in per_engine.items():
            key = "vllm" if engine.startswith("vllm") else "agentjax"
            row[key] = {
                "turn_total_us": statistics.median(r["turn_total_us_mean"] for r in results),
                "hit_rate": results[0]["prefix_hit_rate"],
                "hit_rates_equal_across_repeats": len({r["prefix_hit_rate"] for r in results}) == 1,
                "failed_allocs": results[0]["failed_allocate_attempts"],
                "turns": results[0]["completed_turns"],
                "lookup_us": statistics.median(r["get_computed_blocks_us"]["median"] for r in results),
                "allocate_us": statistics.median(r["allocate_slots_us"]["median"] for r in results),
                "free_us": statistics.median(r["free_us"]["median"] for r in results),
            }
        rows.append(row)
    return rows


def markdown(rows: list[dict], args: argparse.Namespace, workload: dict, command: str, conditions: str = "") -> str:
    lines = [
        SECTION, "",
        f"Command: `{command}` (drives `../shared/bench/vllm_baseline/bench.py --mode kv --engine vllm agentjax` "
        f"{args.repeats} times; both managers replay the identical stream in each process run).",
        f"Machine: {platform.machine()} VM with 2 CPU cores (shared with other work), harness Python "
        f"{workload['python']}, vLLM {workload['vllm']} (CPU torch). Workload: {args.num_traces} traces, "
        f"{workload['workload']['sessions']} sessions, {workload['workload']['turns']} turns, "
        f"{args.tokens_per_block} tokens per trace block, mean prompt {workload['workload']['mean_prompt']:.0f} "
        f"tokens; {args.num_blocks} pages of {args.block_size} tokens.",
        "Per-turn total = lookup + allocate (prompt and output reserved at admission) + free, plus vLLM's "
        "`Request` creation, which hashes every block with sha256; agentjax hashes inside its calls. "
        "Times are medians over the repeats of each engine's mean per-turn total; the ratio is the median of "
        "the per-run ratios agentjax / vLLM. The harness's adapter admits with `allocate(prompt)` then "
        "`append(output)`; when the append fails it calls `free`, which rolls the uncommitted admission back "
        "exactly (LRU positions, evicted hashes, stats), so a failed admission leaves no trace, as vLLM's single "
        f"call does. {conditions}".rstrip(), "",
        "| C | vLLM µs/turn | agentjax µs/turn | ratio (median, runs) | vLLM hit | agentjax hit | hit diff | "
        "failed allocs vLLM / agentjax | median lookup / allocate / free µs, vLLM | same, agentjax |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        v, a = row["vllm"], row["agentjax"]
        ratios = ", ".join(f"{r:.2f}" for r in row["ratios"])
        lines.append(
            f"| {row['C']} | {v['turn_total_us']:.0f} | {a['turn_total_us']:.0f} | {row['ratio_median']:.2f} "
            f"({ratios}) | {v['hit_rate']:.4f} | {a['hit_rate']:.4f} | {100 * (a['hit_rate'] - v['hit_rate']):+.3f} pt | "
            f"{v['failed_allocs']} / {a['failed_allocs']} | {v['lookup_us']:.0f} / {v['allocate_us']:.0f} / "
            f"{v['free_us']:.0f} | {a['lookup_us']:.0f} / {a['allocate_us']:.0f} / {a['free_us']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-traces", type=int, default=20)
    parser.add_argument("--concurrency", "-C", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--num-blocks", type=int, default=20_000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--tokens-per-block", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vllm-python", type=Path, default=os.environ.get("VLLM_VENV_PYTHON"),
                        help="Python of the venv the harness's setup.sh builds (default $VLLM_VENV_PYTHON)")
    parser.add_argument("--harness", type=Path, default=HARNESS)
    parser.add_argument("--benchmarks-md", type=Path, default=REPO / "BENCHMARKS.md")
    parser.add_argument("--no-write", action="store_true", help="print the section only")
    args = parser.parse_args(argv)
    if args.vllm_python is None or not Path(args.vllm_python).exists():
        sys.exit(f"vLLM venv missing ({args.vllm_python}): build it with `bash {HARNESS}/setup.sh` (a few "
                 "minutes, offline) and pass its Python as --vllm-python or VLLM_VENV_PYTHON.")
    if not (args.harness / "bench.py").exists():
        sys.exit(f"harness missing: {args.harness}/bench.py not found")
    load_at_start = os.getloadavg()[0]
    runs = []
    for repeat in range(args.repeats):
        results = run_harness(args)
        runs.append(results)
        for r in results:
            print(f"run {repeat + 1}/{args.repeats} C={r['concurrency']} {r['engine']}: "
                  f"{r['turn_total_us_mean']:.0f} µs/turn, hit {r['prefix_hit_rate']:.4f}", flush=True)
    rows = summarise(runs, args.concurrency)
    command = "python scripts/bench_kv_manager.py " + " ".join(argv if argv is not None else sys.argv[1:])
    conditions = (f"Run on {datetime.date.today().isoformat()}; load average {load_at_start:.2f} at the start and "
                  f"{os.getloadavg()[0]:.2f} at the end (the machine's 2 cores are shared: compare the ratios, not the µs).")
    text = markdown(rows, args, runs[0][0], command.strip(), conditions)
    print(text)
    if not args.no_write:
        write_section(text, args.benchmarks_md)
        print(f"wrote {SECTION!r} in {args.benchmarks_md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
