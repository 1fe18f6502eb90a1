"""Auth, limits and bad input against a real server: 401s, OpenAI-shaped 4xx errors, and no 5xx under
schemathesis. The server runs with an API key, a short context and a small max_tokens cap."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.e2e.conftest import running_server

MODEL = "smollm2-135m-instruct"
API_KEY = "test-key-123"
MAX_MODEL_LEN = 128
MAX_BODY = 65_536
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    flags = ("--max-model-len", str(MAX_MODEL_LEN), "--max-tokens-limit", "4",
             "--max-request-body-bytes", str(MAX_BODY))
    with running_server(tmp_path_factory, *flags, api_key=API_KEY) as process:
        yield process


@pytest.mark.slow
def test_requests_without_the_api_key_get_401_and_with_it_succeed(server):
    without = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        without.chat.completions.create(**CHAT)
    bare = httpx.post(f"{server.base_url}/v1/chat/completions", json=CHAT, timeout=30)
    assert bare.status_code == 401 and "API key" in bare.json()["error"]["message"]
    reply = server.openai().chat.completions.create(**CHAT)
    assert reply.choices[0].message.content is not None


def test_the_anthropic_routes_take_the_key_in_x_api_key(server):
    import anthropic

    count = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    wrong = anthropic.Anthropic(base_url=server.base_url, api_key="wrong-key", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.count_tokens(**count)
    bare = httpx.post(f"{server.base_url}/v1/messages/count_tokens", json=count, timeout=30)
    assert bare.status_code == 401 and bare.json()["type"] == "error"
    assert bare.json()["error"]["type"] == "authentication_error"
    right = anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0)
    assert right.messages.count_tokens(**count).input_tokens > 0


BAD_REQUESTS = {
    "invalid JSON": (b'{"model": "x", "messages": [', 400, "not valid JSON"),
    "missing messages": (json.dumps({"model": MODEL}).encode(), 400, "messages"),
    "negative max_tokens": (json.dumps({**CHAT, "max_tokens": -1}).encode(), 400, "max_tokens"),
    "prompt over max_model_len": (
        json.dumps({**CHAT, "messages": [{"role": "user", "content": "word " * 2 * MAX_MODEL_LEN}]}).encode(),
        400, f"maximum context length is {MAX_MODEL_LEN} tokens"),
    "unknown model": (json.dumps({**CHAT, "model": "gpt-17"}).encode(), 404, "gpt-17"),
    "wrongly typed agent_hints": (
        json.dumps({**CHAT, "agent_hints": {"expected_next_turn_s": "a while"}}).encode(), 400,
        "agent_hints.expected_next_turn_s"),
    "oversized body": (
        json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * (MAX_BODY + 1)}]}).encode(), 413,
        f"limit of {MAX_BODY} bytes"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_a_4xx_with_a_message_and_the_server_stays_healthy(server, case):
    payload, status, needle = BAD_REQUESTS[case]
    response = httpx.post(f"{server.base_url}/v1/chat/completions", content=payload, timeout=60,
                          headers={**server.headers, "Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert needle in error["message"] and error["type"], error
    server.assert_healthy()
    assert server.openai().models.list().data[0].id == MODEL


@pytest.mark.slow
def test_schemathesis_finds_no_server_errors(server):
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.checks import not_a_server_error

    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json", headers=server.headers)  # keyed too
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/v1/models",
                                              "/v1/responses", "/v1/responses/{response_id}", "/v1/messages",
                                              "/tokenize", "/detokenize"}
    for operation in operations:
        examples = 20 if operation.method.upper() == "POST" else 3

        @settings(max_examples=examples, deadline=None, phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck), database=None)
        @given(case=operation.as_strategy())
        def call(case):
            case.call_and_validate(headers=server.headers, checks=[not_a_server_error], timeout=120)

        call()
    server.assert_healthy()
