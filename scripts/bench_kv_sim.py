"""Benchmark: `agentjax bench kv-sim` on the AgentX dev traces, written to the "## KV policy simulator"
section of BENCHMARKS.md (issue 14, acceptance 3).

Runs the command itself (one subprocess per configuration, so each row carries its exact command):
device capacity alone at C=32 / 1M and C=128 / 4M tokens, then the same with a host tier of 8x the
device. Hit rates are deterministic (a virtual clock, seeded hints); only the seconds depend on the
machine's load, which the section records. A benchmark, not a test: CI does not run it.

    python scripts/bench_kv_sim.py [--traces '../shared/traces/agentx-dev/*.json.gz'] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks_md import write_section

REPO = Path(__file__).resolve().parents[1]
SECTION = "## KV policy simulator"
POLICIES = "lru,belady,hints,marconi"
CONFIGS = [  # (lanes, device tokens, host tokens)
    (32, "1M", "0"), (128, "4M", "0"), (32, "1M", "8M"), (128, "4M", "32M")]


def run_kv_sim(flags: list[str], out: Path, tag: str) -> tuple[str, dict]:
    """`agentjax bench kv-sim FLAGS --out OUT` in a subprocess of this checkout: the command as a row shows
    it (OUT as r.json) and the summary it wrote. Exits the script if the command fails."""
    command = ["agentjax", "bench", "kv-sim", *flags, "--out", str(out)]
    shown = " ".join(shlex.quote(part) for part in command).replace(str(out), "r.json")
    print(f"[{tag}] {shown}", file=sys.stderr, flush=True)
    python = [sys.executable, "-c", "import sys; from agentjax.cli import main; sys.exit(main(sys.argv[1:]))"]
    done = subprocess.run(python + command[1:], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    if done.returncode:
        sys.exit(f"kv-sim failed (exit {done.returncode}): {shown}")
    return shown, json.loads(out.read_text())


def run(args: argparse.Namespace, lanes: int, hbm: str, host: str, out: Path) -> tuple[str, dict]:
    host_flags = ["--host-tokens", host] if host != "0" else []
    return run_kv_sim(["--traces", args.traces, "--lanes", str(lanes), "--stagger", "10", "--hbm-tokens", hbm,
                       "--policies", POLICIES, *host_flags], out, "bench_kv_sim")


def _pct(value: float) -> str:
    return f"{100 * value:.2f}%"


def section(runs: list[tuple[str, dict]], machine: str) -> str:
    device_only = [(command, s) for command, s in runs if not s["config"]["host_tokens"]]
    with_host = [(command, s) for command, s in runs if s["config"]["host_tokens"]]
    lines = [SECTION, "",
             "Written by `scripts/bench_kv_sim.py`. `agentjax bench kv-sim` replays the 180 AgentX dev traces "
             "(11,564 requests) on a virtual clock against the real `KVCacheManager` (one manager token per "
             "64-token block) with each policy as a `PolicyEvictionOrder`; LRU, Belady's MIN and a cache that never "
             "evicts run in the same command. Model: issue 14 (sessions round robin to C lanes, lane l starts at "
             "l x 10 s, sessions back to back, hints = recorded gap x lognormal(0, 0.5), seed 0; a request hits its "
             "longest resident prefix, makes all its blocks resident, then the policy evicts down to capacity). "
             "An independent simulation of the same model gives LRU 82.61% and Belady 89.09% at C=32 / 1M, "
             "LRU 83.54% and Belady 90.89% at C=128 / 4M, infinite cache 96.31%.", "", machine, "",
             "Device capacity alone (token hit rate; in brackets: fraction of Belady):", "",
             "| C | HBM tokens | LRU | Belady | hints | marconi | infinite | best online / Belady | seconds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for _, s in device_only:
        r, c = s["results"], s["config"]
        frac = lambda name: f"{_pct(r[name]['token_hit_rate'])} ({r[name]['of_belady']:.3f})"  # noqa: E731
        lines.append(f"| {c['lanes']} | {c['hbm_tokens']:,} | {frac('lru')} | {_pct(r['belady']['token_hit_rate'])} | "
                     f"{frac('hints')} | {frac('marconi')} | {_pct(r['infinite']['token_hit_rate'])} | "
                     f"{s['best_online']['policy']} {s['best_online']['of_belady']:.4f} | {s['seconds']:.0f} |")
    lines += ["", "With a host tier of 8x the device (interval retention: every turn's blocks are written to the "
              "host, which evicts with the same policy; total, then device + host, then the fraction of the "
              "infinite cache's rate):", "",
              "| C | HBM / host tokens | LRU | Belady | hints | marconi | infinite | seconds |",
              "|---|---|---|---|---|---|---|---|"]
    for _, s in with_host:
        r, c = s["results"], s["config"]

        def cell(name: str) -> str:
            tiers = r[name]["tiers"]
            return (f"{_pct(r[name]['token_hit_rate'])} = {_pct(tiers['device'])} + {_pct(tiers['host'])} "
                    f"({r[name]['of_infinite']:.4f})")
        lines.append(f"| {c['lanes']} | {c['hbm_tokens']:,} / {c['host_tokens']:,} | {cell('lru')} | "
                     f"{cell('belady')} | {cell('hints')} | {cell('marconi')} | "
                     f"{_pct(r['infinite']['token_hit_rate'])} | {s['seconds']:.0f} |")
    lines += ["", "Commands:", ""] + [f"    {command}" for command, _ in runs]
    return "\n".join(lines) + "\n"


def machine_line(load_before: tuple, load_after: tuple) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"Machine: {os.cpu_count()} CPUs ({cpu}), Python {platform.python_version()}, run on "
            f"{time.strftime('%Y-%m-%d')}. Load average {load_before[0]:.1f} at the start and {load_after[0]:.1f} "
            "at the end (the machine is shared): the seconds are noisy, the hit rates are exact.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", default="../shared/traces/agentx-dev/*.json.gz")
    parser.add_argument("--quick", action="store_true", help="device-only configurations only")
    parser.add_argument("--out", type=Path, default=REPO / "BENCHMARKS.md")
    args = parser.parse_args()
    load_before = os.getloadavg()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for index, (lanes, hbm, host) in enumerate(CONFIGS):
            if args.quick and host != "0":
                continue
            runs.append(run(args, lanes, hbm, host, Path(tmp) / f"r{index}.json"))
    write_section(section(runs, machine_line(load_before, os.getloadavg())), args.out)
    print(f"[bench_kv_sim] wrote the {SECTION!r} section of {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
