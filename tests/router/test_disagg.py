"""P/D through the router over fake replicas: a new session's prompt goes to the prefill replica's
/kv/prefill (store=true, with the client's credentials) before the decode replica replies; later
turns go to their decode replica directly; a prefill that fails or a Mooncake tier reported out of
use falls back to one replica with a log line; the policy's flags and default."""
from __future__ import annotations

import json
import logging

import pytest
from starlette.testclient import TestClient

from agentjax.cli import build_parser
from agentjax.errors import RouterConfigError
from agentjax.router.health import reported_shared_tier_degraded
from agentjax.router.launcher import default_policy
from agentjax.router.policies import make_policy
from agentjax.router.replicas import build_replicas
from agentjax.router.router import Router, create_router_app
from tests.router.fakes import FakeCluster
from tests.router.test_router import metric

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def pd_client(cluster: FakeCluster, num_prefill: int = 1) -> TestClient:
    replicas = build_replicas([], cluster.urls[:num_prefill], cluster.urls[num_prefill:])
    router = Router(replicas, make_policy("pd", replicas), health_interval_s=3600, transport=cluster.transport)
    return TestClient(create_router_app(router))


def test_a_new_sessions_prompt_is_prefilled_into_mooncake_then_decoded_and_later_turns_go_direct():
    cluster = FakeCluster(3)
    prefill, decoders = cluster.replicas[0], cluster.replicas[1:]
    with pd_client(cluster) as client:
        first = client.post("/v1/chat/completions", json=CHAT,
                            headers={"X-Session-ID": "s", "Authorization": "Bearer secret"})
        second = client.post("/v1/chat/completions", json=CHAT,
                             headers={"X-Session-ID": "s", "Authorization": "Bearer secret"})
        stored = metric(client, "agentjax:router_pd_prefills_total", outcome="stored")
        seconds = metric(client, "agentjax:router_pd_prefill_seconds_count")
    home = first.headers["x-agentjax-replica"]
    assert home in {r.url for r in decoders}
    assert first.headers["x-agentjax-prefill-replica"] == prefill.url
    assert first.headers["x-agentjax-route-reason"] == "pd_disaggregated"
    (path, body, headers), = prefill.kv_calls
    assert path == "/kv/prefill" and body == {"path": "/v1/chat/completions", "body": CHAT, "store": True,
                                              "session_id": None}
    assert headers["authorization"] == "Bearer secret"  # the client's credentials go with the prefill
    assert not prefill.received  # the prefill replica never replies to the client
    assert json.loads(cluster.by_url(home).received[0].content) == CHAT  # the decode replica gets the request
    assert second.headers["x-agentjax-replica"] == home
    assert second.headers["x-agentjax-route-reason"] == "pd_decode_direct" and "x-agentjax-prefill-replica" \
        not in second.headers
    assert (stored, seconds) == (1, 1)


@pytest.mark.parametrize("mode, reason", [("degraded", "kv_tier_degraded"), ("refuse", "connect_error")])
def test_a_failed_prefill_falls_back_to_the_decode_replica_serving_the_request_whole(mode, reason, caplog):
    cluster = FakeCluster(2)
    cluster.replicas[0].kv_transfer_mode = mode
    with caplog.at_level(logging.WARNING, logger="agentjax.router"), pd_client(cluster) as client:
        reply = client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "a"})
        fallbacks = metric(client, "agentjax:router_pd_fallbacks_total", reason=reason)
        failed = metric(client, "agentjax:router_pd_prefills_total", outcome="failed")
        health = {r["url"]: r for r in client.get("/health").json()["replicas"]}
    assert reply.status_code == 200 and reply.headers["x-agentjax-replica"] == cluster.replicas[1].url
    assert "x-agentjax-prefill-replica" not in reply.headers
    assert len(cluster.replicas[1].received) == 1 and (fallbacks, failed) == (1, 1)
    assert any("P/D fallback" in r.message and cluster.replicas[1].url in r.message for r in caplog.records)
    if mode == "degraded":  # known out of use now: the next new session skips the prefill step
        assert health[cluster.replicas[0].url]["mooncake_degraded"] is True
    else:
        assert health[cluster.replicas[0].url]["healthy"] is False


def test_a_prefill_replica_reporting_its_mooncake_tier_out_of_use_is_skipped(caplog):
    cluster = FakeCluster(3)
    cluster.replicas[0].mooncake_degraded = 1.0
    cluster.replicas[1].mooncake_degraded = 0.0
    with caplog.at_level(logging.WARNING, logger="agentjax.router"), pd_client(cluster, num_prefill=2) as client:
        used = client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "a"})
        cluster.replicas[1].mooncake_degraded = 1.0
        client.app.state.router.replicas[1].shared_tier_degraded = True  # as its next health check reads it
        skipped = client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "b"})
        fallbacks = metric(client, "agentjax:router_pd_fallbacks_total", reason="mooncake_degraded")
    assert used.headers["x-agentjax-prefill-replica"] == cluster.replicas[1].url and not cluster.replicas[0].kv_calls
    assert "x-agentjax-prefill-replica" not in skipped.headers and fallbacks == 1
    assert skipped.headers["x-agentjax-replica"] == cluster.replicas[2].url
    assert any("Mooncake tier out of use" in r.message for r in caplog.records)


def test_the_health_check_reads_the_replicas_mooncake_tier_state():
    assert reported_shared_tier_degraded('agentjax:kv_offload_tier_degraded{tier="mooncake"} 1.0\n') is True
    assert reported_shared_tier_degraded('agentjax:kv_offload_tier_degraded{tier="mooncake"} 0.0\n') is False
    assert reported_shared_tier_degraded('agentjax:kv_offload_tier_degraded{tier="disk"} 1.0\n') is None


def test_pd_is_the_default_with_prefill_and_decode_replicas_and_needs_both():
    parse = build_parser().parse_args
    both = ["--prefill-replica", "http://h:1", "--decode-replica", "http://h:2"]
    assert default_policy(parse(["router", *both])) == "pd"
    assert default_policy(parse(["router", "--replica", "http://h:1"])) == "sticky"
    assert default_policy(parse(["router", "--policy", "pools", *both])) == "pools"
    with pytest.raises(RouterConfigError, match="--prefill-replica"):
        make_policy("pd", build_replicas(["http://h:1", "http://h:2"]))
