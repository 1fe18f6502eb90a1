"""scripts/soak_serve.py's parts that need no server: its /metrics reader, its disk faults on real page
files, its stall measure and its BENCHMARKS.md rows (kept across runs)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import soak_serve as soak  # noqa: E402

from agentjax.kv.offload.disk import DiskTier  # noqa: E402


def test_metrics_are_read_per_label_set_and_summed_per_family():
    text = ('# HELP x\nagentjax:num_requests_running 2.0\n'
            'agentjax:kv_offload_load_failures_total{reason="checksum",tier="disk"} 3.0\n'
            'agentjax:kv_offload_load_failures_total{reason="missing",tier="disk"} 1.0\n')
    samples = soak.parse_metrics(text)
    assert samples["agentjax:num_requests_running"] == 2.0
    assert soak.total(samples, "agentjax:kv_offload_load_failures_total") == 4.0
    assert soak.labelled(samples, "agentjax:kv_offload_load_failures_total") == {"checksum disk": 3, "missing disk": 1}


def test_each_disk_fault_damages_the_newest_page_files_so_the_tier_rejects_them(tmp_path):
    tier = DiskTier(tmp_path, "ns", 1 << 20)
    keys = [(0, bytes([i]) * 32) for i in range(6)]
    for key in keys:
        tier.write(key, bytes(range(256)) * 4)
    rng = np.random.default_rng(0)
    for kind, key in zip(soak.DISK_FAULTS, keys[-3:][::-1]):  # each fault takes the newest file left intact
        assert soak.damage_page_files(tmp_path, kind, 1, rng) == 1
        if kind == "delete":
            assert not tier._path(key).exists()
        else:
            assert DiskTier._check(key, tier._path(key).read_bytes(), 1024) is not None
            tier._path(key).rename(tmp_path / f"damaged-{kind}")  # out of the newest-files window
    for key in keys[:3]:
        assert DiskTier._check(key, tier._path(key).read_bytes(), 1024) is None


def test_a_stall_counts_only_waiting_without_running_or_progress_after_the_warm_up():
    def sample(seconds, running, waiting, tokens):
        return (seconds, {"agentjax:num_requests_running": running, "agentjax:num_requests_waiting": waiting,
                          "agentjax:generation_tokens_total": tokens}, 0)

    samples = [sample(0, 0, 4, 0), sample(5, 0, 4, 0), sample(10, 1, 3, 5), sample(15, 0, 2, 9),
               sample(20, 0, 2, 9), sample(25, 0, 2, 9), sample(30, 1, 0, 12)]
    assert soak.longest_stall(samples, after_s=8) == 10  # 15 s to 25 s; the start is warm-up
    assert soak.longest_stall(samples, after_s=0) == 10


def test_rows_accumulate_in_one_section(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    path.write_text("# Benchmarks\n\n## Other\n\nkept\n")
    soak.write_row("| 2026-01-01 | 3 | a |", "python scripts/soak_serve.py --minutes 3", "machine", path)
    soak.write_row("| 2026-01-02 | 30 | b |", "python scripts/soak_serve.py", "machine", path)
    text = path.read_text()
    assert text.count(soak.SECTION) == 1 and "kept" in text
    assert text.index("| 2026-01-01 | 3 | a |") < text.index("| 2026-01-02 | 30 | b |")
