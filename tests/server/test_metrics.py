"""Tests of agentjax/server/metrics.py's page-group series: used and reserved bytes and the prompt tokens each
group alone could serve, one series per group."""
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


def test_each_page_group_gets_the_prompt_tokens_it_alone_could_serve():
    rows = [{**ROWS[0], "hit_tokens": 320}, {**ROWS[1], "hit_tokens": 128}]
    text = _scrape({"kv_groups": rows})
    assert 'agentjax:prefix_cache_group_hits_total{group="kv.0"} 320.0' in text
    assert 'agentjax:prefix_cache_group_hits_total{group="kv.1"} 128.0' in text
    assert 'agentjax:prefix_cache_group_hits_total{group="kv.0"} 640.0' in _scrape({"ranks": [{"kv_groups": rows}] * 2})
