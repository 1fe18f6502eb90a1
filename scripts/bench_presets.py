"""Compile time and step time of each model family's tiny preset on this CPU, side by side in one run.

    .venv/bin/python scripts/bench_presets.py [--presets tiny-dense,tiny-sliding,tiny-minimax-m3,tiny-kimi-k3]
        [--repeats 11] [--numerics fast] [--no-write]

Each preset runs in its own process with the persistent XLA cache off, so each shape compiles from
scratch: a 16-token prefill, a 512-token prefill and 8 decode rows at 512 tokens of context.
Compile = first call minus the median of the calls after it; step = that median. Writes the
"## Tiny presets" section of BENCHMARKS.md.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from benchmarks_md import benchmark_parser, publish
from compile_timing import DEFINITIONS

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Tiny presets: compile and step time (CPU)"
DEFAULT_PRESETS = "tiny-dense,tiny-sliding,tiny-minimax-m3,tiny-kimi-k3"

MEASURE = r'''
import json, sys
sys.path.insert(0, sys.argv[4])
from compile_timing import time_cases
from agentjax.kv.cache_layout import kv_buffer_specs, state_group_ids
from agentjax.models import load_model
from agentjax.models.model_size import model_size
from agentjax.runner.model_runner import ModelRunner
preset, repeats, numerics = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cfg, params, _ = load_model("preset:" + preset)
runner = ModelRunner(cfg, params, num_pages=1024, page_size=16, numerics=numerics)
groups, states = len(kv_buffer_specs(cfg, 16)), set(state_group_ids(cfg))

def tables(first_page, num_pages):
    pages = list(range(first_page, first_page + num_pages))
    return [pages[:1] if g in states else pages for g in range(groups)]

cases = {
    "prefill 16": [(list(range(100, 116)), 0, tables(1, 2))],
    "prefill 512": [(list(range(100, 612)), 0, tables(1, 33))],
    "decode x8 at 512": [([5], 512, tables(1 + 40 * i, 39)) for i in range(8)],
}
print(json.dumps({"params": model_size(cfg).total_params, "groups": groups,
                  "cases": time_cases(runner, cases, repeats)}))
'''


def measure(preset: str, repeats: int, numerics: str) -> dict:
    env = {**os.environ, "AGENTJAX_XLA_CACHE": "off"}
    result = subprocess.run([sys.executable, "-c", MEASURE, preset, str(repeats), numerics, str(REPO / "scripts")],
                            env=env, capture_output=True, text=True, check=True, cwd=REPO)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--presets", default=DEFAULT_PRESETS, help="comma-separated preset names")
    parser.add_argument("--repeats", type=int, default=11, help="steady-state calls per shape (median)")
    parser.add_argument("--numerics", default="fast", choices=("fast", "batch_invariant"))
    args = parser.parse_args()
    results = {}
    for preset in args.presets.split(","):
        print(f"measuring {preset} ...", flush=True)
        results[preset] = measure(preset, args.repeats, args.numerics)
    load = os.getloadavg()[0]
    lines = [SECTION, "",
             f"`python scripts/bench_presets.py --presets {args.presets} --repeats {args.repeats} "
             f"--numerics {args.numerics}` on {datetime.date.today()}, {platform.processor() or platform.machine()}, "
             f"{os.cpu_count()} CPUs (load average {load:.1f} at the end), XLA cache off, float32. One process per "
             "preset. " + DEFINITIONS, "",
             "| preset | parameters | KV groups | shape | compile | step |", "|---|---|---|---|---|---|"]
    for preset, result in results.items():
        for name, case in result["cases"].items():
            lines.append(f"| {preset} | {result['params'] / 1e6:.2f}M | {result['groups']} | {name} | "
                         f"{case['compile_s']:.1f} s | {case['step_s'] * 1e3:.1f} ms |")
    publish("\n".join(lines), not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
