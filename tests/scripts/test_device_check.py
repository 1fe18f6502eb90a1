"""scripts/device_check.py --dry-run: every check runs at small shapes in interpret mode on this CPU,
passes, and the JSON holds each check's `ok` and figures and both speed targets (not enforced)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "device_check.py"


@pytest.mark.slow
def test_dry_run_passes_and_writes_one_json_with_every_check(tmp_path):
    out = tmp_path / "device_check.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)], capture_output=True,
                          text=True, timeout=1200)
    report = json.loads(out.read_text())
    assert done.returncode == 0, (done.stdout, json.dumps(report["checks"], indent=1)[:4000])
    assert report["ok"] is True and report["dry_run"] is True
    checks = report["checks"]
    for name in ("ceilings", "ragged_attention_mixed", "decode_attention_triton", "decode_attention_mosaic",
                 "grouped_matmul_formats", "grouped_matmul_throughput", "mla_decode", "kda_scan_and_decode",
                 "block_sparse_indexer_attention", "dsv4_indexer_attention"):
        assert checks[name]["ok"] is True, (name, checks[name])
    assert checks["ceilings"]["copy_gb_per_s"] > 0 and checks["ceilings"]["matmul_tflop_per_s"] > 0
    assert checks["decode_attention_mosaic"]["block64_stages2_split2"]["races_found"] is False
    assert checks["block_sparse_indexer_attention"]["decode"]["selection_agreement"] == 1.0
    assert checks["kda_scan_and_decode"]["decode_step"]["gb_per_s"] > 0
    assert checks["dsv4_indexer_attention"]["decode"]["selection_equal"] is True
    assert checks["dsv4_indexer_attention"]["decode"]["csa_gb_per_s"] > 0
    for name, target in (("decode_bandwidth_target", 0.8), ("grouped_matmul_target", 0.6)):
        assert checks[name]["target"] == target and checks[name]["enforced"] is False
        assert checks[name]["fraction"] > 0


def test_a_run_without_out_is_refused():
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--out" in done.stderr
