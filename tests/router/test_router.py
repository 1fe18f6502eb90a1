"""The router app over fake replicas: forwarding unchanged, retry once before any output, no retry
after it, sessions that move off a failed replica, 503 when none is healthy, and its metrics."""
from __future__ import annotations

import json
import re

import pytest
from starlette.testclient import TestClient

from agentjax.router.policies import make_policy
from agentjax.router.replicas import build_replicas
from agentjax.router.router import Router, create_router_app
from tests.router.fakes import FakeCluster, chat_stream_events


def router_client(cluster: FakeCluster, policy: str = "sticky") -> TestClient:
    replicas = build_replicas(cluster.urls)
    router = Router(replicas, make_policy(policy, replicas), health_interval_s=3600, transport=cluster.transport)
    return TestClient(create_router_app(router))


def metric(client: TestClient, name: str, **labels: str) -> float:
    text = client.get("/metrics").text
    label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = rf"^{re.escape(name)}" + (rf"\{{{re.escape(label_text)}\}}" if labels else "") + r" (\S+)$"
    match = re.search(pattern, text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def test_a_stream_passes_through_byte_for_byte_with_auth_and_the_chosen_replica_named():
    cluster = FakeCluster(2)
    with router_client(cluster) as client:
        reply = client.post("/v1/chat/completions", json=CHAT,
                            headers={"Authorization": "Bearer secret", "X-Session-ID": "s1"})
    served = cluster.by_url(reply.headers["x-agentjax-replica"])
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
    assert reply.content == b"".join(chat_stream_events(f"chatcmpl-{served.url}", ["one", " two", " three"]))
    forwarded = served.received[0]
    assert forwarded.headers["authorization"] == "Bearer secret" and forwarded.headers["x-session-id"] == "s1"
    assert json.loads(forwarded.content) == CHAT
    assert reply.headers["x-agentjax-route-reason"] == "new_session"


def test_a_sessions_turns_stay_on_one_replica_and_other_routes_go_to_the_least_loaded():
    cluster = FakeCluster(3)
    with router_client(cluster) as client:
        served = {client.post("/v1/chat/completions", json={**CHAT, "session_id": "s"}).headers["x-agentjax-replica"]
                  for _ in range(4)}
        models = [client.get("/v1/models").headers["x-agentjax-replica"] for _ in range(3)]
    assert len(served) == 1
    assert set(models) == set(cluster.urls) - served  # the replicas routed to least take turns


@pytest.mark.parametrize("mode", ["refuse", "drop", "break_before_output", "status_503"])
def test_a_replica_that_fails_before_any_output_is_replaced_once_without_a_duplicate_reply(mode):
    cluster = FakeCluster(2)
    with router_client(cluster) as client:
        home = client.post("/v1/chat/completions", json={**CHAT, "session_id": "s"}).headers["x-agentjax-replica"]
        cluster.by_url(home).mode = mode
        reply = client.post("/v1/chat/completions", json={**CHAT, "session_id": "s"})
        other = reply.headers["x-agentjax-replica"]
        assert other != home and reply.status_code == 200
        assert reply.content == b"".join(chat_stream_events(f"chatcmpl-{other}", ["one", " two", " three"]))
        reason = {"refuse": "connect_error", "drop": "disconnected", "break_before_output": "broken_before_output",
                  "status_503": "status_503"}[mode]
        assert metric(client, "agentjax:router_retries_total", reason=reason) == 1
        assert metric(client, "agentjax:router_session_migrations_total", reason="replica_down") == 1
        health = client.get("/health").json()["replicas"]
        # a refused connection or a broken reply marks the replica down at once; a dropped connection
        # before any reply (a kept-alive connection closing looks the same) or a 503 counts one failed check
        assert any(r["url"] == home and r["healthy"] is (mode in ("drop", "status_503")) for r in health)
        next_turn = client.post("/v1/chat/completions", json={**CHAT, "session_id": "s"})
        assert next_turn.headers["x-agentjax-replica"] == other  # the session stays where it moved


def test_an_anthropic_stream_that_breaks_after_its_opening_events_is_retried():
    cluster = FakeCluster(2)
    with router_client(cluster, "queue") as client:
        cluster.replicas[0].mode = "break_before_output"
        body = {"model": "m", "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        reply = client.post("/v1/messages", json=body)
    assert reply.headers["x-agentjax-replica"] == cluster.replicas[1].url
    assert reply.text.count("message_start") == 2  # one event: its name line and its type field


def test_a_replica_that_fails_after_output_ends_the_stream_with_an_error_event_and_is_not_retried():
    cluster = FakeCluster(2)
    with router_client(cluster) as client:
        home = client.post("/v1/chat/completions", json={**CHAT, "session_id": "s"}).headers["x-agentjax-replica"]
        cluster.by_url(home).mode = "break_after_output"
        reply = client.post("/v1/chat/completions", json={**CHAT, "session_id": "s"})
        assert reply.headers["x-agentjax-replica"] == home
        events = [line for line in reply.text.split("\n\n") if line]
        assert '"one"' in events[1] and '"replica_failed"' in events[-2] and events[-1] == "data: [DONE]"
        assert len(cluster.replicas[0].received) + len(cluster.replicas[1].received) == 2  # no second try
        assert metric(client, "agentjax:router_broken_streams_total", replica=home) == 1
        moved = client.post("/v1/chat/completions", json={**CHAT, "session_id": "s"})
        assert moved.headers["x-agentjax-replica"] != home and moved.headers["x-agentjax-route-reason"] == "moved"


def test_503_with_a_clear_message_when_no_replica_is_healthy_in_each_apis_shape():
    cluster = FakeCluster(2)
    for replica in cluster.replicas:
        replica.mode = "refuse"
    with router_client(cluster) as client:
        openai_reply = client.post("/v1/chat/completions", json=CHAT)
        anthropic_reply = client.post("/v1/messages", json={"model": "m", "max_tokens": 1, "messages": []})
        health = client.get("/health")
        unavailable = metric(client, "agentjax:router_no_healthy_replica_total")
    assert openai_reply.status_code == 503 and openai_reply.json()["error"]["code"] == "no_healthy_replica"
    message = openai_reply.json()["error"]["message"]
    assert message.startswith("no healthy replica") and all(url in message for url in cluster.urls)
    assert anthropic_reply.status_code == 503 and anthropic_reply.json()["type"] == "error"
    assert health.status_code == 503 and unavailable == 2


def test_the_last_healthy_replica_failing_gives_503_after_one_retry():
    cluster = FakeCluster(2)
    with router_client(cluster) as client:
        for replica in cluster.replicas:
            replica.mode = "refuse"
        reply = client.post("/v1/chat/completions", json=CHAT)
        assert reply.status_code == 503 and "failed on this request" in reply.json()["error"]["message"]
        assert metric(client, "agentjax:router_retries_total", reason="connect_error") == 1


def test_a_responses_chain_and_its_lookups_stay_on_the_replica_that_stored_it():
    cluster = FakeCluster(3)
    with router_client(cluster, "queue") as client:
        first = client.post("/v1/responses", json={"model": "m", "input": "hi"})
        owner = first.headers["x-agentjax-replica"]
        chained = client.post("/v1/responses", json={"model": "m", "input": "more",
                                                    "previous_response_id": first.json()["id"]})
        lookup = client.get(f"/v1/responses/{first.json()['id']}")
    # even the queue-depth baseline sends a chain home: only the owner stores the conversation
    for reply in (chained, lookup):
        assert reply.headers["x-agentjax-replica"] == owner
        assert reply.headers["x-agentjax-route-reason"] == "response_owner"


def test_a_responses_chain_sticks_under_the_sticky_policy():
    cluster = FakeCluster(3)
    with router_client(cluster, "sticky") as client:
        reply = client.post("/v1/responses", json={"model": "m", "input": "hi"})
        owner = reply.headers["x-agentjax-replica"]
        for _ in range(3):
            reply = client.post("/v1/responses", json={"model": "m", "input": "more",
                                                      "previous_response_id": reply.json()["id"]})
            assert reply.headers["x-agentjax-replica"] == owner
            assert reply.headers["x-agentjax-route-reason"] == "response_owner"


def test_metrics_count_requests_per_replica_and_decisions_by_reason():
    cluster = FakeCluster(2)
    with router_client(cluster) as client:
        for session in ("a", "b", "a"):
            client.post("/v1/chat/completions", json={**CHAT, "stream": False}, headers={"X-Session-ID": session})
        total = sum(metric(client, "agentjax:router_requests_total", replica=url) for url in cluster.urls)
        new = metric(client, "agentjax:router_routing_decisions_total", policy="sticky", reason="new_session")
        kept = metric(client, "agentjax:router_routing_decisions_total", policy="sticky", reason="session")
    assert (total, new, kept) == (3, 2, 1)


def test_a_client_that_leaves_before_its_reply_cancels_the_forwarding_and_frees_the_replica():
    import asyncio

    cluster = FakeCluster(1)
    cluster.replicas[0].mode = "slow"
    replicas = build_replicas(cluster.urls)
    router = Router(replicas, make_policy("sticky", replicas), health_interval_s=3600, transport=cluster.transport)

    class LeavingClient:  # a Starlette request whose client disconnects after the first check
        method, headers = "POST", {}
        url = type("URL", (), {"path": "/v1/chat/completions", "query": ""})()
        checks = 0

        async def is_disconnected(self):
            self.checks += 1
            return self.checks > 1

    async def scenario():
        await router.monitor.check_all()
        started = asyncio.get_running_loop().time()
        replicas[0].in_flight = 1  # as `handle` counts it before forwarding
        forwarded = await router._forward_unless_client_leaves(LeavingClient(), replicas[0], [], b"{}")
        return forwarded, asyncio.get_running_loop().time() - started

    forwarded, seconds = asyncio.run(scenario())
    assert forwarded is None and seconds < 5
    assert cluster.replicas[0].cancelled == 1 and replicas[0].in_flight == 0
