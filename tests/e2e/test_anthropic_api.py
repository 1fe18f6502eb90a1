"""The official `anthropic` SDK, unchanged and pointed at the server the README's main command starts:
a message, its second turn hitting the prefix cache, a streamed message, a token count, a forced tool
call and its result sent back, and bad input answered in Anthropic's error shape."""
from __future__ import annotations

import json
import uuid

import anthropic
import httpx
import jsonschema
import pytest

from tests.e2e.conftest import CLIENT_TIMEOUT_S

pytestmark = pytest.mark.slow  # every request runs the real model

MODEL = "smollm2-135m-instruct"
GREEDY = {"temperature": 0}  # the SDK no longer has a temperature argument; the API still takes it
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
               "required": ["city"], "additionalProperties": False}
WEATHER = {"name": "get_weather", "description": "Current weather in a city", "input_schema": CITY_SCHEMA}


@pytest.fixture(scope="module")
def server(main_server):
    return main_server


def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", timeout=CLIENT_TIMEOUT_S, max_retries=0)


def total(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def test_a_message_then_its_second_turn_reads_the_cache_and_the_token_count_matches(server):
    sdk = client(server)
    # A system prompt of its own (with a cache mark), so nothing else on this server shares the prefix.
    system = [{"type": "text", "text": f"Session {uuid.uuid4().hex}. You are a terse assistant. " * 3,
               "cache_control": {"type": "ephemeral"}}]
    session = {"user_id": f"anthropic-{uuid.uuid4().hex}"}
    first = sdk.messages.create(model=MODEL, max_tokens=8, system=system, messages=QUESTION, metadata=session,
                                extra_body=GREEDY)
    assert first.type == "message" and first.id.startswith("msg_") and first.model == MODEL
    assert "Paris" in first.content[0].text and first.stop_reason in ("end_turn", "max_tokens")
    assert 0 < first.usage.output_tokens <= 8 and first.usage.cache_creation_input_tokens > 0
    messages = [*QUESTION, {"role": "assistant", "content": first.content[0].text},
                {"role": "user", "content": "And of Germany?"}]
    counted = sdk.messages.count_tokens(model=MODEL, system=system, messages=messages)
    second = sdk.messages.create(model=MODEL, max_tokens=8, system=system, messages=messages, metadata=session,
                                 extra_body=GREEDY)
    assert second.usage.cache_read_input_tokens > 0
    assert total(second.usage) == counted.input_tokens > total(first.usage)
    assert second.content[0].text


def test_a_streamed_message_collects_its_text_through_the_stream_helper(server):
    with client(server).messages.stream(model=MODEL, max_tokens=8, messages=QUESTION, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert "Paris" in text and final.content[0].text == text
    assert final.stop_reason in ("end_turn", "max_tokens") and 0 < final.usage.output_tokens <= 8
    assert total(final.usage) > 0


def test_a_forced_tool_call_validates_and_its_result_gets_a_reply_and_streaming_reassembles_it(server):
    sdk = client(server)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    marked = {**WEATHER, "cache_control": {"type": "ephemeral"}}
    forced = {"model": MODEL, "max_tokens": 48, "tools": [marked], "messages": ask,
              "tool_choice": {"type": "tool", "name": "get_weather"}}
    # Distinct cache salts: both requests compute the prompt alike, so greedy decoding gives one call.
    salt = uuid.uuid4().hex
    call = sdk.messages.create(**forced, extra_body={**GREEDY, "cache_salt": salt})
    assert call.stop_reason == "tool_use" and call.usage.cache_creation_input_tokens > 0  # the tools mark
    [use] = [block for block in call.content if block.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, CITY_SCHEMA)

    answered = [*ask, {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in call.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 22 C"}]}]
    reply = sdk.messages.create(model=MODEL, max_tokens=8, tools=[WEATHER], messages=answered,
                                extra_body={**GREEDY, "cache_salt": salt})
    assert reply.stop_reason in ("end_turn", "max_tokens", "tool_use") and reply.content
    assert reply.usage.cache_read_input_tokens > 0  # the turn before (same salt) is a cached prefix

    seen = []
    with sdk.messages.stream(**forced, extra_body={**GREEDY, "cache_salt": uuid.uuid4().hex}) as stream:
        for event in stream:
            seen.append(event.type)
        final = stream.get_final_message()
    assert "input_json" in seen and seen[-1] == "message_stop"
    [streamed] = [block for block in final.content if block.type == "tool_use"]
    assert (streamed.name, streamed.input) == (use.name, use.input)
    assert final.stop_reason == "tool_use"


def tool_result_only(tool_use_id: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use_id, "content": "42"}]}]


BAD = {
    "unknown block type": ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}, 400, "'image'"),
    "tool_result without tool_use": ({"max_tokens": 4, "messages": tool_result_only("toolu_missing")}, 400,
                                     "'toolu_missing'"),
    "missing max_tokens": ({"messages": QUESTION}, 400, "max_tokens"),
    "wrong type in tools": ({"max_tokens": 4, "messages": QUESTION,
                             "tools": [{"name": "get_weather", "input_schema": "a string"}]}, 400, "tools.0.input_schema"),
    "unknown model": ({"model": "claude-unknown", "max_tokens": 4, "messages": QUESTION}, 404, "claude-unknown"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_gets_an_anthropic_error_and_the_server_stays_healthy(server, case):
    payload, status, needle = BAD[case]
    response = httpx.post(f"{server.base_url}/v1/messages", json={"model": MODEL, **payload}, timeout=60)
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and needle in body["error"]["message"], body
    assert body["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    if "max_tokens" in payload:  # without it the SDK refuses to send
        error = anthropic.NotFoundError if status == 404 else anthropic.BadRequestError
        with pytest.raises(error, match=needle):
            client(server).messages.create(**{"model": MODEL, **payload})
    server.assert_healthy()
