"""Tests of agentjax/server/metrics.py's page-group gauges: used and reserved bytes, one series per group."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from agentjax.server.metrics import kv_group_metrics

ROWS = [{"group": "kv.0", "used_bytes": 4096, "reserved_bytes": 8192},
        {"group": "kv.1", "used_bytes": 1024, "reserved_bytes": 8192}]


class _Rows:
    def __init__(self, stats: dict):
        self.stats = stats

    def describe(self):
        return []

    def collect(self):
        return kv_group_metrics(self.stats)


def _scrape(stats: dict) -> str:
    registry = CollectorRegistry()
    registry.register(_Rows(stats))
    return generate_latest(registry).decode()


def test_each_page_group_gets_a_used_and_a_reserved_bytes_series():
    text = _scrape({"kv_groups": ROWS})
    assert 'agentjax:kv_group_used_bytes{group="kv.0"} 4096.0' in text
    assert 'agentjax:kv_group_used_bytes{group="kv.1"} 1024.0' in text
    assert 'agentjax:kv_group_reserved_bytes{group="kv.0"} 8192.0' in text


def test_a_data_parallel_engine_reports_its_ranks_summed_per_group():
    text = _scrape({"ranks": [{"kv_groups": ROWS}, {"kv_groups": ROWS[:1]}]})
    assert 'agentjax:kv_group_used_bytes{group="kv.0"} 8192.0' in text
    assert 'agentjax:kv_group_used_bytes{group="kv.1"} 1024.0' in text
    assert 'agentjax:kv_group_reserved_bytes{group="kv.0"} 16384.0' in text
