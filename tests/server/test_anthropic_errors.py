"""/v1/messages on the fake engine: Anthropic-shaped 4xx errors that name the problem, x-api-key auth,
cache_control marks mapped to page pins, and a streamed request aborted when its client leaves."""
from __future__ import annotations

import asyncio
import json

import anthropic
import pytest
from starlette.testclient import TestClient

from agentjax.server.app import create_app
from agentjax.server.serving import ServerLimits
from tests.server.fakes import FakeEngine, FakeTokenizer
from tests.server.test_anthropic_messages import HELLO, MODEL, WEATHER, make_client, sdk

TOOL_USE = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_9", "name": "get_weather",
                                              "input": {"city": "Oslo"}}]}


@pytest.fixture
def client():
    with make_client() as test_client:
        yield test_client


def assert_anthropic_error(response, status: int, error_type: str, needle: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == error_type
    assert needle in body["error"]["message"], body["error"]["message"]


def user(*blocks) -> dict:
    return {"role": "user", "content": list(blocks)}


BAD = {
    "unknown block type": ({**HELLO, "messages": [user({"type": "image", "source": {"type": "base64"}})]},
                           "content block type 'image'"),
    "unsupported block type": ({**HELLO, "messages": [user({"type": "document", "source": {}})]}, "'document'"),
    "image inside a tool_result": ({**HELLO, "messages": [{"role": "user", "content": "hi"}, TOOL_USE, user(
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": [{"type": "image"}]})]},
        "messages.2.content.0.content.0: content block type 'image'"),
    "tool_result without tool_use": ({**HELLO, "messages": [user(
        {"type": "tool_result", "tool_use_id": "toolu_404", "content": "42"})]},
        "messages.0.content.0.tool_use_id: 'toolu_404' matches no tool_use"),
    "tool_use in a user message": ({**HELLO, "messages": [user(*TOOL_USE["content"])]}, "assistant message"),
    "missing max_tokens": ({k: v for k, v in HELLO.items() if k != "max_tokens"}, "max_tokens: Field required"),
    "max_tokens over the limit": ({**HELLO, "max_tokens": 129}, "--max-tokens-limit"),
    "tools not a list": ({**HELLO, "tools": {"name": "x"}}, "tools: Input should be a valid list"),
    "input_schema not an object": ({**HELLO, "tools": [{"name": "x", "input_schema": "string"}]},
                                   "tools.0.input_schema"),
    "tool name of the wrong type": ({**HELLO, "tools": [{"name": 7, "input_schema": {"type": "object"}}]},
                                    "tools.0.name"),
    "a server tool": ({**HELLO, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    "tool_choice names no tool": ({**HELLO, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
                                  "'nope'"),
    "bad tool_choice type": ({**HELLO, "tool_choice": {"type": "sometimes"}}, "tool_choice: type 'sometimes'"),
    "temperature above 1": ({**HELLO, "temperature": 1.5}, "temperature"),
    "content neither text nor blocks": ({**HELLO, "messages": [{"role": "user", "content": 5}]},
                                        "messages.0.content: Input should be a string or a list"),
    "five cache_control marks": ({**HELLO, "messages": [user(*[
        {"type": "text", "text": f"part {i}", "cache_control": {"type": "ephemeral"}} for i in range(5)])]},
        "5 blocks carry cache_control; at most 4"),
    "bad cache ttl": ({**HELLO, "system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral",
                                                                                         "ttl": "2d"}}]}, "ttl"),
    "prompt too long": ({**HELLO, "messages": [{"role": "user", "content": "x" * 300}]},
                        "prompt is too long: 317 tokens > 255 maximum"),
    # Anthropic's words, which Claude Code reads to retry with a budget that fits.
    "max_tokens over the context left": ({**HELLO, "max_tokens": 100, "messages": [
        {"role": "user", "content": "x" * 200}]},
        "input length and `max_tokens` exceed context limit: 217 + 100 > 256, decrease input length or "
        "`max_tokens` and try again"),
    "a system turn with a tool_use block": ({**HELLO, "messages": [{"role": "user", "content": "hi"}, {
        "role": "system", "content": [TOOL_USE["content"][0]]}]}, "a system turn holds text blocks only"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_requests_get_anthropic_shaped_400s_naming_the_problem(client, case):
    payload, needle = BAD[case]
    assert_anthropic_error(client.post("/v1/messages", json=payload), 400, "invalid_request_error", needle)
    assert client.get("/health").status_code == 200
    assert client.post("/v1/messages", json=HELLO).status_code == 200


def test_invalid_json_unknown_model_and_oversized_bodies_use_the_anthropic_shape_too(client):
    headers = {"Content-Type": "application/json"}
    assert_anthropic_error(client.post("/v1/messages", content=b'{"model": ', headers=headers), 400,
                           "invalid_request_error", "not valid JSON")
    assert_anthropic_error(client.post("/v1/messages", json={**HELLO, "model": "claude-x"}), 404,
                           "not_found_error", "'claude-x'")
    assert_anthropic_error(client.post("/v1/messages/count_tokens", json={**HELLO, "model": "claude-x"}), 404,
                           "not_found_error", "'claude-x'")
    big = {**HELLO, "messages": [{"role": "user", "content": "y" * 9000}]}
    assert_anthropic_error(client.post("/v1/messages", json=big), 413, "request_too_large", "8192 bytes")
    assert_anthropic_error(client.get("/v1/messages"), 405, "invalid_request_error", "Method Not Allowed")
    # the OpenAI routes keep their own shape
    assert set(client.post("/v1/chat/completions", json={"model": "claude-x", "messages": []}).json()) == {"error"}


def test_the_sdk_raises_its_typed_errors(client):
    with pytest.raises(anthropic.NotFoundError):
        sdk(client).messages.create(model="claude-x", max_tokens=2, messages=HELLO["messages"])
    with pytest.raises(anthropic.BadRequestError, match="tool_use_id"):
        sdk(client).messages.create(model=MODEL, max_tokens=2, messages=BAD["tool_result without tool_use"][0]["messages"])


def test_x_api_key_and_bearer_are_both_accepted_when_an_api_key_is_set():
    with make_client(api_key="sekrit") as client:
        assert_anthropic_error(client.post("/v1/messages", json=HELLO), 401, "authentication_error", "x-api-key")
        assert_anthropic_error(client.post("/v1/messages", json=HELLO, headers={"x-api-key": "nope"}), 401,
                               "authentication_error", "API key")
        assert client.post("/v1/messages", json=HELLO, headers={"x-api-key": "sekrit"}).status_code == 200
        assert client.post("/v1/messages", json=HELLO, headers={"Authorization": "Bearer sekrit"}).status_code == 200
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert client.post("/v1/chat/completions", json=chat, headers={"x-api-key": "sekrit"}).status_code == 200
        assert set(client.post("/v1/chat/completions", json=chat).json()["error"]) >= {"message", "type", "code"}
        with pytest.raises(anthropic.AuthenticationError):
            sdk(client, api_key="wrong").messages.create(**HELLO)
        assert sdk(client, api_key="sekrit").messages.count_tokens(model=MODEL, messages=HELLO["messages"]).input_tokens


def pins_of(client: TestClient) -> list:
    return [call[6] for call in client.engine.calls if call[0] == "add"][-1]


def test_cache_control_marks_pin_the_prompt_prefix_they_close(client):
    request = {**HELLO, "tools": [{**WEATHER, "cache_control": {"type": "ephemeral"}}],
               "system": [{"type": "text", "text": "AB", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
                          {"type": "text", "text": "CD"}],
               "messages": [{"role": "user", "content": "hi"}, TOOL_USE,
                            user({"type": "tool_result", "tool_use_id": "toolu_9", "content": "rain",
                                  "cache_control": {"type": "ephemeral"}},
                                 {"type": "text", "text": "more"})]}
    assert client.post("/v1/messages", json=request).status_code == 200
    # The fake template renders contents only: "<system>AB\nCD<user>hi<assistant><tool>rain<user>more<assistant>".
    system_mark = len("<system>AB")
    result_mark = len("<system>AB\nCD<user>hi<assistant><tool>rain")
    # The tools mark renders an empty system message; the fake template writes no tools into it.
    assert pins_of(client) == [(len("<system>"), 300.0), (system_mark, 3600.0), (result_mark, 300.0)]
    no_marks = {**HELLO, "system": "plain"}
    client.post("/v1/messages", json=no_marks)
    assert pins_of(client) == []


def test_a_top_level_cache_control_marks_the_last_block_and_counts_toward_the_limit(client):
    request = {**HELLO, "cache_control": {"type": "ephemeral", "ttl": "1h"},
               "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                            user({"type": "text", "text": "A"}, {"type": "text", "text": "B"})]}
    assert client.post("/v1/messages", json=request).status_code == 200
    assert pins_of(client) == [(len("<user>hi<assistant>yo<user>AB"), 3600.0)]
    plain_last = {**request, "messages": [{"role": "user", "content": "hi there"}]}
    assert client.post("/v1/messages", json=plain_last).status_code == 200
    assert pins_of(client) == [(len("<user>hi there"), 3600.0)]
    marked = [{"type": "text", "text": str(i), "cache_control": {"type": "ephemeral"}} for i in range(4)]
    too_many = {**request, "messages": [user(*marked)]}
    assert_anthropic_error(client.post("/v1/messages", json=too_many), 400, "invalid_request_error",
                           "5 blocks carry cache_control")


def test_a_streaming_request_is_aborted_when_its_client_disconnects():
    engine = FakeEngine(step_s=0.05)
    app = create_app(engine, FakeTokenizer(), model_name=MODEL, limits=ServerLimits(max_tokens_limit=64))
    body = json.dumps({**HELLO, "max_tokens": 60, "stream": True}).encode()

    async def scenario() -> list[bytes]:
        chunks: list[bytes] = []
        gone = asyncio.Event()
        sent = False

        async def receive():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                chunks.append(message["body"])
                if sum(b"content_block_delta" in c for c in chunks) >= 2:
                    gone.set()

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/messages", "raw_path": b"/v1/messages",
                 "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("test", 80),
                 "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
        async with app.router.lifespan_context(app):
            await asyncio.wait_for(app(scope, receive, send), 10)
            for _ in range(100):  # the engine thread takes the abort a moment later
                if not engine.live:
                    break
                await asyncio.sleep(0.02)
        return chunks

    chunks = asyncio.run(scenario())
    assert not any(b"message_stop" in c for c in chunks)
    aborted = [call for call in engine.calls if call[0] == "abort"]
    assert aborted and not engine.live
