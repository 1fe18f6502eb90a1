"""/v1/messages on the fake engine: the reply and stream shapes the official `anthropic` SDK parses,
tool calls as tool_use blocks, usage with cache reads, stop sequences, sessions, errors mid-stream."""
from __future__ import annotations

import json
import time

import anthropic
import pytest
from starlette.testclient import TestClient

from agentjax.scheduler.request import EngineOutput
from agentjax.server.app import create_app
from agentjax.server.serving import ServerLimits
from tests.server.fakes import FakeEngine, FakeTokenizer

MODEL = "fake-model"
HELLO = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]}
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class ScriptedEngine(FakeEngine):
    """Replies with `script` (one character a step) and reports `cached` prompt tokens as cache hits."""

    def __init__(self, script: str, cached: int = 0):
        super().__init__()
        self.script = FakeTokenizer().encode(script)
        self.cached = cached

    def step(self) -> list[EngineOutput]:
        self.gate.wait()
        if self.fail_next_step and any(live.generated for live in self.live.values()):
            self.fail_next_step = False
            raise RuntimeError("injected step failure")
        outputs = []
        for request_id, live in list(self.live.items()):
            token = self.script[len(live.generated)]
            live.generated.append(token)
            length = len(live.generated) >= live.sampling.max_tokens
            done = len(live.generated) == len(self.script)
            text = FakeTokenizer().decode(live.generated)
            stopped = any(s in text for s in live.sampling.stop)
            if done or length or stopped:
                del self.live[request_id]
            reason = "stop" if done or stopped else ("length" if length else None)
            outputs.append(EngineOutput(request_id, [token], reason is not None, reason, self.cached, len(live.prompt)))
        return outputs


def make_client(engine=None, **kwargs) -> TestClient:
    limits = ServerLimits(max_tokens_limit=128, max_request_body_bytes=8192, max_queued_requests=4)
    app = create_app(engine or FakeEngine(), FakeTokenizer(), model_name=MODEL, model_aliases=("alias-m",),
                     limits=limits, **kwargs)
    client = TestClient(app)
    client.engine = app.state.async_engine.engine
    return client


@pytest.fixture
def client():
    with make_client() as test_client:
        yield test_client


def sdk(client: TestClient, api_key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=str(client.base_url), api_key=api_key, http_client=client, max_retries=0)


def sse_events(response) -> list[tuple[str, dict]]:
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data = json.loads(line[6:])
            assert data["type"] == name, (name, data)
            events.append((name, data))
    return events


def test_reply_has_anthropic_message_shape_and_the_sdk_parses_it(client):
    body = client.post("/v1/messages", json=HELLO).json()
    assert body["id"].startswith("msg_") and body["type"] == "message" and body["role"] == "assistant"
    assert body["model"] == MODEL and body["content"] == [{"type": "text", "text": "<use"}]
    assert body["stop_reason"] == "max_tokens" and body["stop_sequence"] is None
    prompt = len("<user>hello<assistant>")
    assert body["usage"] == {"input_tokens": prompt, "output_tokens": 4, "cache_read_input_tokens": 0,
                             "cache_creation_input_tokens": 0}
    message = sdk(client).messages.create(model="alias-m", max_tokens=6, messages=HELLO["messages"])
    assert message.content[0].text == "<user>" and message.usage.output_tokens == 6


