"""What the router reads from a request before it picks a replica: the API, the session, the turn.

The session id is read as `agentjax serve` reads it (the API's own body field, then
`agent_hints.session_id`, then the `X-Session-ID` / `X-Correlation-ID` headers); a Responses chain
(`previous_response_id`) is resolved by the router, which remembers where each response was made.
The router keeps sessions per client key (a fingerprint of the key prefixes the session id), as
replicas keep them per cache namespace, so one client's session id never steers another's.
Parsing never fails a request: a body that is not JSON is forwarded as it is. Never imports jax.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agentjax.server.anthropic_serving import anthropic_session_id
from agentjax.server.serving import SESSION_HEADERS
from agentjax.server.tenancy import key_fingerprint, presented_key

MAX_SESSION_ID_CHARS = 256
APIS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/messages": "messages",
        "/v1/responses": "responses"}
RESPONSE_LOOKUP_PREFIX = "/v1/responses/"


@dataclass
class RoutingRequest:
    """One request as the router sees it. `api` is chat, completions, messages, responses (the
    generating routes), response_lookup (`GET /v1/responses/{id}`) or other (anything else)."""

    method: str
    path: str
    api: str
    session_id: str | None = None  # the router's name for the session: the client's, prefixed by its key's fingerprint
    client_session_id: str | None = None  # the session id as the client sent it (what replicas are told)
    client_key: str | None = None  # the key the client presented (the replicas' cache namespace follows from it)
    parent_session_id: str | None = None  # agent_hints.parent_session_id: a subagent's parent
    later_turn: bool | None = None  # None: the request does not say (the router's session table decides)
    expected_next_turn_s: float | None = None  # agent_hints: the tool gap before the session's next turn
    stream: bool = False
    prompt_token_ids: list[int] | None = None  # a completion's token-id prompt
    cache_salt: str | None = None
    previous_response_id: str | None = None
    response_id: str | None = None  # the stored response a lookup names
    body: dict[str, Any] | None = None
    page_keys: list[str] | None = None  # the prompt's KV page keys (hex), filled in for the prefix policy

    @property
    def generates(self) -> bool:
        return self.api in ("chat", "completions", "messages", "responses")


def parse_routing_request(method: str, path: str, headers: Mapping[str, str], raw_body: bytes) -> RoutingRequest:
    """The routing fields of a request (headers with lower-case names)."""
    routing = _parse(method, path, headers, raw_body)
    key = presented_key({name.encode("latin-1"): value.encode("latin-1") for name, value in headers.items()
                         if name in ("authorization", "x-api-key")})
    routing.client_session_id = routing.session_id
    if key:
        routing.client_key = key.decode("latin-1")
        if routing.session_id is not None:
            routing.session_id = f"{key_fingerprint(routing.client_key)[:16]}/{routing.session_id}"
    return routing


def _parse(method: str, path: str, headers: Mapping[str, str], raw_body: bytes) -> RoutingRequest:
    api = APIS.get(path, "other") if method == "POST" else "other"
    if method == "GET" and path.startswith(RESPONSE_LOOKUP_PREFIX) and path.count("/") == 3:
        return RoutingRequest(method, path, "response_lookup", response_id=path.removeprefix(RESPONSE_LOOKUP_PREFIX))
    routing = RoutingRequest(method, path, api)
    body = _json_object(raw_body) if api != "other" else None
    routing.body = body
    header_session = next((headers[name][:MAX_SESSION_ID_CHARS] for name in SESSION_HEADERS if headers.get(name)), None)
    if body is None:
        routing.session_id = header_session
        return routing
    hints = body.get("agent_hints") if isinstance(body.get("agent_hints"), dict) else {}
    routing.session_id = (_text(_own_session_field(api, body)) or _text(hints.get("session_id"))
                          or header_session)
    routing.parent_session_id = _text(hints.get("parent_session_id"))
    routing.expected_next_turn_s = _seconds(hints.get("expected_next_turn_s"))
    routing.stream = body.get("stream") is True
    routing.cache_salt = _text(body.get("cache_salt"))
    routing.previous_response_id = _text(body.get("previous_response_id")) if api == "responses" else None
    routing.later_turn = _later_turn(api, body, hints, routing.previous_response_id)
    if api == "completions":
        routing.prompt_token_ids = _token_ids(body.get("prompt"))
    return routing


def _json_object(raw_body: bytes) -> dict | None:
    try:
        value = json.loads(raw_body) if raw_body else None
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


def _text(value: Any) -> str | None:
    return value[:MAX_SESSION_ID_CHARS] if isinstance(value, str) and value else None


def _seconds(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return float(value)
    return None


def _own_session_field(api: str, body: dict) -> Any:
    if api == "messages":
        metadata = body.get("metadata")
        user_id = metadata.get("user_id") if isinstance(metadata, dict) else None
        return anthropic_session_id(user_id) if isinstance(user_id, str) else None
    if api == "responses":
        return body.get("prompt_cache_key")
    return body.get("session_id")


def _later_turn(api: str, body: dict, hints: dict, previous_response_id: str | None) -> bool | None:
    """True when the request continues a conversation: a `turn` hint above 0, a previous response,
    or an assistant (or tool) message in the history it re-sends."""
    turn = hints.get("turn")
    if isinstance(turn, int) and not isinstance(turn, bool) and turn >= 0:
        return turn > 0
    if previous_response_id:
        return True
    items = body.get("input") if api == "responses" else body.get("messages")
    if isinstance(items, list):
        for item in items:
            if isinstance(item, dict) and (item.get("role") in ("assistant", "tool")
                                           or item.get("type") in ("function_call", "function_call_output")):
                return True
        return False
    return None


def _token_ids(prompt: Any) -> list[int] | None:
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    return None
