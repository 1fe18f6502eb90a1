"""Runs a benchmark script's own measurement at another checkout (`--base-repo`), for the before/after
rows a benchmark writes from one run: the script reruns itself there with `--json FILE` and that
checkout first on PYTHONPATH, and the measurements come back with the checkout's short commit."""
from __future__ import annotations

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
