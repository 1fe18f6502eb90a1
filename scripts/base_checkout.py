"""Runs a benchmark script's own measurement at another checkout (`--base-repo`), for the before/after
rows a benchmark writes from one run: the script reruns itself there with `--json FILE` and that
checkout first on PYTHONPATH, and the measurements come back with the checkout's short commit.
It only measures and hands back: the section's text and BENCHMARKS.md are the script's."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


def measure_at(base_repo: Path, script: str, args: list[str] = ()) -> dict:
    """`script`'s `--json` measurement run inside `base_repo`, with its commit under "commit"."""
    base_repo = base_repo.resolve()
    out = base_repo / f".{Path(script).stem}_before.json"
    env = {**os.environ, "PYTHONPATH": str(base_repo)}
    subprocess.run([sys.executable, str(Path(script).resolve()), "--json", str(out), *args], cwd=base_repo,
                   env=env, check=True)
    before = json.loads(out.read_text())
    out.unlink()
    commit = subprocess.run(["git", "-C", str(base_repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    before["commit"] = commit or "unknown"
    return before


def add_arguments(parser: argparse.ArgumentParser, benchmarks_md: Path) -> None:
    """The flags of a before/after benchmark: --base-repo, --json, --benchmarks-md and --no-write."""
    parser.add_argument("--base-repo", type=Path, default=None,
                        help="another checkout to measure first, with the same script (the 'before' rows)")
    parser.add_argument("--json", type=Path, default=None, help="write the measurements as JSON here and stop")
    parser.add_argument("--benchmarks-md", type=Path, default=benchmarks_md)
    parser.add_argument("--no-write", action="store_true", help="print the section only")


def before_and_after(args: argparse.Namespace, script: str, measure, passed: list[str] = ()) -> tuple:
    """(before, after) measurements: before at `--base-repo` (None without it), after here; after is None
    when `--json` asked for this checkout's measurement alone (written there)."""
    if args.json is not None:
        args.json.write_text(json.dumps(measure()))
        return None, None
    before = measure_at(args.base_repo, script, list(passed)) if args.base_repo is not None else None
    return before, measure()


def before_then_after(before: dict | None, after: dict, key: str):
    """(index, code, row) for every row of `after[key]` (a list, or a dict by label), the same row of the
    before run first where it has one; code is "before" or "after"."""
    rows = after[key]
    for index in (rows if isinstance(rows, dict) else range(len(rows))):
        for code, results in (("before", before), ("after", after)):
            if results is not None and index in (results[key] if isinstance(rows, dict) else range(len(results[key]))):
                yield index, code, results[key][index]
