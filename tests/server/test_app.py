"""The HTTP layer on a fake engine: OpenAI-shaped errors, auth, limits, hints, 429, streaming, metrics."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from starlette.testclient import TestClient

from agentjax.server.app import create_app
from agentjax.server.serving import ServerLimits
from tests.server.fakes import FakeEngine, FakeTokenizer

MODEL = "fake-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def make_app(engine=None, **kwargs):
    limits = kwargs.pop("limits", ServerLimits(max_tokens_limit=64, max_request_body_bytes=4096,
                                               max_queued_requests=4))
    return create_app(engine or FakeEngine(), FakeTokenizer(), model_name=MODEL, limits=limits, **kwargs)


@pytest.fixture
def client():
    engine = FakeEngine()
    with TestClient(make_app(engine)) as test_client:
        test_client.engine = engine
        yield test_client


def assert_error(response, status: int, needle: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert needle in error["message"], error["message"]
    return error


def test_chat_returns_openai_shape_with_cached_tokens_in_usage(client):
    body = client.post("/v1/chat/completions", json=CHAT).json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert len(body["choices"][0]["message"]["content"]) == 4
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert body["usage"]["completion_tokens"] == 4


def test_max_completion_tokens_overrides_max_tokens(client):
    body = client.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": 2}).json()
    assert body["usage"]["completion_tokens"] == 2


def test_streamed_chunks_join_to_the_non_streamed_text_and_end_with_usage_and_done(client):
    plain = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 12}).json()
    with client.stream("POST", "/v1/chat/completions",
                       json={**CHAT, "max_tokens": 12, "stream": True,
                             "stream_options": {"include_usage": True}}) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == plain["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12


def test_stop_string_cuts_streamed_and_plain_text_alike(client):
    request = {"model": MODEL, "prompt": "abcdefgh", "max_tokens": 8, "stop": ["def"]}
    plain = client.post("/v1/completions", json=request).json()
    assert plain["choices"][0]["text"] == "abc"
    with client.stream("POST", "/v1/completions", json={**request, "stream": True}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "abc"


def test_completions_accept_token_id_prompts_and_prompt_lists(client):
    body = client.post("/v1/completions", json={"prompt": [[105, 106], [121, 122]], "max_tokens": 2}).json()
    assert [c["text"] for c in body["choices"]] == ["hi", "xy"]
    body = client.post("/v1/completions", json={"prompt": [105, 106], "max_tokens": 2}).json()
    assert body["choices"][0]["text"] == "hi" and body["usage"]["prompt_tokens"] == 2
    body = client.post("/v1/completions", json={"prompt": ["ab", "cd"], "max_tokens": 2}).json()
    assert [c["text"] for c in body["choices"]] == ["ab", "cd"]


@pytest.mark.parametrize("payload, status, needle", [
    (b"{not json", 400, "not valid JSON"),
    (json.dumps({"model": MODEL}).encode(), 400, "messages"),
    (json.dumps({**CHAT, "max_tokens": -3}).encode(), 400, "max_tokens"),
    (json.dumps({**CHAT, "max_tokens": 65}).encode(), 400, "--max-tokens-limit"),
    (json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 300}]}).encode(), 400, "context"),
    (json.dumps({**CHAT, "model": "gpt-9"}).encode(), 404, "gpt-9"),
    (json.dumps({**CHAT, "agent_hints": {"turn": "three"}}).encode(), 400, "agent_hints.turn"),
    (json.dumps({**CHAT, "agent_hints": {"pin": "forever"}}).encode(), 400, "agent_hints.pin"),
    (json.dumps({**CHAT, "agent_hints": {"expected_next_turn_s": -1}}).encode(), 400, "expected_next_turn_s"),
    (json.dumps({**CHAT, "agent_hints": "soon"}).encode(), 400, "agent_hints"),
    (json.dumps({**CHAT, "messages": [{"role": "user", "content": "y" * 5000}]}).encode(), 413, "4096 bytes"),
])
def test_bad_chat_requests_get_a_4xx_that_names_the_problem(client, payload, status, needle):
    response = client.post("/v1/chat/completions", content=payload, headers={"Content-Type": "application/json"})
    assert_error(response, status, needle)
    assert client.get("/health").status_code == 200


def test_unknown_hint_fields_are_ignored_and_known_ones_reach_the_engine(client):
    hints = {"session_id": "s1", "turn": 2, "expected_next_turn_s": 5.0, "pin": "session", "whatever": [1]}
    assert client.post("/v1/chat/completions", json={**CHAT, "agent_hints": hints}).status_code == 200
    add = next(call for call in client.engine.calls if call[0] == "add")
    assert add[2] == "s1" and add[4].expected_next_turn_s == 5.0 and add[4].pin == "session"


def test_session_id_comes_from_headers_when_the_body_has_none(client):
    client.post("/v1/chat/completions", json=CHAT, headers={"X-Correlation-ID": "corr-1"})
    client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "sess-1"})
    sessions = [call[2] for call in client.engine.calls if call[0] == "add"]
    assert sessions == ["corr-1", "sess-1"]


def test_session_end_hint_ends_the_session_after_the_reply(client):
    client.post("/v1/chat/completions", json={**CHAT, "session_id": "s9", "agent_hints": {"session_end": True}})
    deadline = time.monotonic() + 5  # the engine thread takes the command a moment later
    while ("end_session", "s9") not in client.engine.calls:
        assert time.monotonic() < deadline, client.engine.calls
        time.sleep(0.01)


def test_api_key_is_required_on_v1_routes_but_not_on_health():
    with TestClient(make_app(api_key="sekrit")) as client:
        assert_error(client.post("/v1/chat/completions", json=CHAT), 401, "API key")
        wrong = client.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert_error(wrong, 401, "API key")
        ok = client.get("/v1/models", headers={"Authorization": "Bearer sekrit"})
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == MODEL
        assert client.get("/health").status_code == 200


def test_requests_beyond_the_queue_bound_get_429_and_the_rest_finish():
    engine = FakeEngine()
    engine.gate.clear()
    app = make_app(engine, limits=ServerLimits(max_queued_requests=2))

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport,
                                                                        base_url="http://test") as client:
            held = [asyncio.create_task(client.post("/v1/chat/completions", json=CHAT)) for _ in range(2)]
            while app.state.async_engine.num_in_flight < 2:
                await asyncio.sleep(0.01)
            rejected = await client.post("/v1/chat/completions", json=CHAT)
            engine.gate.set()
            return rejected, await asyncio.gather(*held)

    rejected, finished = asyncio.run(scenario())
    assert_error(rejected, 429, "limit 2")
    assert [r.status_code for r in finished] == [200, 200]


def test_a_failing_engine_step_fails_its_requests_with_500_and_the_server_keeps_serving(client):
    client.engine.fail_next_step = True
    assert_error(client.post("/v1/chat/completions", json=CHAT), 500, "injected step failure")
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert client.get("/health").status_code == 200


def test_metrics_expose_agentjax_names_and_count_tokens(client):
    client.post("/v1/chat/completions", json=CHAT)
    text = client.get("/metrics").text
    for name in ("agentjax:num_requests_running", "agentjax:num_requests_waiting", "agentjax:kv_cache_usage_perc",
                 "agentjax:prefix_cache_queries_total", "agentjax:prefix_cache_hits_total",
                 "agentjax:num_preemptions_total", "agentjax:prompt_tokens_total",
                 "agentjax:generation_tokens_total", "agentjax:time_to_first_token_seconds_bucket",
                 "agentjax:inter_token_latency_seconds_bucket", "agentjax:e2e_request_latency_seconds_bucket"):
        assert name in text, name
    assert "agentjax:generation_tokens_total 4.0" in text


def test_unknown_route_and_wrong_method_get_openai_errors(client):
    assert_error(client.get("/v1/nothing"), 404, "Not Found")
    assert_error(client.get("/v1/chat/completions"), 405, "Method Not Allowed")


def test_each_request_gets_one_access_log_line_with_its_status_and_token_counts(client, caplog):
    with caplog.at_level("INFO", logger="agentjax.server.access"):
        client.post("/v1/chat/completions", json=CHAT)
        client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"})
        with client.stream("POST", "/v1/completions", json={"prompt": "abc", "max_tokens": 3, "stream": True}) as r:
            list(r.iter_lines())
    lines = [record.getMessage() for record in caplog.records if record.name == "agentjax.server.access"]
    assert len(lines) == 3
    assert lines[0].startswith("POST /v1/chat/completions 200 ") and "completion_tokens=4 finish_reason=length" in lines[0]
    assert "prompt_tokens=22 cached_tokens=0" in lines[0]
    assert lines[1].startswith("POST /v1/chat/completions 404 ") and "tokens" not in lines[1]
    assert lines[2].startswith("POST /v1/completions 200 ") and "prompt_tokens=3 cached_tokens=0 completion_tokens=3" in lines[2]


def test_a_stream_its_client_leaves_is_logged_with_its_prompt_and_cached_tokens(client, caplog):
    with caplog.at_level("INFO", logger="agentjax.server.access"):
        with client.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 60, "stream": True}) as r:
            next(line for line in r.iter_lines() if '"content":"' in line and '"content":""' not in line)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(
                record.name == "agentjax.server.access" for record in caplog.records):
            time.sleep(0.05)
    lines = [record.getMessage() for record in caplog.records if record.name == "agentjax.server.access"]
    assert len(lines) == 1 and lines[0].startswith("POST /v1/chat/completions 200 ")
    assert "prompt_tokens=22 cached_tokens=0 completion_tokens=" in lines[0]
    assert "completion_tokens=60" not in lines[0]  # it left before the end


def test_health_and_metrics_answer_head_probes(client):
    assert client.head("/metrics").status_code == 200
    assert client.head("/health").status_code == 200


def test_too_many_stop_strings_get_a_400_that_names_the_limit():
    many = [f"s{i}" for i in range(10_000)]
    with TestClient(make_app(limits=ServerLimits(max_request_body_bytes=2**20))) as client:
        check_stop_string_limits(client, many)


def check_stop_string_limits(client, many):
    error = assert_error(client.post("/v1/chat/completions", json={**CHAT, "stop": many}), 400,
                         "at most 16 stop strings are allowed, got 10000")
    assert error["param"] == "stop"
    assert client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2, "stop": many[:16]}).status_code == 200
    anthropic = client.post("/v1/messages", json={"model": MODEL, "max_tokens": 2, "stop_sequences": many,
                                                  "messages": [{"role": "user", "content": "hi"}]})
    assert anthropic.status_code == 400 and "at most 16" in anthropic.json()["error"]["message"]


def dropped(client) -> float:
    import re

    match = re.search(r'^agentjax:request_errors_total\{status="499"\} (\S+)$', client.get("/metrics").text, re.M)
    return float(match.group(1)) if match else 0.0


def test_a_stream_its_client_leaves_is_counted_as_an_error_and_a_finished_one_is_not(client):
    with client.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 60, "stream": True}) as response:
        next(line for line in response.iter_lines() if '"content":"' in line and '"content":""' not in line)
    deadline = time.monotonic() + 10
    while dropped(client) < 1:
        assert time.monotonic() < deadline, client.get("/metrics").text
        time.sleep(0.02)
    with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as response:
        assert list(response.iter_lines())[-2] == "data: [DONE]"
    assert dropped(client) == 1
