"""Tool calls stream as they decode, a forced tool choice ends after its calls, and text completions
run on the same path (stop strings, echo), on scripted fake engines."""
from __future__ import annotations

import json
import time

import pytest

from starlette.testclient import TestClient

from agentjax.server.app import create_app
from tests.server.fakes import FakeTokenizer
from tests.server.test_anthropic_messages import CALL_TEXT, MODEL, ScriptedEngine, make_client

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
QUESTION = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
            "max_tokens": 120}
ROME_CALL = CALL_TEXT.replace("Paris", "Rome")


def stream_chunks(client, body: dict) -> list[dict]:
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def reassemble(chunks: list[dict]) -> tuple[dict[int, dict], str | None, int]:
    calls, finish, fragments = {}, None, 0
    for chunk in chunks:
        choice = chunk["choices"][0]
        for part in choice["delta"].get("tool_calls") or ():
            call = calls.setdefault(part["index"], {"id": None, "name": "", "arguments": ""})
            call["id"] = part.get("id") or call["id"]
            function = part.get("function") or {}
            call["name"] += function.get("name") or ""
            call["arguments"] += function.get("arguments") or ""
            fragments += bool(function.get("arguments"))
        finish = choice["finish_reason"] or finish
    return calls, finish, fragments


def test_streamed_tool_call_fragments_arrive_one_by_one_and_reassemble_to_the_non_streamed_call():
    with make_client(ScriptedEngine("Let me check.\n" + CALL_TEXT)) as client:
        plain = client.post("/v1/chat/completions", json=QUESTION).json()["choices"][0]
        [expected] = plain["message"]["tool_calls"]
        chunks = stream_chunks(client, QUESTION)
    calls, finish, fragments = reassemble(chunks)
    assert finish == plain["finish_reason"] == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (expected["function"]["name"], expected["function"]["arguments"])]
    assert fragments == len('{"city": "Paris"}')  # one fragment per decoded character: not one whole string
    first_call_chunk = next(c for c in chunks if c["choices"][0]["delta"].get("tool_calls"))
    assert first_call_chunk["choices"][0]["delta"]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                                                     "arguments": ""}


class PacedScriptedEngine(ScriptedEngine):
    """A scripted engine slow enough (5 ms a step) for the server to stop it mid-script."""

    def step(self):
        time.sleep(0.005)
        return super().step()


def uncapped_client(engine) -> TestClient:
    """Default limits: an omitted max_tokens is the context left (about 210 tokens here)."""
    client = TestClient(create_app(engine, FakeTokenizer(), model_name=MODEL))
    client.engine = engine
    return client


def test_a_forced_reply_that_repeats_its_call_ends_after_the_first_with_tool_calls():
    script = "\n".join([CALL_TEXT] * 6)
    with uncapped_client(PacedScriptedEngine(script)) as client:
        body = {**QUESTION, "tool_choice": "required"}
        del body["max_tokens"]
        plain = client.post("/v1/chat/completions", json=body).json()
        chunks = stream_chunks(client, body)
        deadline = time.monotonic() + 5  # the engine thread takes the abort a moment later
        while not any(call[0] == "abort" for call in client.engine.calls) and time.monotonic() < deadline:
            time.sleep(0.01)
        aborted = [call for call in client.engine.calls if call[0] == "abort"]
    choice = plain["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and len(choice["message"]["tool_calls"]) == 1
    assert plain["usage"]["completion_tokens"] < len(script) // 2  # stopped in the second call
    calls, finish, _ = reassemble(chunks)
    assert finish == "tool_calls" and len(calls) == 1 and json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert aborted  # the engine stopped generating the repeat


def test_a_forced_reply_cut_off_after_whole_calls_ends_with_tool_calls_and_drops_the_fragment():
    with make_client(ScriptedEngine("\n".join([CALL_TEXT, ROME_CALL, CALL_TEXT]))) as client:
        body = {**QUESTION, "tool_choice": "required", "max_tokens": 100}  # the budget ends in the 2nd call's head
        plain = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        calls, finish, _ = reassemble(stream_chunks(client, body))
    assert plain["finish_reason"] == finish == "tool_calls" and plain["message"]["content"] is None
    assert [c["function"]["name"] for c in plain["message"]["tool_calls"]] == ["get_weather"] and len(calls) == 1


def test_a_forced_reply_cut_off_inside_a_streamed_call_says_length():
    with uncapped_client(ScriptedEngine(f"{CALL_TEXT}\n{ROME_CALL}")) as client:
        body = {**QUESTION, "tool_choice": "required", "max_tokens": 140}  # inside Rome's arguments
        plain = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert plain["finish_reason"] == "length" and len(plain["message"]["tool_calls"]) == 2


def test_a_forced_reply_keeps_distinct_parallel_calls():
    with uncapped_client(ScriptedEngine(f"{CALL_TEXT}\n{ROME_CALL}")) as client:
        body = {**QUESTION, "tool_choice": "required", "max_tokens": 200}
        plain = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        calls, finish, _ = reassemble(stream_chunks(client, body))
    cities = [json.loads(c["function"]["arguments"])["city"] for c in plain["message"]["tool_calls"]]
    assert plain["finish_reason"] == finish == "tool_calls" and cities == ["Paris", "Rome"]
    assert [json.loads(c["arguments"])["city"] for c in calls.values()] == cities


def test_a_repeat_is_only_a_repeat_once_it_matches_whole():
    """A second call that shares the first's opening streams normally once it differs."""
    second = CALL_TEXT.replace("Paris", "Paris, TX")
    with uncapped_client(ScriptedEngine(f"{CALL_TEXT}\n{second}")) as client:
        calls, finish, _ = reassemble(stream_chunks(client, {**QUESTION, "tool_choice": "required", "max_tokens": 200}))
    assert finish == "tool_calls"
    assert [json.loads(c["arguments"])["city"] for c in calls.values()] == ["Paris", "Paris, TX"]


@pytest.mark.parametrize("stream", [False, True])
def test_text_completions_cut_at_the_stop_string_and_echo_the_prompt(stream):
    with make_client(ScriptedEngine("one two STOP three")) as client:
        request = {"model": MODEL, "prompt": "Count:", "max_tokens": 50, "stop": ["STOP"], "echo": True}
        if not stream:
            body = client.post("/v1/completions", json=request).json()
            text, finish = body["choices"][0]["text"], body["choices"][0]["finish_reason"]
        else:
            with client.stream("POST", "/v1/completions", json={**request, "stream": True}) as response:
                chunks = [json.loads(line[6:]) for line in response.iter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
            text = "".join(c["choices"][0]["text"] for c in chunks)
            finish = chunks[-1]["choices"][0]["finish_reason"]
    assert text == "Count:one two " and finish == "stop"


def test_tokenize_and_detokenize_round_trip_text_and_render_chats():
    with make_client() as client:
        tokens = client.post("/tokenize", json={"prompt": "hi", "return_token_strs": True}).json()
        assert tokens == {"count": 2, "max_model_len": 256, "tokens": [105, 106], "token_strs": ["h", "i"]}
        chat = client.post("/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).json()
        assert client.post("/detokenize", json={"tokens": chat["tokens"]}).json() == {"prompt": "<user>hi<assistant>"}
        no_prompt = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                                   "add_generation_prompt": False}).json()
        assert no_prompt["count"] == len("<user>hi")
        both = client.post("/tokenize", json={"prompt": "a", "messages": [{"role": "user", "content": "b"}]})
        assert both.status_code == 400 and both.json()["error"]["param"] == "prompt"
        assert client.post("/detokenize", json={"model": "gpt-9", "tokens": [1]}).status_code == 404
