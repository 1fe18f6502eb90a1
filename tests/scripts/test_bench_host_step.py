"""scripts/bench_host_step.py at a small size: the stubbed runner drives the real engine host path (the
KV manager, the scheduler, the kept page tables) step after step, and the section it prints has one row
per case with the planner's host charge beside it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_small_run_prints_a_row_per_case_next_to_the_planners_charge():
    run = subprocess.run([sys.executable, "scripts/bench_host_step.py", "--cases", "8x2", "4x1", "--steps", "5",
                          "--warmup", "1", "--context", "2000", "--no-write"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("| 8 | 2 |") or line.startswith("| 4 | 1 |")]
    assert len(rows) == 2 and all("| after |" in row and "| 125 |" in row for row in rows)
    assert "The planner charges 3.000 ms of host time per step" in run.stdout
