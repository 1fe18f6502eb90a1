"""Tenancy against a real keyed server with the host and disk tiers on, and through a real router.

Every route the app lists needs a key (only `/health` answers without one), the cache-revealing
routes an operator key; a secret prompt sent under one key leaves no trace another key can observe:
not in `usage.cached_tokens` (device or tiers, direct or through the router), not in the router's
routing, not in any KV endpoint. Keys a keys file puts in one namespace do share their cache, and a
request's `cache_salt` splits it further."""
from __future__ import annotations

import re
import time
import uuid

import httpx
import openai
import pytest

from tests.e2e.conftest import CLIENT_TIMEOUT_S, PROBERS, TENANT_KEYS

pytestmark = pytest.mark.slow

OPEN_ROUTES = {("GET", "/health"), ("HEAD", "/health")}
OPERATOR_ROUTES = {"/kv/events", "/kv/prompt_hashes", "/metrics"}
SECRET = ("My bank PIN is 4417 and the vault code is 90-21-77. " * 6).strip()  # several 16-token pages
ROUTE_REASON = "x-agentjax-route-reason"


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TENANT_KEYS[name]}"}


def client_of(base_url: str, name: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=TENANT_KEYS[name], timeout=CLIENT_TIMEOUT_S,
                         max_retries=0)


def app_routes() -> list[tuple[str, str]]:
    """(method, path) of every route of the app `agentjax serve` builds, path parameters filled in."""
    from agentjax.server.app import create_app
    from tests.server.fakes import FakeEngine, FakeTokenizer

    app = create_app(FakeEngine(), FakeTokenizer(), model_name="m", api_key="k")
    routes = []
    for route in app.routes:
        path = re.sub(r"\{[^}]+\}", "probe", route.path)
        routes += [(method, path) for method in sorted(getattr(route, "methods", None) or ())]
    return routes


def test_every_route_but_health_needs_a_key_and_the_cache_revealing_ones_an_operator_key(tenant_server):
    routes = app_routes()
    assert {path for _, path in routes} >= {"/v1/chat/completions", "/tokenize", "/detokenize", "/kv/events",
                                            "/kv/prompt_hashes", "/openapi.json", "/docs", "/metrics", "/health"}
    with httpx.Client(base_url=tenant_server.base_url, timeout=60) as http:
        for method, path in routes:
            body = {"json": {}} if method in ("POST", "PUT", "PATCH") else {}
            bare = http.request(method, path, **body)
            wrong = http.request(method, path, headers={"Authorization": "Bearer not-a-key"}, **body)
            if (method, path) in OPEN_ROUTES:
                assert bare.status_code == 200, (method, path, bare.text)
                continue
            assert (bare.status_code, wrong.status_code) == (401, 401), (method, path, bare.text)
            as_tenant = http.request(method, path, headers=auth("bob"), **body)
            as_operator = http.request(method, path, headers=auth("operator"), **body)
            if path in OPERATOR_ROUTES:
                assert as_tenant.status_code == 403, (method, path, as_tenant.text)
                if method != "HEAD":
                    assert "operator key" in as_tenant.text
            else:
                assert as_tenant.status_code not in (401, 403), (method, path, as_tenant.text)
            assert as_operator.status_code not in (401, 403), (method, path, as_operator.text)
    router = tenant_server.router
    assert httpx.get(f"{router.base_url}/v1/models", timeout=30).status_code == 401  # the replica's answer
    assert httpx.get(f"{router.base_url}/metrics", timeout=30).status_code == 401  # the router's own
    assert httpx.get(f"{router.base_url}/metrics", headers=auth("operator"), timeout=30).status_code == 200


def chat(client: openai.OpenAI, content: str, **extra) -> int:
    """Cached prompt tokens of a one-token chat reply."""
    reply = client.chat.completions.create(model="preset:tiny-dense", messages=[{"role": "user", "content": content}],
                                           max_tokens=1, temperature=0, extra_body=extra or None)
    return reply.usage.prompt_tokens_details.cached_tokens


def complete(client: openai.OpenAI, prompt: str) -> tuple[int, str | None]:
    """(cached prompt tokens, the router's route reason when it came through one) of a text completion:
    no template, so a prompt its tenant never sent has no cached page at all, and no prefix hit."""
    raw = client.completions.with_raw_response.create(model="preset:tiny-dense", prompt=prompt, max_tokens=1,
                                                     temperature=0)
    return raw.parse().usage.prompt_tokens_details.cached_tokens, raw.headers.get(ROUTE_REASON)


def fresh_text() -> str:
    """A never-sent prompt as long as the secret (another tenant's probe must get no more hits than this)."""
    return " ".join(uuid.uuid4().hex[:6] for _ in range(60))[:len(SECRET)]


def pages_loaded(server) -> float:
    text = httpx.get(f"{server.base_url}/metrics", headers=auth("operator"), timeout=30).text
    return sum(float(v) for v in re.findall(r'^agentjax:kv_offload_pages_loaded_total\{[^}]*\} (\S+)$', text,
                                            re.MULTILINE))


