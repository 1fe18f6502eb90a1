"""A replica's read-only view of its prefix cache for routers: `GET /kv/events`, `POST /kv/prompt_hashes`.

The engine thread hands the KV manager's events (`agentjax.kv.events`) of one routing group to a
`KVEventLog` after every step; the log keeps a mirror of the hashes that group can hit and a bounded
ring of numbered changes, so a router polls only what changed (or gets a snapshot after a gap or a
restart). `/kv/prompt_hashes` names a request's prompt blocks the way the cache does, in the caller's
cache namespace or, for an operator that names one (`X-Agentjax-Tenant-Key`), in that key's. Both
reveal what is cached, so with keys set they need an operator key (`agentjax.server.guard`). Nothing
here touches the engine: the mirror lives beside it. Never imports jax.
"""
from __future__ import annotations

import threading
import uuid
from collections import deque
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Query, Request
from pydantic import BaseModel, Field, ValidationError

from agentjax.kv.events import BlockRemoved, BlockStored
from agentjax.kv.hashing import block_hashes
from agentjax.server import anthropic_protocol
from agentjax.server.errors import APIError, AuthenticationError, NotFoundError
from agentjax.server.protocol import ChatCompletionRequest, CompletionRequest
from agentjax.server.responses_convert import chat_input_of
from agentjax.server.responses_protocol import ResponsesRequest
from agentjax.server.tenancy import TENANT_KEY_HEADER, Tenant, tenant_of

MAX_EVENTS_PER_POLL = 50_000
PROMPT_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")


class KVEventLog:
    """The hittable hashes of one KV group, and their numbered changes (thread-safe: the engine
    thread applies, the event loop reads). `epoch` changes with every process start."""

    def __init__(self, group: int, block_size: int, hashes_per_page: int, hit_rule: str,
                 max_events: int = 200_000):
        self.group = group
        self.block_size = block_size
        self.hashes_per_page = hashes_per_page
        self.hit_rule = hit_rule
        self.epoch = uuid.uuid4().hex
        self.cached: set[bytes] = set()
        self.changes: deque[tuple[int, bool, bytes]] = deque(maxlen=max_events)  # (number, stored, hash)
        self.next_number = 0
        self._lock = threading.Lock()

    def apply(self, events: Sequence[Any]) -> None:
        """Called by the engine thread with `KVCacheManager.take_events()`."""
        with self._lock:
            for event in events:
                if event.group != self.group:
                    continue
                if isinstance(event, BlockStored):
                    self.cached.add(event.block_hash)
                    self.changes.append((self.next_number, True, event.block_hash))
                elif isinstance(event, BlockRemoved):
                    self.cached.discard(event.block_hash)
                    self.changes.append((self.next_number, False, event.block_hash))
                else:
                    continue
                self.next_number += 1

    def read(self, after: int, epoch: str | None, limit: int = MAX_EVENTS_PER_POLL) -> dict:
        """Changes numbered >= `after` (at most `limit`), or the whole mirror as `snapshot` when the
        caller's `epoch` differs or the changes it needs have left the ring."""
        with self._lock:
            oldest = self.changes[0][0] if self.changes else self.next_number
            header = {"epoch": self.epoch, "group": self.group, "block_size": self.block_size,
                      "hashes_per_page": self.hashes_per_page, "hit_rule": self.hit_rule}
            if epoch != self.epoch or after < oldest or after > self.next_number:
                return {**header, "snapshot": True, "next": self.next_number, "more": False,
                        "events": [["+", h.hex()] for h in self.cached]}
            start = after - oldest
            picked = [self.changes[i] for i in range(start, min(len(self.changes), start + limit))]
            next_number = picked[-1][0] + 1 if picked else after
            return {**header, "snapshot": False, "next": next_number, "more": next_number < self.next_number,
                    "events": [["+" if stored else "-", h.hex()] for _, stored, h in picked]}

    def page_keys(self, token_ids: Sequence[int], cache_salt: str | None) -> list[bytes]:
        """The hashes this group's pages of `token_ids` are cached under."""
        hashes = block_hashes(token_ids, self.block_size, cache_salt)
        step = self.hashes_per_page
        return hashes if step == 1 else hashes[step - 1::step]


