"""The router reads a request's session and turn as `agentjax serve` does, for every API."""
from __future__ import annotations

import json

from agentjax.router.routing_request import parse_routing_request


def parse(path: str, body: dict | bytes | None, headers: dict | None = None, method: str = "POST"):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode() if body is not None else b""
    return parse_routing_request(method, path, headers or {}, raw)


def test_the_session_id_comes_from_the_body_then_the_hints_then_the_headers():
    chat = "/v1/chat/completions"
    hints = {"session_id": "from-hints"}
    headers = {"x-session-id": "from-header", "x-correlation-id": "from-correlation"}
    assert parse(chat, {"session_id": "own", "agent_hints": hints}, headers).session_id == "own"
    assert parse(chat, {"agent_hints": hints}, headers).session_id == "from-hints"
    assert parse(chat, {}, headers).session_id == "from-header"
    assert parse(chat, {}, {"x-correlation-id": "from-correlation"}).session_id == "from-correlation"
    assert parse(chat, {}).session_id is None


def test_each_api_names_its_session_in_its_own_field():
    claude_code_user = json.dumps({"device_id": "d", "session_id": "claude-session"})
    messages = parse("/v1/messages", {"metadata": {"user_id": claude_code_user}, "messages": []})
    assert messages.session_id == "claude-session" and messages.api == "messages"
    assert parse("/v1/messages", {"metadata": {"user_id": "plain-user"}}).session_id == "plain-user"
    responses = parse("/v1/responses", {"prompt_cache_key": "codex-conversation", "input": "hi"})
    assert responses.session_id == "codex-conversation" and responses.api == "responses"
    assert parse("/v1/completions", {"session_id": "c", "prompt": [5, 6]}).session_id == "c"
    subagent = parse("/v1/completions", {"agent_hints": {"session_id": "sub", "parent_session_id": "main"}})
    assert (subagent.session_id, subagent.parent_session_id) == ("sub", "main")


def test_a_later_turn_is_told_by_the_turn_hint_or_by_the_history_it_resends():
    chat = "/v1/chat/completions"
    first = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    later = first + [{"role": "assistant", "content": "a"}, {"role": "user", "content": "u2"}]
    assert parse(chat, {"messages": first}).later_turn is False
    assert parse(chat, {"messages": later}).later_turn is True
    assert parse(chat, {"messages": later, "agent_hints": {"turn": 0}}).later_turn is False
    assert parse(chat, {"messages": first, "agent_hints": {"turn": 3}}).later_turn is True
    tool_output = [{"type": "function_call_output", "call_id": "c", "output": "ok"}]
    assert parse("/v1/responses", {"input": tool_output}).later_turn is True
    assert parse("/v1/responses", {"input": "hi", "previous_response_id": "resp_1"}).later_turn is True
    assert parse("/v1/completions", {"prompt": [1, 2, 3]}).later_turn is None


def test_a_completion_with_token_ids_carries_them_and_its_cache_salt():
    routing = parse("/v1/completions", {"prompt": [7, 8, 9], "cache_salt": "tenant", "stream": True})
    assert routing.prompt_token_ids == [7, 8, 9] and routing.cache_salt == "tenant" and routing.stream
    assert parse("/v1/completions", {"prompt": "text"}).prompt_token_ids is None


def test_a_body_that_is_not_json_still_routes_by_header():
    routing = parse("/v1/chat/completions", b"{not json", {"x-session-id": "s"})
    assert routing.body is None and routing.session_id == "s" and routing.generates


def test_stored_response_lookups_and_other_routes_are_told_apart():
    lookup = parse("/v1/responses/resp_123", None, method="GET")
    assert lookup.api == "response_lookup" and lookup.response_id == "resp_123"
    assert parse("/v1/models", None, method="GET").api == "other"
    assert parse("/tokenize", {"prompt": "x"}).api == "other"
    assert parse("/v1/messages/count_tokens", {"messages": []}).api == "other"
