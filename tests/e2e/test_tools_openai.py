"""Tool calling and structured output on the OpenAI API, with the official `openai` client against the
server the README's main command starts (the embedded SmolLM2, whose template has no tool support)."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

MODEL = "smollm2-135m-instruct"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER_SCHEMA}}]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(main_server):
    return main_server.openai()


@pytest.fixture(scope="module")
def forced_call(client):
    """A greedy reply with tool_choice naming the tool (decoding constrained to its schema)."""
    return client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=NAMED,
                                          max_tokens=48, temperature=0)


def test_a_named_tool_choice_yields_a_call_whose_arguments_validate(forced_call):
    choice = forced_call.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)


def test_streamed_tool_call_deltas_reassemble_to_the_same_call(client, forced_call):
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=NAMED,
                                            max_tokens=48, temperature=0, stream=True)
    calls: dict[int, dict] = {}
    finish_reason, text = None, ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for part in delta.tool_calls or ():
            call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = part.id or call["id"]
            call["name"] += (part.function and part.function.name) or ""
            call["arguments"] += (part.function and part.function.arguments) or ""
        finish_reason = chunk.choices[0].finish_reason or finish_reason
    expected = forced_call.choices[0].message.tool_calls[0]
    assert finish_reason == "tool_calls" and text == ""
    assert list(calls) == [0] and calls[0]["id"]
    assert (calls[0]["name"], calls[0]["arguments"]) == (expected.function.name, expected.function.arguments)


def test_sending_the_tool_result_back_yields_a_normal_reply(client, forced_call):
    call = forced_call.choices[0].message.tool_calls[0]
    messages = [*QUESTION,
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                           max_tokens=24, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls is None
    assert choice.message.content.strip()
    # The turn re-sends the call as the model wrote it, so the prompt's start is a cache hit.
    assert reply.usage.prompt_tokens_details.cached_tokens > 0


def test_tools_with_auto_never_fail_even_with_odd_history(client):
    """The template renders any tool history; output the parser cannot read comes back as text."""
    odd_call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "not json {"}}
    messages = [*QUESTION, {"role": "assistant", "content": "Let me check.", "tool_calls": [odd_call]},
                {"role": "tool", "tool_call_id": "c1", "content": "error: bad arguments"},
                {"role": "user", "content": "Answer in one word."}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=16,
                                           temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    if choice.message.tool_calls:
        for call in choice.message.tool_calls:
            assert call.function.name == "get_weather"
            json.loads(call.function.arguments)
    else:
        assert choice.message.content


def test_response_format_json_schema_returns_json_that_validates(client):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a cat as JSON."}], max_tokens=40,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "cat", "schema": schema}})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "a string"}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}}, None),
])
def test_bad_tool_requests_get_a_400_naming_the_field(main_server, body, param):
    response = httpx.post(f"{main_server.base_url}/v1/chat/completions", headers=main_server.headers,
                          json={"model": MODEL, "messages": QUESTION, "max_tokens": 4, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert (error["param"] or "").startswith(param), error
    main_server.assert_healthy()


REQUIRED_PROMPTS = [
    "What is the weather in Paris?", "Is it raining in Tokyo right now?", "How cold is Oslo today?",
    "Weather report for Cairo, please.", "Should I take an umbrella in London?", "Temperature in Lima?",
    "Is it sunny in Madrid and in Rome?", "What's the forecast for Sydney?", "Wind in Chicago today?",
    "Check the weather in Nairobi.",
]


def test_required_parallel_calls_end_with_tool_calls_and_stream_their_arguments(main_server):
    """tool_choice "required" with parallel calls: every reply ends after whole calls (never by running
    to max_tokens), and its streamed deltas (arguments in several fragments, the first before the
    call is complete) reassemble to the non-streamed calls."""
    import asyncio

    client = main_server.async_openai()
    request = {"model": MODEL, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": True,
               "max_tokens": 256, "temperature": 0}

    async def one(prompt: str):
        messages = [{"role": "user", "content": prompt}]
        plain = await client.chat.completions.create(messages=messages, **request)
        calls, fragments, finish = {}, 0, None
        async for chunk in await client.chat.completions.create(messages=messages, stream=True, **request):
            for part in chunk.choices[0].delta.tool_calls or ():
                call = calls.setdefault(part.index, {"name": "", "arguments": ""})
                call["name"] += (part.function and part.function.name) or ""
                call["arguments"] += (part.function and part.function.arguments) or ""
                fragments += bool(part.function and part.function.arguments)
            finish = chunk.choices[0].finish_reason or finish
        return plain.choices[0], calls, fragments, finish

    async def all_prompts():
        return await asyncio.gather(*(one(prompt) for prompt in REQUIRED_PROMPTS))

    for choice, calls, fragments, finish in asyncio.run(all_prompts()):
        assert choice.finish_reason == finish == "tool_calls", (choice, finish)
        expected = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert [(c["name"], c["arguments"]) for c in calls.values()] == expected
        assert len(set(expected)) == len(expected)  # no call repeated
        assert fragments > len(expected)  # arguments came in pieces, not as one string per call
        for _, arguments in expected:
            jsonschema.validate(json.loads(arguments), WEATHER_SCHEMA)
