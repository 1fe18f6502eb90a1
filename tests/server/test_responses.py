"""/v1/responses on scripted fake engines, through the official `openai` SDK: text and function-call
output items, the stream's event order, previous_response_id chains in one session, the bounded
store, and errors in OpenAI's shape."""
from __future__ import annotations

import json

import openai
import pytest
from starlette.testclient import TestClient

from agentjax.server.app import create_app
from agentjax.server.responses_convert import ResponseStore, StoredResponse
from tests.server.fakes import FakeTokenizer
from tests.server.test_anthropic_messages import CALL_TEXT, MODEL, ScriptedEngine

TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city", "strict": False,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


class PromptRecordingEngine(ScriptedEngine):
    def __init__(self, script: str):
        super().__init__(script)
        self.prompts: list[str] = []

    def add_request(self, prompt, sampling, request_id=None, **kwargs):
        self.prompts.append(FakeTokenizer().decode(prompt))
        return super().add_request(prompt, sampling, request_id, **kwargs)


def make(script: str) -> tuple[TestClient, openai.OpenAI]:
    engine = PromptRecordingEngine(script)
    client = TestClient(create_app(engine, FakeTokenizer(), model_name=MODEL))
    client.engine = engine
    sdk = openai.OpenAI(base_url=f"{client.base_url}/v1", api_key="unused", http_client=client, max_retries=0)
    return client, sdk


def test_a_text_reply_is_one_message_item_with_usage():
    client, sdk = make("Hello there.")
    with client:
        response = sdk.responses.create(model=MODEL, input="Say hello", instructions="Be brief.", max_output_tokens=50)
    assert response.status == "completed" and response.output_text == "Hello there."
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert response.usage.output_tokens == len("Hello there.")
    assert response.usage.input_tokens == len("<system>Be brief.<user>Say hello<assistant>")
    assert response.usage.input_tokens_details.cached_tokens == 0


def test_the_stream_sends_the_responses_event_sequence_and_reassembles_to_the_plain_reply():
    client, sdk = make("Let me look.\n" + CALL_TEXT)
    with client:
        plain = sdk.responses.create(model=MODEL, input="Weather in Paris?", tools=[TOOL], max_output_tokens=120)
        events = list(sdk.responses.create(model=MODEL, input="Weather in Paris?", tools=[TOOL],
                                           max_output_tokens=120, stream=True))
    kinds = [event.type for event in events]
    fragments = kinds.count("response.function_call_arguments.delta")
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * kinds.count("response.output_text.delta"),
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", *["response.function_call_arguments.delta"] * fragments,
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert fragments == len('{"city": "Paris"}')  # the arguments stream as they decode
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert [item.type for item in final.output] == [item.type for item in plain.output] == ["message", "function_call"]
    assert final.output_text == plain.output_text == "Let me look."
    call, plain_call = final.output[1], plain.output[1]
    assert (call.name, call.arguments) == (plain_call.name, plain_call.arguments) == ("get_weather", '{"city": "Paris"}')
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert streamed == call.arguments


def test_a_function_call_output_sent_with_previous_response_id_continues_the_chain_in_one_session():
    client, sdk = make(CALL_TEXT)
    with client:
        first = sdk.responses.create(model=MODEL, input="Weather in Paris?", tools=[TOOL],
                                     tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=100)
        call = first.output[0]
        assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
        second = sdk.responses.create(model=MODEL, previous_response_id=first.id, tools=[TOOL], max_output_tokens=5,
                                      input=[{"type": "function_call_output", "call_id": call.call_id,
                                              "output": "21 C"}])
        third = sdk.responses.create(model=MODEL, previous_response_id=second.id, input="Thanks", max_output_tokens=3)
        assert sdk.responses.retrieve(second.id).id == second.id
    sessions = [add[2] for add in client.engine.calls if add[0] == "add"]
    assert sessions[0] == sessions[1] == sessions[2] == f"session-{first.id}"
    assert second.previous_response_id == first.id and second.status == "incomplete"
    assert second.incomplete_details.reason == "max_output_tokens"
    # The second prompt is the first's, its call and the tool result: it starts with the first prompt.
    assert second.usage.input_tokens > first.usage.input_tokens + len("21 C")
    assert third.usage.input_tokens > second.usage.input_tokens


def test_prompt_cache_key_is_the_session_id_and_store_false_keeps_nothing():
    client, sdk = make("ok")
    with client:
        response = sdk.responses.create(model=MODEL, input="hi", prompt_cache_key="conv-7", store=False,
                                        include=["reasoning.encrypted_content"], reasoning={"summary": "auto"},
                                        extra_body={"client_metadata": {"x": "1"}}, max_output_tokens=2)
        with pytest.raises(openai.NotFoundError) as missing:
            sdk.responses.create(model=MODEL, input="again", previous_response_id=response.id)
    assert [add[2] for add in client.engine.calls if add[0] == "add"] == ["conv-7"]
    error = missing.value.body
    assert error["code"] == "previous_response_not_found" and error["param"] == "previous_response_id"
    assert response.id in error["message"]


def test_codex_style_input_items_render_as_a_chat():
    client, sdk = make("done")
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Do it"}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "A"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]
    tools = [TOOL, {"type": "web_search", "external_web_access": False}, {"type": "namespace", "name": "x", "tools": []}]
    with client:
        response = client.post("/v1/responses", json={"model": MODEL, "input": items, "tools": tools, "stream": False,
                                                      "store": False, "max_output_tokens": 4})
    assert response.status_code == 200, response.text
    assert client.engine.prompts == ["<system>Rules.<user>Do it<assistant><tool>sunny<assistant>"]
    assert response.json()["output"][0]["content"][0]["text"] == "done"


@pytest.mark.parametrize("body, status, param", [
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, 400, "input[0].call_id"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, 400, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input[0].content[0]"),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]}, 400, "tools[0]"),
    ({"input": "hi", "tool_choice": "required"}, 400, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema"),
    ({"input": "hi", "max_output_tokens": 10_000}, 400, "max_output_tokens"),
    ({"input": "hi", "model": "gpt-9"}, 404, "model"),
])
def test_bad_requests_get_openai_shaped_errors_naming_the_field(body, status, param):
    client, _ = make("x")
    with client:
        response = client.post("/v1/responses", json={"model": MODEL, **body})
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["param"] == param and error["message"], error
        assert client.get("/v1/responses/resp_missing").status_code == 404


def test_the_store_drops_the_least_recently_used_beyond_its_bounds():
    store = ResponseStore(max_responses=2, max_chars=100)
    for name in ("a", "b", "c"):
        store.put(name, StoredResponse([], {}, name, 10))
    assert store.get("a") is None and store.get("b") is not None
    store.put("big", StoredResponse([], {}, "big", 95))
    assert list(store.items) == ["big"] and store.chars == 95
