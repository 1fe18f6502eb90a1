"""Token budgets as vLLM sets them, on the fake engine: the context left when max_tokens is omitted,
vLLM's 400 naming both numbers beyond it, and the operator's cap only when one is set."""
from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from agentjax.server.app import create_app
from agentjax.server.serving import ServerLimits
from tests.server.fakes import FakeEngine, FakeTokenizer

MODEL = "fake-model"


class RecordingEngine(FakeEngine):
    """Remembers each request's sampling settings."""

    def __init__(self):
        super().__init__()
        self.samplings = []

    def add_request(self, prompt, sampling, request_id=None, **kwargs):
        self.samplings.append(sampling)
        return super().add_request(prompt, sampling, request_id, **kwargs)


def client_for(limits: ServerLimits = ServerLimits()) -> TestClient:
    engine = RecordingEngine()
    client = TestClient(create_app(engine, FakeTokenizer(), model_name=MODEL, limits=limits))
    client.engine = engine
    return client


def chat(content: str, **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}


PROMPT_LEN = len("<user>hello<assistant>")  # FakeTokenizer: one token per character


def test_an_omitted_max_tokens_is_the_context_left_after_the_prompt():
    with client_for() as client:
        body = client.post("/v1/chat/completions", json=chat("hello")).json()
        assert client.engine.samplings[-1].max_tokens == FakeEngine.max_model_len - PROMPT_LEN
        assert body["choices"][0]["finish_reason"] == "length"


def test_a_budget_that_fits_the_context_is_accepted_whatever_its_size():
    with client_for() as client:
        left = FakeEngine.max_model_len - PROMPT_LEN
        response = client.post("/v1/chat/completions", json=chat("hello", max_completion_tokens=left))
        assert response.status_code == 200 and client.engine.samplings[-1].max_tokens == left


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_budget_over_the_context_left_is_vllms_400_naming_both_numbers(field):
    with client_for() as client:
        asked = FakeEngine.max_model_len - PROMPT_LEN + 1
        response = client.post("/v1/chat/completions", json=chat("hello", **{field: asked}))
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["message"] == (
            f"'{field}' is too large: {asked}. This model's maximum context length is 256 tokens and your "
            f"request has {PROMPT_LEN} input tokens ({asked} > 256 - {PROMPT_LEN})")
        assert error["param"] == field and error["code"] == "context_length_exceeded"


def test_a_text_completion_over_the_context_gets_the_same_400():
    with client_for() as client:
        response = client.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 253})
        assert response.status_code == 400 and "(253 > 256 - 4)" in response.json()["error"]["message"]


def test_the_operator_cap_applies_only_when_set():
    with client_for(ServerLimits(max_tokens_limit=32)) as client:
        response = client.post("/v1/chat/completions", json=chat("hello", max_tokens=33))
        assert response.status_code == 400 and "--max-tokens-limit" in response.json()["error"]["message"]
        client.post("/v1/chat/completions", json=chat("hello"))
        assert client.engine.samplings[-1].max_tokens == 32  # an omitted budget stops at the cap too
    with client_for() as client:
        assert client.post("/v1/chat/completions", json=chat("hello", max_tokens=200)).status_code == 200


def test_a_prompt_that_fills_the_context_is_a_400_in_vllms_words():
    with client_for() as client:
        response = client.post("/v1/chat/completions", json=chat("x" * 240))
        assert response.status_code == 400
        message = response.json()["error"]["message"]
        assert message.startswith("This model's maximum context length is 256 tokens. However, your request has 257")


def test_a_server_default_budget_applies_only_to_requests_without_one():
    with client_for(ServerLimits(default_max_tokens=7)) as client:
        client.post("/v1/chat/completions", json=chat("hello"))
        client.post("/v1/chat/completions", json=chat("hello", max_tokens=50))
        client.post("/v1/chat/completions", json=chat("x" * 236))  # 3 tokens of context left
        assert [s.max_tokens for s in client.engine.samplings] == [7, 50, 3]


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/chat/completions", chat("x" * 300), "messages"),
    ("/v1/completions", {"model": MODEL, "prompt": "x" * 300}, "prompt"),
    ("/v1/responses", {"model": MODEL, "input": "x" * 300}, "input"),
])
def test_a_prompt_over_the_context_names_the_routes_own_prompt_field(path, body, field):
    with client_for() as client:
        response = client.post(path, json=body)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == field and error["code"] == "context_length_exceeded"
        assert "messages" not in error["message"] or field == "messages"


