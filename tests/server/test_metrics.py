"""Tests of agentjax/server/metrics.py's page-group gauges: used and reserved bytes, one series per group."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from agentjax.server.metrics import kv_group_metrics

ROWS = [{"group": "kv.0", "used_bytes": 4096, "reserved_bytes": 8192},
        {"group": "kv.1", "used_bytes": 1024, "reserved_bytes": 8192}]


class _Rows:
    def describe(self):
        return []

    def collect(self):
        return kv_group_metrics(ROWS)


def test_each_page_group_gets_a_used_and_a_reserved_bytes_series():
    registry = CollectorRegistry()
    registry.register(_Rows())
    text = generate_latest(registry).decode()
    assert 'agentjax:kv_group_used_bytes{group="kv.0"} 4096.0' in text
    assert 'agentjax:kv_group_used_bytes{group="kv.1"} 1024.0' in text
    assert 'agentjax:kv_group_reserved_bytes{group="kv.0"} 8192.0' in text


def test_each_page_group_gets_the_prompt_tokens_it_alone_could_serve():
    rows = [{**ROWS[0], "hit_tokens": 320}, {**ROWS[1], "hit_tokens": 128}]

    class Rows(_Rows):
        def collect(self):
            return kv_group_metrics(rows)

    registry = CollectorRegistry()
    registry.register(Rows())
    text = generate_latest(registry).decode()
    assert 'agentjax:prefix_cache_group_hits_total{group="kv.0"} 320.0' in text
    assert 'agentjax:prefix_cache_group_hits_total{group="kv.1"} 128.0' in text
