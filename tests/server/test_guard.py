"""The request guard and tenancy on a fake engine: every route the app lists needs a key but `/health`,
the cache-revealing routes an operator key; each key's requests reach the engine in their own cache
namespace and session space, and stored responses answer only their own tenant."""
from __future__ import annotations

import re

import pytest
from starlette.testclient import TestClient

from agentjax.kv import KVCacheManager
from agentjax.server.app import create_app
from agentjax.server.tenancy import KeyRing
from tests.server.fakes import FakeEngine, FakeTokenizer

MODEL = "m"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
KEYS = KeyRing.build(["key-a", "key-b"], ["key-ops"])


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def routes(app) -> list[tuple[str, str]]:
    return [(method, re.sub(r"\{[^}]+\}", "x", route.path)) for route in app.routes
            for method in sorted(getattr(route, "methods", None) or ())]


def keyed_client(engine=None, **kwargs) -> TestClient:
    return TestClient(create_app(engine or FakeEngine(), FakeTokenizer(), model_name=MODEL, keys=KEYS, **kwargs))


def test_every_listed_route_needs_a_key_except_health_and_operator_routes_an_operator_key():
    with keyed_client() as client:
        listed = routes(client.app)
        assert len(listed) >= 20 and ("GET", "/openapi.json") in listed and ("GET", "/docs") in listed
        for method, path in listed:
            extra = {"json": {}} if method == "POST" else {}
            bare = client.request(method, path, **extra)
            if path == "/health":
                assert bare.status_code == 200
                continue
            assert bare.status_code == 401, (method, path)
            tenant = client.request(method, path, headers=bearer("key-a"), **extra)
            operator = client.request(method, path, headers=bearer("key-ops"), **extra)
            if path in ("/kv/events", "/kv/prompt_hashes", "/metrics"):
                assert tenant.status_code == 403, (method, path)
            else:
                assert tenant.status_code not in (401, 403), (method, path, tenant.text)
            assert operator.status_code not in (401, 403), (method, path, operator.text)
        assert client.get("/nowhere").status_code == 401  # unknown paths too: nothing is listed to strangers


def test_metrics_without_key_opens_metrics_only_and_anthropic_routes_answer_in_their_shape():
    with keyed_client(metrics_without_key=True) as client:
        assert client.get("/metrics").status_code == 200
        assert client.get("/kv/events").status_code == 401
        refused = client.post("/v1/messages", json={})
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    with keyed_client() as client:
        forbidden = client.get("/metrics", headers={"x-api-key": "key-b"})
        assert forbidden.status_code == 403 and forbidden.json()["error"]["code"] == "operator_key_required"


def test_each_key_reaches_the_engine_in_its_own_namespace_and_sessions():
    engine = FakeEngine()
    with keyed_client(engine) as client:
        for key in ("key-a", "key-b", "key-a"):
            body = {**CHAT, "session_id": "s1", "cache_salt": "x" if key == "key-b" else None}
            assert client.post("/v1/chat/completions", json=body, headers=bearer(key)).status_code == 200
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                           headers=bearer("key-b")).status_code == 200
    adds = [call for call in engine.calls if call[0] == "add"]
    sessions, salts = [call[2] for call in adds], [call[5] for call in adds]
    assert sessions[0] == sessions[2] != sessions[1] and sessions[0].endswith("/s1")
    assert salts[0] == salts[2] and len({salts[0], salts[1], salts[3]}) == 3 and None not in salts
    assert "x" not in salts and salts[1].endswith("\x00x")  # the request's salt, inside its namespace


def test_a_stored_response_answers_only_its_own_tenant():
    with keyed_client() as client:
        made = client.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 2},
                           headers=bearer("key-a")).json()
        assert client.get(f"/v1/responses/{made['id']}", headers=bearer("key-a")).status_code == 200
        assert client.get(f"/v1/responses/{made['id']}", headers=bearer("key-b")).status_code == 404
        follow = client.post("/v1/responses", json={"model": MODEL, "input": "more", "previous_response_id": made["id"]},
                             headers=bearer("key-b"))
        assert follow.status_code == 404 and follow.json()["error"]["param"] == "previous_response_id"


def test_an_operator_asks_for_prompt_hashes_in_a_named_tenants_namespace():
    engine = FakeEngine()
    engine.kv = KVCacheManager.full_attention(num_blocks=8, block_size=4, enable_kv_events=True)
    body = {"path": "/v1/completions", "body": {"prompt": "abcdefghijkl"}}
    with keyed_client(engine) as client:
        def keys_for(tenant: str | None) -> list[str]:
            headers = {**bearer("key-ops"), **({"X-Agentjax-Tenant-Key": tenant} if tenant else {})}
            answer = client.post("/kv/prompt_hashes", json=body, headers=headers)
            assert answer.status_code == 200, answer.text
            return answer.json()["page_keys"]

        a, b, own = keys_for("key-a"), keys_for("key-b"), keys_for(None)
        assert len(a) == 3 and len({tuple(a), tuple(b), tuple(own)}) == 3
        unknown = client.post("/kv/prompt_hashes", json=body, headers={**bearer("key-ops"),
                                                                       "X-Agentjax-Tenant-Key": "guess"})
        assert unknown.status_code == 401


@pytest.mark.parametrize("key", ["key-a", "key-ops"])
def test_an_open_server_ignores_keys_and_keeps_one_namespace(key):
    engine = FakeEngine()
    with TestClient(create_app(engine, FakeTokenizer(), model_name=MODEL)) as client:
        assert client.get("/kv/events").status_code in (200, 404)  # no keys: nothing to guard
        assert client.post("/v1/chat/completions", json={**CHAT, "session_id": "s"}, headers=bearer(key)).status_code == 200
    add = next(call for call in engine.calls if call[0] == "add")
    assert add[2] == "s" and add[5] is None
