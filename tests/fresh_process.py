"""Run one test's body in a new Python process, for the few tests whose own working set is near the
suite's memory bound (tests/suite_report.py): in a long-lived pytest worker, the memory earlier tests
left resident would add to theirs. The child's peak still counts against the bound, as a process the
test started."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_in_fresh_process(test_file: str, function: str, timeout_s: float = 900) -> None:
    """Import `test_file` in a new interpreter (from the project root, as pytest would) and call its
    module-level `function`; fail with the child's output if it raises."""
    code = (
        "import runpy, sys\n"
        "import tests.conftest\n"  # the persistent compilation cache on, as in the suite
        f"runpy.run_path({str(Path(test_file).resolve())!r})[{function!r}]()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s)
    assert done.returncode == 0, f"{function} failed in its own process:\n{done.stdout}\n{done.stderr[-6000:]}"