class TinyPoolEngine(RecordingEngine):
    """Refuses requests as the real engine does when its KV pool cannot hold them."""

    def add_request(self, prompt, sampling, request_id=None, **kwargs):
        from agentjax.errors import OutOfPagesError

        if len(prompt) > 50:
            raise OutOfPagesError("the prompt needs more KV pages than the pool's", cause="prompt")
        if sampling.max_tokens > 20:
            raise OutOfPagesError("the prompt plus max_tokens need more KV pages", cause="max_tokens")
        return super().add_request(prompt, sampling, request_id, **kwargs)


@pytest.mark.parametrize(("path", "prompt_body", "prompt_field"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 60}]}, "messages"),
    ("/v1/completions", {"prompt": "x" * 60}, "prompt"),
])
def test_a_request_the_kv_pool_cannot_hold_names_its_cause(path, prompt_body, prompt_field):
    engine = TinyPoolEngine()
    with TestClient(create_app(engine, FakeTokenizer(), model_name=MODEL)) as client:
        too_long = client.post(path, json={"model": MODEL, "max_tokens": 5, **prompt_body})
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == prompt_field
        short = {"messages": [{"role": "user", "content": "hi"}]} if prompt_field == "messages" else {"prompt": "hi"}
        too_much_output = client.post(path, json={"model": MODEL, "max_tokens": 30, **short})
        assert too_much_output.status_code == 400
        assert too_much_output.json()["error"]["param"] == "max_tokens"
        assert too_much_output.json()["error"]["code"] == "kv_pool_too_small"


class GrammarEngine(FakeEngine):
    """A fake engine with the real structured-output backend (SmolLM2's tokenizer), compiling a request's
    constraint in `add_request` as `Engine` does."""

    backend = None

    @property
    def grammar(self):
        if GrammarEngine.backend is None:
            from agentjax.models import _tokenizer_from_gguf
            from agentjax.structured.backend import GrammarBackend
            from checkpoints.embedded import smollm2_path

            tokenizer = _tokenizer_from_gguf(smollm2_path())
            GrammarEngine.backend = GrammarBackend(tokenizer, tokenizer.vocab_size, tokenizer.stop_token_ids)
        return GrammarEngine.backend

    def add_request(self, prompt, sampling, request_id=None, **kwargs):
        if sampling.structured is not None:
            self.grammar.new_matcher(sampling.structured)
        return super().add_request(prompt, sampling, request_id, **kwargs)


def tool(name: str, argument_type: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": "d" * 2000, "parameters": {
        "type": "object", "properties": {"a": {"type": argument_type}}}}}


def test_a_tool_schema_is_checked_under_auto_as_under_a_forced_choice_with_a_short_message():
    tools = [tool(f"ok_{i}", "string") for i in range(20)] + [tool("broken", "nonsense")]
    with TestClient(create_app(GrammarEngine(), FakeTokenizer(), model_name=MODEL)) as client:
        answers = {str(choice): client.post("/v1/chat/completions", json=chat("hi", tools=tools, tool_choice=choice,
                                                                             max_tokens=2))
                   for choice in ("auto", "required", {"type": "function", "function": {"name": "broken"}})}
        fine = client.post("/v1/chat/completions", json=chat("hi", tools=tools[:20], max_tokens=2))
    errors = {choice: answer.json()["error"] for choice, answer in answers.items()}
    assert all(answer.status_code == 400 for answer in answers.values()), errors
    assert len({error["message"] for error in errors.values()}) == 1, errors  # the same check, the same words
    error = errors["auto"]
    assert error["param"] == "tools" and "Invalid type: nonsense" in error["message"]
    assert len(error["message"]) < 400 and "%json" not in error["message"]  # not the tools' grammar (~45 KB)
    assert fine.status_code == 200
