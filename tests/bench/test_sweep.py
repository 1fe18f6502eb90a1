"""`agentjax bench sweep-concurrency`: two levels on a tiny preset write a PNG and a JSON file."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from agentjax.bench.sweep import pareto_front
from agentjax.cli import main

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "agentx-dev"


def test_pareto_front():
    points = [(10.0, 100.0), (20.0, 80.0), (5.0, 90.0), (20.0, 50.0), (30.0, 10.0)]
    assert pareto_front(points) == [0, 1, 4]


@pytest.mark.slow
@pytest.mark.skipif(not TRACES.is_dir(), reason=f"no dev traces at {TRACES}")
def test_sweep_writes_png_and_json(tmp_path):
    traces = tmp_path / "traces"
    traces.mkdir()
    for path in sorted(TRACES.glob("*.json.gz"))[:4]:
        shutil.copy(path, traces / path.name)
    out = tmp_path / "sweep"
    code = main(["bench", "sweep-concurrency", "--model", "preset:tiny-dense", "--traces", str(traces),
                 "--levels", "1,2", "--context-scale", "0.005", "--duration", "3",
                 "--min-interactivity", "5", "--out-dir", str(out)])
    assert code == 0
    png = out / "sweep.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    document = json.loads((out / "sweep.json").read_text())
    assert [level["lanes"] for level in document["levels"]] == [1, 2]
    assert all(level["errors"] == 0 and level["requests"] > 0 for level in document["levels"])
    assert set(document["pareto_lanes"]) <= {1, 2} and document["pareto_lanes"]
    assert (out / "c1.json").is_file() and (out / "c2.json").is_file()
