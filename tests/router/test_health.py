"""Health checks: when a replica counts as down and up again, its load from /metrics, and the
prefix index fed from its /kv/events."""
from __future__ import annotations

import asyncio

import httpx

from agentjax.router.health import HealthMonitor, reported_load
from agentjax.router.replicas import build_replicas
from tests.router.fakes import FakeCluster


def test_reported_load_reads_agentjax_then_vllm_gauges():
    assert reported_load('agentjax:num_requests_in_server 3.0\nagentjax:num_requests_running 1.0\n') == 3
    assert reported_load('vllm:num_requests_running{model_name="m"} 2.0\n'
                         'vllm:num_requests_waiting{model_name="m"} 5.0\n') == 7
    assert reported_load("something_else 1.0\n") is None


def check_all(cluster: FakeCluster, replicas, rounds: int = 1, **options) -> None:
    async def run():
        async with httpx.AsyncClient(transport=cluster.transport) as client:
            monitor = HealthMonitor(replicas, client, **options)
            for _ in range(rounds):
                await monitor.check_all()

    asyncio.run(run())


def test_a_refused_connection_is_down_at_once_and_a_failing_health_check_after_two_in_a_row():
    cluster = FakeCluster(2)
    replicas = build_replicas(cluster.urls)
    check_all(cluster, replicas)
    assert all(r.healthy for r in replicas)
    cluster.replicas[0].mode = "refuse"
    cluster.replicas[1].health_status = 503
    check_all(cluster, replicas, unhealthy_after=2)
    assert not replicas[0].healthy and "connection refused" in replicas[0].last_error
    assert replicas[1].healthy  # one failed check is not enough
    check_all(cluster, replicas, unhealthy_after=2)
    assert not replicas[1].healthy
    cluster.replicas[0].mode, cluster.replicas[1].health_status = "ok", 200
    check_all(cluster, replicas)
    assert all(r.healthy for r in replicas) and replicas[0].last_error is None


def test_each_check_records_the_reported_load_and_the_kv_events():
    cluster = FakeCluster(2)
    cluster.replicas[0].in_server = 4
    cluster.replicas[0].kv_answer = {"epoch": "e", "block_size": 16, "hashes_per_page": 1, "hit_rule": "prefix",
                                     "next": 2, "snapshot": True, "more": False, "events": [["+", "aa"], ["+", "bb"]]}
    replicas = build_replicas(cluster.urls)
    check_all(cluster, replicas)
    assert replicas[0].reported_in_server == 4 and replicas[0].load == 4
    assert replicas[0].prefix.cached == {"aa", "bb"} and replicas[0].prefix.block_size == 16
    assert not replicas[1].prefix.available  # answered 404: never asked again
