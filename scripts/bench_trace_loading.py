"""Trace loading: a plain loop against grain's loaders, on the same weka trace files.

    python scripts/bench_trace_loading.py [--traces ../shared/traces/agentx-dev] [--repeats 3] [--write]

Why agentjax does not depend on grain (docs/benchmarks.md): the dev traces load in one process and the
cost is JSON decoding. This times `load_weka_trace_file` over every file in a plain loop, through
grain's `MapDataset` in this process, and with `mp_prefetch` over worker processes (grain is not a
dependency: `pip install grain` to run its arms; without it only the plain loop runs). Medians of
`--repeats` runs; `--write` puts them in BENCHMARKS.md. Take the figures on a quiet machine.
"""
from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from agentjax.bench.traces import load_weka_trace_file  # noqa: E402


def plain(paths: list[str]) -> int:
    return len([load_weka_trace_file(path) for path in paths])


def grain_loader(workers: int):
    def load(paths: list[str]) -> int:
        import grain

        dataset = grain.MapDataset.source(paths).map(load_weka_trace_file).to_iter_dataset()
        if workers:
            dataset = dataset.mp_prefetch(grain.multiprocessing.MultiprocessingOptions(num_workers=workers))
        return len(list(dataset))
    return load


def arms(workers: int) -> dict:
    found = {"plain loop": plain}
    try:
        import grain  # noqa: F401
        from absl import flags

        flags.FLAGS.mark_as_parsed()  # grain reads absl flags; this is not an absl program
    except ImportError:
        print("grain is not installed: only the plain loop runs (pip install grain)", file=sys.stderr)
        return found
    found["grain MapDataset"] = grain_loader(0)
    found[f"grain mp_prefetch, {workers} workers"] = grain_loader(workers)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", default=str(ROOT.parent / "shared" / "traces" / "agentx-dev"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--write", action="store_true", help="write the medians into BENCHMARKS.md")
    args = parser.parse_args()
    paths = sorted(glob.glob(os.path.join(args.traces, "*.json.gz")) + glob.glob(os.path.join(args.traces, "*.json")))
    if not paths:
        raise SystemExit(f"no traces in {args.traces}")
    load_before = os.getloadavg()[0]
    medians = {}
    for name, load in arms(args.workers).items():
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            assert load(paths) == len(paths)
            times.append(time.perf_counter() - started)
        medians[name] = statistics.median(times)
        print(f"{name:<32} median {medians[name]:6.2f} s over {args.repeats} runs ({len(paths)} files)")
    load_after = os.getloadavg()[0]
    if args.write:
        from benchmarks_md import write_section

        rows = "\n".join(f"| {name} | {seconds:.2f} |" for name, seconds in medians.items())
        write_section(f"""## Trace loading: plain loop vs grain

`python scripts/bench_trace_loading.py --repeats {args.repeats} --workers {args.workers} --write`, {len(paths)} trace
files, {date.today()}, {os.cpu_count()} CPUs, load average {load_before:.1f} at the start and {load_after:.1f} at the end.

| loader | median seconds |
|---|---|
{rows}
""")
    return 0


if __name__ == "__main__":
    sys.exit(main())