def attach_kv_event_log(async_engine: Any) -> KVEventLog | None:
    """Turns on the engine's KV events (before its thread starts) and returns the log fed from
    them; None for an engine without a prefix cache (a test fake). The routing group is the first
    full-attention group, else group 0."""
    kv = getattr(async_engine.engine, "kv", None)
    if kv is None or not hasattr(kv, "enable_events") or not getattr(kv, "enable_caching", False) or \
            not getattr(kv, "plan", None):
        return None
    chosen = kv.prefix_group() or kv.plan.groups[0]
    log = KVEventLog(chosen.group_id, kv.block_size, kv.hashes_per_page(chosen.group_id), chosen.spec.hit_rule)
    kv.enable_events()
    async_engine.kv_event_sink = (kv.take_events, log.apply)
    return log


class PromptHashesRequest(BaseModel):
    path: str = Field(description="the route the body is for: " + ", ".join(PROMPT_PATHS))
    body: dict[str, Any]


def install_kv_routes(app: FastAPI, log: KVEventLog | None, serving: Any, messages_serving: Any,
                      responses_serving: Any) -> None:
    """`GET /kv/events` and `POST /kv/prompt_hashes` (404 with a clear message when `log` is None)."""

    def require_log() -> KVEventLog:
        if log is None:
            raise NotFoundError("this server keeps no prefix cache events", code="kv_events_unavailable")
        return log

    @app.get("/kv/events")
    async def kv_events(after: int = Query(0, ge=0), epoch: str | None = None,
                        limit: int = Query(MAX_EVENTS_PER_POLL, ge=1, le=MAX_EVENTS_PER_POLL)) -> dict:
        """Changes to the routing group's cached block hashes since change number `after`."""
        return require_log().read(after, epoch, limit)

    @app.post("/kv/prompt_hashes")
    async def prompt_hashes(wanted: PromptHashesRequest, request: Request) -> dict:
        """The page keys the prompt of `body` (a request for `path`) would be cached under: in the
        namespace of the key in the `X-Agentjax-Tenant-Key` header when there is one, else the caller's."""
        events = require_log()
        tenant = tenant_of(request.scope)
        named = request.headers.get(TENANT_KEY_HEADER)
        if named is not None:
            tenant = request.app.state.keys.tenant_for(named.strip())
            if tenant is None:
                raise AuthenticationError(f"the {TENANT_KEY_HEADER} header holds no key of this server",
                                          param=TENANT_KEY_HEADER, code="invalid_api_key")
        tokens, salt, _ = await serving.chat_path.off_loop(parse_prompt, wanted.path, wanted.body, tenant, serving,
                                                           messages_serving, responses_serving)
        keys = events.page_keys(tokens, salt) if tokens else []
        return {"epoch": events.epoch, "num_tokens": len(tokens),
                "tokens_per_key": events.block_size * events.hashes_per_page, "page_keys": [k.hex() for k in keys]}


def parse_prompt(path: str, body: dict, tenant: Tenant, serving: Any, messages_serving: Any,
                 responses_serving: Any) -> tuple[list[int], str | None, BaseModel]:
    """(prompt token ids, cache salt in `tenant`'s namespace, the validated body) of a request for
    `path` that `tenant` sends, as its route builds them."""
    tokens, salt, parsed = _parse_prompt(path, body, tenant, serving, messages_serving, responses_serving)
    return tokens, tenant.salt(salt), parsed


def _parse_prompt(path: str, body: dict, tenant: Tenant, serving: Any, messages_serving: Any,
                  responses_serving: Any) -> tuple[list[int], str | None, BaseModel]:
    try:
        if path == "/v1/chat/completions":
            chat_body = ChatCompletionRequest.model_validate(body)
            return serving.chat_path.prompt_ids(serving.chat_input_of(chat_body)), chat_body.cache_salt, chat_body
        if path == "/v1/completions":
            completion = CompletionRequest.model_validate(body)
            prompt = completion.prompt
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                prompt = prompt[0]
            tokens = serving.chat_path.text_ids(prompt) if isinstance(prompt, str) else list(prompt)
            return tokens, completion.cache_salt, completion
        if path == "/v1/messages":
            message = anthropic_protocol.MessagesRequest.model_validate(body)
            return messages_serving.prepare(message)[1], message.cache_salt, message
        if path == "/v1/responses":
            response = ResponsesRequest.model_validate(body)
            previous = (responses_serving.store.get(response.previous_response_id, tenant.namespace)
                        if response.previous_response_id else None)
            chat, _ = chat_input_of(response, previous.messages if previous is not None else [])
            return serving.chat_path.prompt_ids(chat), response.cache_salt, response
    except ValidationError as error:
        raise APIError(f"body is not a valid request for {path}: {error.errors()[0].get('msg')}",
                       param="body") from None
    raise APIError(f"path {path!r} has no prompt; use one of {', '.join(PROMPT_PATHS)}", param="path")
