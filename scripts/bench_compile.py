"""Compile time and step time of the embedded model's jitted step, this checkout against a baseline
revision, side by side. Writes the "## Compile time" section of BENCHMARKS.md.

    .venv/bin/python scripts/bench_compile.py --baseline-rev 9894de1 [--repeats 21] [--rounds 3] [--no-write]

Each side runs in its own process with the persistent XLA cache off, so every new shape compiles
from scratch. The baseline is a `git worktree` of `--baseline-rev` put first on PYTHONPATH. The two
sides alternate for `--rounds` rounds (machine noise hits both alike) and each figure is the median
over rounds. Compile time of a shape = its first call minus the median of the calls after it.
"""
from __future__ import annotations

import datetime
import json
import os
import statistics
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks_md import benchmark_parser, publish
from compile_timing import DEFINITIONS

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Compile time (SmolLM2-135M, CPU)"

MEASURE = r'''
import json, sys
sys.path.insert(0, sys.argv[2])
from compile_timing import time_cases
from agentjax.models import load_model
from agentjax.runner.model_runner import ModelRunner
cfg, params, _ = load_model(None)
runner = ModelRunner(cfg, params, num_pages=1024, page_size=16)
cases = {
    "prefill 16": [(list(range(100, 116)), 0, list(range(1, 3)))],
    "prefill 512": [(list(range(100, 612)), 0, list(range(1, 33)))],
    "decode x8 at 512": [([5], 512, list(range(1 + 40 * i, 40 + 40 * i))) for i in range(8)],
}
print(json.dumps(time_cases(runner, cases, int(sys.argv[1]))))
'''


def measure(pythonpath: Path, repeats: int) -> dict:
    env = {**os.environ, "AGENTJAX_XLA_CACHE": "off", "PYTHONPATH": str(pythonpath)}
    result = subprocess.run([sys.executable, "-c", MEASURE, str(repeats), str(REPO / "scripts")], env=env,
                            capture_output=True, text=True, check=True, cwd=pythonpath)
    return json.loads(result.stdout.strip().splitlines()[-1])


def median_of(results: list[dict]) -> dict:
    return {shape: {key: statistics.median(r[shape][key] for r in results) for key in results[0][shape]}
            for shape in results[0]}


def main() -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--baseline-rev", required=True, help="git revision to compare against")
    parser.add_argument("--repeats", type=int, default=21, help="steady-state calls per shape (median)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of both sides (median)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        baseline_dir = Path(tmp) / "baseline"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(baseline_dir), args.baseline_rev],
                       check=True, capture_output=True)
        try:
            runs: dict[str, list[dict]] = {"current": [], "baseline": []}
            for round_index in range(args.rounds):
                print(f"round {round_index + 1}/{args.rounds}: this checkout, then {args.baseline_rev}", flush=True)
                runs["current"].append(measure(REPO, args.repeats))
                runs["baseline"].append(measure(baseline_dir, args.repeats))
            current, baseline = (median_of(runs[side]) for side in ("current", "baseline"))
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(baseline_dir)], check=False)
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    lines = [SECTION, "",
             f"`python scripts/bench_compile.py --baseline-rev {args.baseline_rev} --repeats {args.repeats} "
             f"--rounds {args.rounds}` on "
             f"{datetime.date.today()}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
             f"XLA cache off, float32, fast numerics; this checkout ({head}, working tree) against "
             f"{args.baseline_rev}, one process per side and round, sides alternating; medians over rounds. "
             + DEFINITIONS, "",
             "| shape | compile, baseline | compile, this | step, baseline | step, this |", "|---|---|---|---|---|"]
    for name in current:
        b, c = baseline[name], current[name]
        lines.append(f"| {name} | {b['compile_s']:.1f} s | {c['compile_s']:.1f} s | "
                     f"{b['step_s'] * 1e3:.0f} ms | {c['step_s'] * 1e3:.0f} ms |")
    publish("\n".join(lines), not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
