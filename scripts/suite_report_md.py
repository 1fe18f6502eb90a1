"""Writes the "## Test suite" section of BENCHMARKS.md from the suite report (tests/suite_report.py): run
time and load, CPU seconds, XLA executables built, each test process's peak memory and mappings, and
the costliest files. Either runs the suite itself or reads a report a run already wrote; each command
(`test`, `quick`) gets its own section.

    python scripts/suite_report_md.py                      # runs `bash scripts/bootstrap.sh test`, then writes
    python scripts/suite_report_md.py --report run.json    # a report from `... test --suite-report=run.json`
    python scripts/suite_report_md.py --command "bash scripts/bootstrap.sh quick"
    python3 scripts/suite_report_md.py --benchmarks ../agentjax/BENCHMARKS.md   # from a fresh clone

When it runs the command itself it says whether the set-up and the compile cache were there before
(a fresh clone with a fresh HOME has neither).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmarks_md import write_section  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GB = 10**9
SHOWN = 20


def run_suite(command: list[str], report: Path) -> float:
    started = time.perf_counter()
    subprocess.run([*command, f"--suite-report={report}"], cwd=REPO, check=False)
    return time.perf_counter() - started


def memory_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return 0.0


def package_of(path: str) -> str:
    parts = path.split("/")
    return parts[1] if len(parts) > 2 else "tests/ (top level)"


def starting_state() -> str:
    """Whether the command found a set-up virtual environment and a filled XLA compile cache."""
    venv = Path(os.environ.get("AGENTJAX_VENV", REPO / ".venv"))
    setting = os.environ.get("AGENTJAX_XLA_CACHE", "")
    cache = Path(setting) if setting else Path.home() / ".cache" / "agentjax" / "xla"
    set_up = "an installed virtual environment" if (venv / ".agentjax-installed").exists() else "no virtual environment"
    filled = cache.is_dir() and any(cache.iterdir())
    return f"it started with {set_up} and {'a filled' if filled else 'an empty'} compile cache"


def section(report: dict, command: str, command_wall_s: float | None, state: str | None = None) -> str:
    totals, files = report["totals"], report["files"]
    load0, load1 = totals["load_at_start"][0], totals["load_at_end"][0]
    started = datetime.datetime.fromtimestamp(totals.get("started_at", time.time()), datetime.UTC)
    wall = ""
    if command_wall_s:
        wall = f"{command_wall_s / 60:.1f} minutes for the command, set-up included ({state}); "
    lines = [
        f"## Test suite (`{command}`)", "",
        f"Command: `{command}`; written by `python scripts/suite_report_md.py` from the suite report "
        f"(tests/suite_report.py, `--suite-report=PATH`); the run started {started:%Y-%m-%d %H:%M} UTC, "
        f"{platform.machine()}, {totals['cpus']} CPU cores, {memory_gb():.0f} GiB; load average {load0:.1f} at the "
        f"start and {load1:.1f} at the end (wall times grow with the load; CPU seconds and compile counts do not).",
        "",
        f"{totals['tests']} tests: {wall}pytest ran {totals['run_wall_s'] / 60:.1f} minutes; "
        f"{totals['cpu_s'] / 60:.0f} CPU-minutes in the test processes and {totals['child_cpu_s'] / 60:.0f} in the "
        f"processes they started (servers); {totals['compiles']:,} XLA executables built "
        f"({totals['compile_s'] / 60:.0f} minutes compiling, {totals['trace_s'] / 60:.0f} tracing, "
        f"{totals['lower_s'] / 60:.0f} lowering), {totals['cache_loads']:,} loaded from the persistent compilation cache.",
        "",
        "| process | peak resident GB | peak memory mappings | processes it started: peak GB, mappings | CPU s |",
        "|---|---|---|---|---|",
    ]
    for worker, process in sorted(report["processes"].items()):
        lines.append(f"| {worker} | {process['peak_rss'] / GB:.2f} | {process['peak_maps']:,} | "
                     f"{process['child_peak_rss'] / GB:.2f}, {process['child_peak_maps']:,} | {process['cpu_s']:.0f} |")
    bounds = report["bounds"]
    breaches = report["memory_breaches"]
    lines += ["", f"Bounds: {bounds['max_rss_gb']:g} GB resident and {bounds['max_maps']:,} mappings per process: "
              + ("held." if not breaches else f"{len(breaches)} breaches, first: {breaches[0]}"), ""]
    lines += ["By package:", "", "| package | tests | wall s | CPU s | started processes' CPU s | executables built |",
              "|---|---|---|---|---|---|"]
    packages: dict[str, dict] = defaultdict(lambda: defaultdict(float))
    for path, row in files.items():
        for key in ("tests", "wall_s", "cpu_s", "child_cpu_s", "compiles"):
            packages[package_of(path)][key] += row[key]
    for name, row in sorted(packages.items(), key=lambda item: -item[1]["cpu_s"]):
        lines.append(f"| {name} | {row['tests']:.0f} | {row['wall_s']:.0f} | {row['cpu_s']:.0f} | "
                     f"{row['child_cpu_s']:.0f} | {row['compiles']:,.0f} |")
    lines += ["", f"The {SHOWN} files with the most CPU seconds (their own and their servers'):", "",
              "| file | tests | wall s | CPU s | servers' CPU s | built | cache loads | compile s | peak GB | maps |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    costliest = sorted(files.items(), key=lambda item: -(item[1]["cpu_s"] + item[1]["child_cpu_s"]))[:SHOWN]
    for path, row in costliest:
        lines.append(f"| {path} | {row['tests']} | {row['wall_s']:.0f} | {row['cpu_s']:.0f} | {row['child_cpu_s']:.0f} | "
                     f"{row['compiles']:,} | {row['cache_loads']:,} | {row['compile_s']:.0f} | "
                     f"{row['peak_rss'] / GB:.2f} | {row['peak_maps']:,} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", type=Path, help="a report written by --suite-report (default: run the suite)")
    parser.add_argument("--command", default="bash scripts/bootstrap.sh test",
                        help="the command that runs the suite (default: %(default)s)")
    parser.add_argument("--print", action="store_true", help="print the section instead of writing BENCHMARKS.md")
    parser.add_argument("--benchmarks", type=Path, default=REPO / "BENCHMARKS.md",
                        help="the BENCHMARKS.md to write (default: this checkout's)")
    args = parser.parse_args()
    command_wall_s = state = None
    report_path = args.report
    if report_path is None:
        report_path = Path(tempfile.mkdtemp()) / "suite-report.json"
        state = starting_state()
        command_wall_s = run_suite(args.command.split(), report_path)
    body = section(json.loads(report_path.read_text()), args.command, command_wall_s, state)
    if args.print:
        print(body)
    else:
        write_section(body, args.benchmarks)


if __name__ == "__main__":
    main()
