"""The router among keyed replicas: its own calls carry the operator key (and only they do), its own
routes need that key, a client's prompt is hashed in the client's namespace by a replica, and sessions
of different keys never meet."""
from __future__ import annotations

from starlette.testclient import TestClient

from agentjax.router.policies import make_policy
from agentjax.router.replicas import build_replicas
from agentjax.router.router import Router, create_router_app
from tests.router.fakes import FakeCluster

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
INDEX = {"epoch": "e", "block_size": 4, "hashes_per_page": 1, "hit_rule": "prefix", "snapshot": True, "next": 1,
         "events": []}


def client_of(cluster: FakeCluster, policy: str = "prefix", operator_key: str | None = "ops") -> TestClient:
    replicas = build_replicas(cluster.urls)
    router = Router(replicas, make_policy(policy, replicas), health_interval_s=3600, transport=cluster.transport,
                    operator_key=operator_key)
    return TestClient(create_router_app(router))


def test_health_metrics_and_kv_event_polls_carry_the_operator_key_and_forwarded_requests_the_clients():
    cluster = FakeCluster(1)
    cluster.replicas[0].kv_answer = INDEX
    with client_of(cluster) as client:
        client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer client"})
        client.post("/v1/chat/completions", json=CHAT)
    replica = cluster.replicas[0]
    polled = {path for path, headers in replica.router_calls if headers.get("authorization") == "Bearer ops"}
    assert polled >= {"/health", "/metrics", "/kv/events"}
    assert [r.headers.get("authorization") for r in replica.received] == ["Bearer client", None]


def test_the_routers_own_routes_need_its_operator_key_when_it_has_one():
    cluster = FakeCluster(1)
    with client_of(cluster) as client:
        assert client.get("/health").status_code == 200
        for method, path, body in (("GET", "/metrics", None), ("POST", "/router/drain", {"replica": cluster.urls[0]})):
            assert client.request(method, path, json=body).status_code == 401
            assert client.request(method, path, json=body, headers={"x-api-key": "wrong"}).status_code == 401
            assert client.request(method, path, json=body, headers={"Authorization": "Bearer ops"}).status_code == 200
    with client_of(cluster, operator_key=None) as client:
        assert client.get("/metrics").status_code == 200


def test_a_clients_prompt_is_hashed_by_a_replica_in_the_clients_namespace():
    cluster = FakeCluster(1)
    replica = cluster.replicas[0]
    replica.kv_answer = INDEX
    tokens = list(range(1, 13))
    with client_of(cluster) as client:
        client.post("/v1/completions", json={"model": "m", "prompt": tokens}, headers={"x-api-key": "tenant-b"})
        asked = [headers for path, headers in replica.router_calls if path == "/kv/prompt_hashes"]
        assert len(asked) == 1 and asked[0]["authorization"] == "Bearer ops"
        assert asked[0]["x-agentjax-tenant-key"] == "tenant-b"
        client.post("/v1/completions", json={"model": "m", "prompt": tokens})  # no key: hashed here, no call
        assert len([p for p, _ in replica.router_calls if p == "/kv/prompt_hashes"]) == 1
    with client_of(cluster, operator_key=None) as client:  # open replicas: hashed here as before
        client.post("/v1/completions", json={"model": "m", "prompt": tokens}, headers={"x-api-key": "unused"})
    assert len([p for p, _ in replica.router_calls if p == "/kv/prompt_hashes"]) == 1


def test_the_same_session_id_under_two_keys_is_two_sessions():
    cluster = FakeCluster(2)
    with client_of(cluster, policy="sticky") as client:
        for key in ("a", "b", "a"):
            client.post("/v1/chat/completions", json={**CHAT, "session_id": "s1"}, headers={"Authorization": f"Bearer {key}"})
        sessions = client.app.state.router.sessions.replica_of
    assert len([name for name in sessions if name.endswith("/s1")]) == 2
