"""scripts/suite_report_md.py: the BENCHMARKS.md section it writes from a real suite report (a pytest run
of one small file) holds the run's totals, each process's peaks and the bounds, and replaces its own
section when written twice; the starting state says whether the set-up and the compile cache were there."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import suite_report_md  # noqa: E402


def test_the_section_holds_a_real_runs_totals_and_is_replaced_in_place(tmp_path):
    report = tmp_path / "report.json"
    run = subprocess.run([sys.executable, "-m", "pytest", "tests/test_suite_probes.py", "-q", "-p", "no:cacheprovider",
                          f"--suite-report={report}"], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, AGENTJAX_XLA_CACHE=str(tmp_path / "xla")))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    data = json.loads(report.read_text())
    body = suite_report_md.section(data, "bash scripts/bootstrap.sh quick", 75.0, "it started with x and y")
    assert body.startswith("## Test suite (`bash scripts/bootstrap.sh quick`)\n")
    assert f"{data['totals']['tests']} tests: 1.2 minutes for the command, set-up included (it started with x and y)" in body
    assert "| main |" in body and "held." in body and "| tests/test_suite_probes.py |" in body
    benchmarks = tmp_path / "BENCHMARKS.md"
    benchmarks.write_text("# Benchmarks\n\n## Other\n\nkept\n")
    suite_report_md.write_section(body, benchmarks)
    suite_report_md.write_section(body.replace("1.2 minutes", "9.9 minutes"), benchmarks)
    text = benchmarks.read_text()
    assert text.count("## Test suite (`bash scripts/bootstrap.sh quick`)") == 1 and "9.9 minutes" in text
    assert "## Other\n\nkept" in text


def test_the_starting_state_sees_the_set_up_and_the_compile_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTJAX_VENV", str(tmp_path / "venv"))
    monkeypatch.setenv("AGENTJAX_XLA_CACHE", str(tmp_path / "xla"))
    assert suite_report_md.starting_state() == "it started with no virtual environment and an empty compile cache"
    (tmp_path / "venv").mkdir()
    (tmp_path / "venv" / ".agentjax-installed").touch()
    (tmp_path / "xla").mkdir()
    (tmp_path / "xla" / "entry").write_bytes(b"x")
    assert suite_report_md.starting_state() == \
        "it started with an installed virtual environment and a filled compile cache"