def test_system_blocks_tool_use_and_tool_result_reach_the_template_as_chat_messages():
    with make_client(ScriptedEngine("It is sunny.")) as client:
        request = {"model": MODEL, "max_tokens": 32, "tools": [WEATHER],
                   "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}],
                   "messages": [
                       {"role": "user", "content": "Weather in Paris?"},
                       {"role": "assistant", "content": [
                           {"type": "text", "text": "Checking."},
                           {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                       {"role": "user", "content": [
                           {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                           {"type": "text", "text": "And so?"}]}]}
        body = client.post("/v1/messages", json=request).json()
        assert body["content"] == [{"type": "text", "text": "It is sunny."}] and body["stop_reason"] == "end_turn"
        expected = ("<system>Be brief.\nUse tools.<user>Weather in Paris?<assistant>Checking.<tool>sunny"
                    "<user>And so?<assistant>")
        assert body["usage"]["input_tokens"] == len(expected)
        counted = client.post("/v1/messages/count_tokens", json={k: v for k, v in request.items() if k != "max_tokens"})
        assert counted.json() == {"input_tokens": len(expected)}


def test_a_tool_call_becomes_a_tool_use_block_streamed_as_input_json_deltas():
    with make_client(ScriptedEngine(CALL_TEXT)) as client:
        request = {"model": MODEL, "max_tokens": 100, "tools": [WEATHER],
                   "tool_choice": {"type": "tool", "name": "get_weather"},
                   "messages": [{"role": "user", "content": "Weather in Paris?"}]}
        body = client.post("/v1/messages", json=request).json()
        assert body["stop_reason"] == "tool_use"
        [block] = body["content"]
        assert block["type"] == "tool_use" and block["id"].startswith("toolu_")
        assert block["name"] == "get_weather" and block["input"] == {"city": "Paris"}
        with client.stream("POST", "/v1/messages", json={**request, "stream": True}) as response:
            events = sse_events(response)
        names = [name for name, _ in events]
        # The arguments stream as they decode: one input_json_delta per character of the script.
        assert names == ["message_start", "content_block_start", *["content_block_delta"] * len('{"city": "Paris"}'),
                         "content_block_stop", "message_delta", "message_stop"]
        assert events[1][1]["content_block"]["name"] == "get_weather"
        partial = "".join(data["delta"]["partial_json"] for name, data in events if name == "content_block_delta")
        assert json.loads(partial) == {"city": "Paris"}
        assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
        with sdk(client).messages.stream(**request) as stream:
            final = stream.get_final_message()
        assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_weather", {"city": "Paris"})]
        assert final.stop_reason == "tool_use"


def test_streamed_text_joins_to_the_non_streamed_text_through_the_sdk_stream_helper():
    with make_client(ScriptedEngine("  Hello there, agent.")) as client:
        plain = sdk(client).messages.create(**HELLO | {"max_tokens": 50})
        with sdk(client).messages.stream(**HELLO | {"max_tokens": 50}) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert text == plain.content[0].text == "  Hello there, agent."
        assert final.stop_reason == "end_turn" and final.usage.output_tokens == plain.usage.output_tokens


def test_usage_splits_the_prompt_into_uncached_cache_read_and_pinned_tokens():
    with make_client(ScriptedEngine("ok", cached=8)) as client:
        body = client.post("/v1/messages", json=HELLO).json()
        prompt = len("<user>hello<assistant>")
        assert body["usage"]["cache_read_input_tokens"] == 8 and body["usage"]["input_tokens"] == prompt - 8
        marked = {**HELLO, "system": [{"type": "text", "text": "You are terse and exact.",
                                       "cache_control": {"type": "ephemeral"}}]}
        usage = client.post("/v1/messages", json=marked).json()["usage"]
        pinned = len("<system>You are terse and exact.")
        assert usage["cache_creation_input_tokens"] == pinned - 8
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"] \
            == pinned + len("<user>hello<assistant>")
        with client.stream("POST", "/v1/messages", json={**marked, "stream": True}) as response:
            delta = [data for name, data in sse_events(response) if name == "message_delta"][0]
        assert delta["usage"] == usage


def test_a_stop_sequence_ends_the_reply_with_stop_reason_stop_sequence():
    with make_client(ScriptedEngine("one two three")) as client:
        body = client.post("/v1/messages", json={**HELLO, "max_tokens": 50, "stop_sequences": ["two"]}).json()
        assert body["content"][0]["text"] == "one "
        assert body["stop_reason"] == "stop_sequence" and body["stop_sequence"] == "two"


def test_session_id_comes_from_metadata_user_id_then_headers(client):
    client.post("/v1/messages", json={**HELLO, "metadata": {"user_id": "user-7"}}, headers={"X-Session-ID": "h"})
    client.post("/v1/messages", json=HELLO, headers={"X-Session-ID": "sess-2"})
    client.post("/v1/messages", json=HELLO, headers={"X-Correlation-ID": "corr-3"})
    sessions = [call[2] for call in client.engine.calls if call[0] == "add"]
    assert sessions == ["user-7", "sess-2", "corr-3"]


def test_agent_hints_reach_the_engine_and_session_end_ends_the_session(client):
    hints = {"turn": 1, "expected_next_turn_s": 3.0, "session_end": True}
    client.post("/v1/messages", json={**HELLO, "metadata": {"user_id": "s5"}, "agent_hints": hints})
    add = next(call for call in client.engine.calls if call[0] == "add")
    assert add[4].expected_next_turn_s == 3.0 and add[4].session_id == "s5"
    deadline = time.monotonic() + 5
    while ("end_session", "s5") not in client.engine.calls:
        assert time.monotonic() < deadline, client.engine.calls
        time.sleep(0.01)


def test_an_engine_failure_mid_stream_becomes_an_error_event_and_the_server_keeps_serving():
    engine = ScriptedEngine("a long enough reply")
    with make_client(engine) as client:
        engine.fail_next_step = True
        with client.stream("POST", "/v1/messages", json={**HELLO, "max_tokens": 50, "stream": True}) as response:
            events = sse_events(response)
        assert events[0][0] == "message_start" and events[-1][0] == "error"
        assert events[-1][1]["error"]["type"] == "api_error"
        assert "injected step failure" in events[-1][1]["error"]["message"]
        assert client.post("/v1/messages", json=HELLO).status_code == 200
        assert client.get("/health").status_code == 200
