"""A replica's KV transfer routes for routers: `/kv/prefill` runs a body's prompt (tokenized as its route
does) for one discarded token, as the session when asked; `store` and `/kv/flush` need an offload
tier (a clear 400 without one, before any compute); both are behind the API key. On a real engine
over a real Mooncake pool with selective retention, a P/D prefill answers only once its whole prompt
is stored, and an idle replica stores its ended turns without waiting for the next request."""
from __future__ import annotations

import time

import pytest
from starlette.testclient import TestClient

from agentjax.server.app import create_app
from tests.server.fakes import FakeEngine, FakeTokenizer

MESSAGES = [{"role": "system", "content": "tools"}, {"role": "user", "content": "hello there"}]
BODY = {"model": "m", "messages": MESSAGES, "max_tokens": 50, "agent_hints": {"expected_next_turn_s": 3.0}}


def test_prefill_runs_the_routes_prompt_for_one_token_as_the_session_when_asked():
    engine = FakeEngine()
    with TestClient(create_app(engine, FakeTokenizer(), model_name="m")) as client:
        plain = client.post("/kv/prefill", json={"path": "/v1/chat/completions", "body": {**BODY, "cache_salt": "t"}})
        as_session = client.post("/kv/prefill", json={"path": "/v1/chat/completions", "body": BODY,
                                                      "session_id": "s1"})
        bad_path = client.post("/kv/prefill", json={"path": "/v1/models", "body": {}})
    prompt = FakeTokenizer().encode_chat(MESSAGES)
    assert plain.status_code == 200 and plain.json() == {"prompt_tokens": len(prompt), "cached_tokens": 0}
    adds = [call for call in engine.calls if call[0] == "add"]
    assert adds[0][2] is None and adds[0][5] == "t"  # no session: nothing is pinned on a P/D prefill replica
    _, _, session, _, hints, _, _ = adds[1]
    assert session == "s1" and hints.session_id == "s1" and hints.expected_next_turn_s == 3.0
    assert bad_path.status_code == 400 and "has no prompt" in bad_path.json()["error"]["message"]


def test_store_and_flush_need_an_offload_tier_and_the_api_key():
    engine = FakeEngine()
    with TestClient(create_app(engine, FakeTokenizer(), model_name="m", api_key="k")) as client:
        locked = client.post("/kv/flush")
        auth = {"Authorization": "Bearer k"}
        flush = client.post("/kv/flush", headers=auth)
        store = client.post("/kv/prefill", headers=auth, json={"path": "/v1/chat/completions", "body": BODY,
                                                               "store": True})
    assert locked.status_code == 401
    for answer in (flush, store):
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "kv_offload_disabled"
        assert "--mooncake-master" in answer.json()["error"]["message"]
    assert not [call for call in engine.calls if call[0] == "add"]  # refused before any compute


@pytest.fixture(scope="module")
def mooncake_replica(tmp_path_factory):
    """A real engine on preset:tiny-dense whose only tier is a real Mooncake pool, with selective
    (Marconi) retention: a turn seen once stores nothing."""
    pytest.importorskip("mooncake.store", reason="the Mooncake wheel (and libibverbs1) is not installed")
    from agentjax.config import EngineConfig
    from agentjax.engine import Engine
    from agentjax.kv.offload.mooncake import MooncakeMaster
    from agentjax.models import load_model

    with MooncakeMaster(log_path=tmp_path_factory.mktemp("mooncake") / "master.log") as master:
        model_cfg, params, tokenizer = load_model("preset:tiny-dense")
        config = EngineConfig(num_kv_blocks=64, max_num_seqs=4, mooncake_master=master.address,
                              mooncake_segment_gb=0.0625, kv_offload_retention="marconi")
        engine = Engine(model_cfg, params, config, tokenizer)
        yield engine
        engine.offload_worker.close()


@pytest.mark.slow
def test_a_pd_prefill_answers_once_the_whole_prompt_is_in_mooncake_and_idle_replicas_store_at_once(mooncake_replica):
    engine = mooncake_replica
    stored = lambda: engine.offload.stats.get("pages_stored", "mooncake")  # noqa: E731
    prompt = {"model": "m", "prompt": list(range(3, 70)), "max_tokens": 2}  # 4 full pages of 16 tokens
    with TestClient(create_app(engine, engine.tokenizer, model_name="m")) as client:
        answer = client.post("/kv/prefill", json={"path": "/v1/completions", "body": prompt, "store": True})
        # seen once, yet stored whole (a P/D prefill is a branch point), before the answer
        assert answer.json() == {"prompt_tokens": 67, "cached_tokens": 0, "stored_in": "mooncake"}
        assert stored() == 4
        again = {**prompt, "prompt": list(range(103, 170))}
        for _ in range(2):  # Marconi stores a prefix the second time it is seen
            assert client.post("/v1/completions", json=again).status_code == 200
        deadline = time.monotonic() + 30  # idle now: its stores go out without another request
        while stored() < 8:
            assert time.monotonic() < deadline, "an idle replica did not store its last turn's pages"
            time.sleep(0.05)
        assert client.post("/kv/flush").json() == {"tiers": ["mooncake"], "degraded": []}