def page_keys(server, name: str, body: dict, path: str = "/v1/chat/completions") -> set[str]:
    """The page keys of a request's prompt in the namespace of `name`'s key, as the operator asks for them."""
    answer = httpx.post(f"{server.base_url}/kv/prompt_hashes", json={"path": path, "body": body},
                        headers={**auth("operator"), "X-Agentjax-Tenant-Key": TENANT_KEYS[name]}, timeout=60)
    assert answer.status_code == 200, answer.text
    return set(answer.json()["page_keys"])


def cached_hashes(server) -> set[str]:
    answer = httpx.get(f"{server.base_url}/kv/events", headers=auth("operator"), timeout=60).json()
    assert answer["snapshot"]
    return {block_hash for _, block_hash in answer["events"]}


def routed_reason_once_indexed(client: openai.OpenAI, prompt: str) -> str | None:
    """The route reason of `prompt` once the router has polled the replica's KV events (every 0.2 s)."""
    deadline = time.monotonic() + 20
    reason = None
    while time.monotonic() < deadline:
        reason = complete(client, prompt)[1]
        if reason == "prefix_hit":
            break
        time.sleep(0.3)
    return reason


def test_a_secret_sent_under_one_key_is_invisible_to_another_on_every_tier_and_through_the_router(tenant_server):
    server, router = tenant_server, tenant_server.router
    alice, alice_routed = client_of(server.base_url, "alice"), client_of(router.base_url, "alice")
    probers = iter(PROBERS)

    def probe_finds_nothing(send, prompt: str, via) -> None:
        """A fresh tenant's probe gets exactly the hits of its own fresh prompt (its template pages; a
        completion has none), and the router routes it as it routes a fresh prompt."""
        name = next(probers)
        client = client_of(via.base_url, name)
        send(client, fresh_text())
        baseline = send(client, fresh_text())
        assert send(client, prompt) == baseline, (name, prompt)

    def no_probe_finds_the_secret() -> None:
        for via in (server, router):
            probe_finds_nothing(chat, SECRET if via is server else SECRET[:len(SECRET) * 3 // 4], via)
            probe_finds_nothing(complete, SECRET[:len(SECRET) // 2] if via is server else SECRET, via)

    chat(alice, SECRET)
    complete(alice, SECRET)
    alice_baseline = chat(alice, fresh_text())
    assert chat(alice, SECRET) >= alice_baseline + 3 * 16, "its own tenant must read the secret's pages"
    assert complete(alice, SECRET)[0] >= 3 * 16
    chat_body = {"model": "preset:tiny-dense", "messages": [{"role": "user", "content": SECRET}]}
    alice_keys, bob_keys = page_keys(server, "alice", chat_body), page_keys(server, "bob", chat_body)
    assert alice_keys and not alice_keys & bob_keys
    cached = cached_hashes(server)
    assert alice_keys <= cached and not bob_keys & cached  # the namespace reaches the KV events
    assert routed_reason_once_indexed(alice_routed, SECRET) == "prefix_hit"  # the router matches alice's own pages
    no_probe_finds_the_secret()  # the secret's pages on the device

    for flood in ("Unrelated build log line with a checksum 0x5f3a and a path /var/cache/x. " * 25,
                  "Another tool output: 17 tests passed, 2 skipped, coverage 81 percent. " * 25):
        chat(client_of(server.base_url, "operator"), flood)  # ~40 pages each, of a pool of 48
    assert not alice_keys & cached_hashes(server), "the floods must push the secret off the device"
    no_probe_finds_the_secret()  # now only the host and disk tiers hold them
    loaded = pages_loaded(server)
    assert chat(alice, SECRET) >= alice_baseline + 3 * 16 and pages_loaded(server) > loaded  # from the tiers

    for name in ("bob", "alice"):  # the cache-revealing routes answer only an operator, whoever asks
        events = httpx.get(f"{server.base_url}/kv/events", headers=auth(name), timeout=30)
        hashes = httpx.post(f"{server.base_url}/kv/prompt_hashes", headers=auth(name), timeout=30,
                            json={"path": "/v1/completions", "body": {"prompt": SECRET}})
        assert (events.status_code, hashes.status_code) == (403, 403)
    assert httpx.get(f"{server.base_url}/kv/events", timeout=30).status_code == 401


def test_keys_a_keys_file_puts_in_one_namespace_share_their_cache_and_cache_salt_splits_it(tenant_server):
    team_1, team_2 = client_of(tenant_server.base_url, "team-1"), client_of(tenant_server.base_url, "team-2")
    alice = client_of(tenant_server.base_url, "alice")
    shared = f"Team notes {uuid.uuid4().hex}: " + "the deploy runs at noon and the rollback plan is B. " * 5
    chat(alice, fresh_text())
    alice_baseline = chat(alice, fresh_text())
    chat(team_1, shared)
    shared_hit = chat(team_2, shared)
    assert shared_hit >= 3 * 16
    assert chat(alice, shared) == alice_baseline
    assert chat(team_2, shared, cache_salt="project-x") < shared_hit  # another salt: at most its own template pages
    assert chat(team_1, shared, cache_salt="project-x") >= 3 * 16  # the same salt in the namespace shares it
