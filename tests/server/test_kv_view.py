"""A replica's view of its prefix cache for routers: the event log mirrors what the KV manager can hit,
numbers its changes (snapshot after a gap or restart), and `/kv/prompt_hashes` names a request's
pages exactly as the manager caches them."""
from __future__ import annotations

import time

from starlette.testclient import TestClient

from agentjax.kv import KVCacheManager
from agentjax.server.app import create_app
from agentjax.server.kv_view import KVEventLog
from tests.server.fakes import FakeEngine, FakeTokenizer

BLOCK = 4


def manager() -> KVCacheManager:
    return KVCacheManager.full_attention(num_blocks=8, block_size=BLOCK, enable_kv_events=True)


def test_the_log_mirrors_the_hashes_the_manager_can_hit():
    kv, log = manager(), KVEventLog(0, BLOCK, 1, "prefix")
    prompt = list(range(10, 23))  # 3 full blocks and a partial one
    assert kv.allocate("r1", prompt)
    log.apply(kv.take_events())
    keys = log.page_keys(prompt, None)
    assert len(keys) == 3 and set(keys) <= log.cached
    kv.free("r1")
    other = list(range(100, 128))  # needs every page: evicts the first prompt's
    assert kv.allocate("r2", other)
    log.apply(kv.take_events())
    assert not set(keys) & log.cached and set(log.page_keys(other, None)) <= log.cached
    assert log.page_keys(prompt, "tenant") != keys  # a cache salt names other pages


def test_reads_are_incremental_then_a_snapshot_after_a_gap_or_another_epoch():
    kv, log = manager(), KVEventLog(0, BLOCK, 1, "prefix", max_events=4)
    kv.allocate("r1", list(range(12)))
    log.apply(kv.take_events())
    first = log.read(0, None)
    assert first["snapshot"] and len(first["events"]) == 3 and first["next"] == 3
    assert log.read(3, log.epoch)["events"] == []
    kv.allocate("r2", list(range(50, 58)))
    log.apply(kv.take_events())
    part = log.read(3, log.epoch, limit=1)
    assert not part["snapshot"] and part["events"][0][0] == "+" and part["more"] and part["next"] == 4
    assert log.read(0, log.epoch)["snapshot"]  # change 0 has left the ring of 4
    assert log.read(3, "another-process")["snapshot"]


def test_prompt_hashes_and_events_over_http_on_a_server_with_a_prefix_cache():
    engine = FakeEngine()
    engine.kv = manager()
    with TestClient(create_app(engine, FakeTokenizer(), model_name="m")) as client:
        messages = [{"role": "user", "content": "hello there"}]
        answer = client.post("/kv/prompt_hashes", json={"path": "/v1/chat/completions",
                                                       "body": {"model": "m", "messages": messages}}).json()
        prompt = FakeTokenizer().encode_chat(messages)
        assert answer["num_tokens"] == len(prompt) and answer["tokens_per_key"] == BLOCK
        engine.kv.allocate("r", prompt)  # as if the engine had run it
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # the engine thread drains events at its next stats snapshot
            events = client.get("/kv/events").json()
            if len(events["events"]) == len(prompt) // BLOCK:
                break
            time.sleep(0.1)
        assert {key for _, key in events["events"]} == set(answer["page_keys"])
        tokens = client.post("/kv/prompt_hashes", json={"path": "/v1/completions",
                                                       "body": {"prompt": prompt, "cache_salt": "t"}}).json()
        assert tokens["page_keys"] != answer["page_keys"] and len(tokens["page_keys"]) == len(answer["page_keys"])
        bad = client.post("/kv/prompt_hashes", json={"path": "/v1/models", "body": {}})
        assert bad.status_code == 400 and "has no prompt" in bad.json()["error"]["message"]


def test_a_server_without_a_prefix_cache_says_so():
    with TestClient(create_app(FakeEngine(), FakeTokenizer(), model_name="m")) as client:
        answer = client.get("/kv/events")
    assert answer.status_code == 404 and "no prefix cache events" in answer.json()["error"]["message"]
