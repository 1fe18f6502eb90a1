"""The Responses API with the official `openai` SDK (`client.responses.create`) against the server the
README's main command starts (the embedded SmolLM2): plain text, the streamed event sequence, a
forced function call whose output goes back with previous_response_id (and reads the cache), and a
JSON-schema text.format reply that validates."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

MODEL = "smollm2-135m-instruct"
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                  "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
          "parameters": WEATHER_SCHEMA, "strict": True}]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(main_server):
    return main_server.openai()


def test_a_plain_text_response(client):
    response = client.responses.create(model=MODEL, input="What is the capital of France?",
                                       instructions="Answer in one word.", max_output_tokens=16, temperature=0)
    assert response.object == "response" and response.status in ("completed", "incomplete")
    assert response.output[0].type == "message" and response.output_text.strip()
    assert response.usage.input_tokens > 0 and 0 < response.usage.output_tokens <= 16


def test_the_stream_sends_events_in_order_and_joins_to_the_final_text(client):
    events = list(client.responses.create(model=MODEL, input="Say hello to the team.", max_output_tokens=12,
                                          temperature=0, stream=True))
    kinds = [event.type for event in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas > 1
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete" if kinds[-1] == "response.incomplete" else "response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text


@pytest.fixture(scope="module")
def forced_call(client):
    return client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=TOOLS,
                                   tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=48,
                                   temperature=0)


def test_a_forced_function_call_validates_against_its_schema(forced_call):
    assert forced_call.status == "completed"
    [call] = forced_call.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)


def test_the_call_output_sent_back_with_previous_response_id_reads_the_cache(client, forced_call):
    call = forced_call.output[0]
    follow_up = client.responses.create(
        model=MODEL, previous_response_id=forced_call.id, tools=TOOLS, tool_choice="none", max_output_tokens=16,
        temperature=0, input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21}'}])
    assert follow_up.previous_response_id == forced_call.id and follow_up.output_text.strip()
    assert follow_up.usage.input_tokens > forced_call.usage.input_tokens
    assert follow_up.usage.input_tokens_details.cached_tokens >= 16  # at least the first prompt's first page
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, previous_response_id="resp_unknown", input="hi", max_output_tokens=2)


def test_a_json_schema_text_format_reply_validates(client):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "legs": {"type": "integer"}},
              "required": ["name", "legs"], "additionalProperties": False}
    response = client.responses.create(model=MODEL, input="Describe a cat as JSON.", max_output_tokens=40,
                                       temperature=0, text={"format": {"type": "json_schema", "name": "animal",
                                                                        "schema": schema, "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
