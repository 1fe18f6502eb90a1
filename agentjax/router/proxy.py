"""Forwarding one request to one replica with httpx, bytes unchanged, server-sent events streamed.

A streamed reply is held back until its first event that carries output (a token, a tool call, a
finish, usage or an error): until then nothing has reached the client, so a replica that fails can
be replaced (`ForwardFailure`) without a duplicate reply. After that the bytes pass through as they
arrive; a replica that dies mid-stream ends the client's stream with an error event in its API's
shape. Headers pass through (auth included) except hop-by-hop ones. Never imports jax.
"""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from starlette.responses import Response, StreamingResponse

from agentjax.router.replicas import Replica

logger = logging.getLogger(__name__)

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                        "trailers", "transfer-encoding", "upgrade", "host", "content-length"})
NOT_FORWARDED_REQUEST = HOP_BY_HOP | {"accept-encoding"}  # replicas answer uncompressed: bytes pass unchanged
NOT_FORWARDED_RESPONSE = HOP_BY_HOP | {"date", "server"}
RETRYABLE_STATUSES = frozenset({502, 503, 504})
REPLICA_HEADER = "x-agentjax-replica"
MAX_HELD_BYTES = 256 * 1024  # a stream's opening events beyond this are sent even without output
# Events that open a reply before any output: Anthropic's and the Responses API's.
OPENING_EVENT_TYPES = frozenset({"message_start", "content_block_start", "ping", "response.created",
                                 "response.in_progress", "response.output_item.added",
                                 "response.content_part.added"})


class ForwardFailure(Exception):
    """The replica failed before anything reached the client; the request may go elsewhere.
    `replica_broken`: it refused the connection or broke its reply (it is probably gone); a
    connection dropped before any reply, a timeout or a refusal status only count as one failed
    check (a kept-alive connection the replica has just closed looks the same as a dead replica)."""

    def __init__(self, reason: str, detail: str, replica_broken: bool):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.replica_broken = replica_broken


@dataclass
class Forwarded:
    """A reply on its way to the client; `response_id` is a Responses API reply's id when seen."""

    response: Response
    response_id: str | None = None

    async def discard(self) -> None:
        """Closes the replica's stream of a reply that will never be sent (the client left)."""
        if isinstance(self.response, _RelayResponse):
            await self.response.relay.finish(None)

    def when_complete(self, callback: Callable[[], None]) -> None:
        """Runs `callback` once a successful reply has reached the client whole: a whole reply now, a
        stream after its last byte (never for a stream that broke or whose client left)."""
        if isinstance(self.response, _RelayResponse):
            self.response.relay.on_complete = callback
        elif self.response.status_code == 200:
            callback()


def split_event(raw: bytes) -> tuple[str | None, Any]:
    """(event name, data) of one server-sent event; data is parsed JSON when it is JSON."""
    name, data_lines = None, []
    for line in raw.decode("utf-8", errors="replace").splitlines():
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data_lines.append(line[5:].lstrip())
    data: Any = "\n".join(data_lines) if data_lines else None
    if isinstance(data, str) and data[:1] in "{[":
        try:
            data = json.loads(data)
        except ValueError:
            pass
    return name, data


def carries_output(name: str | None, data: Any) -> bool:
    """Whether an event is past the opening of a reply (see the module docstring)."""
    if data is None:
        return False  # a comment or keep-alive
    if not isinstance(data, dict):
        return True  # [DONE] or text
    kind = name or data.get("type")
    if "error" in data or kind == "error":
        return True
    if kind in OPENING_EVENT_TYPES:
        return False
    choices = data.get("choices")
    if isinstance(choices, list):
        if not choices:
            return data.get("usage") is not None
        for choice in choices:
            if not isinstance(choice, dict):
                return True
            delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
            if choice.get("finish_reason") or choice.get("text") or delta.get("content") \
                    or delta.get("tool_calls") or delta.get("reasoning_content"):
                return True
        return False
    return True


def stream_error_event(path: str, message: str) -> bytes:
    """The event that ends a client's stream when its replica failed mid-reply."""
    if path.startswith("/v1/messages"):
        body = {"type": "error", "error": {"type": "api_error", "message": message}}
        return f"event: error\ndata: {json.dumps(body)}\n\n".encode()
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": "replica_failed"}}
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


def describe(error: BaseException) -> str:
    """`ReadError: message`, or what the error means when it carries no message."""
    return f"{type(error).__name__}: {error}" if str(error) else f"{type(error).__name__} (the connection closed)"


def forwarded_headers(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(k, v) for k, v in headers if k.lower() not in NOT_FORWARDED_REQUEST]


class Proxy:
    """Sends requests to replicas on one shared `httpx.AsyncClient`."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def forward(self, replica: Replica, method: str, path: str, query: str,
                      headers: list[tuple[str, str]], body: bytes, release: Callable[[str | None], None]) -> Forwarded:
        """The replica's reply; raises `ForwardFailure` if it failed before any output. `release`
        runs exactly once, when the reply has ended or failed: with None, or with what broke when
        the replica failed after output had reached the client."""
        release = _once(release)
        url = f"{replica.url}{path}" + (f"?{query}" if query else "")
        request = self.client.build_request(method, url, headers=forwarded_headers(headers), content=body)
        try:
            upstream = await self.client.send(request, stream=True)
        except BaseException as error:  # cancelled (the client left) or failed
            release(None)
            if not isinstance(error, httpx.HTTPError):
                raise
            disconnected = isinstance(error, (httpx.RemoteProtocolError, httpx.ReadError))
            reason = ("connect_error" if isinstance(error, httpx.ConnectError) else
                      "disconnected" if disconnected else "timeout" if isinstance(error, httpx.TimeoutException)
                      else "upstream_error")
            raise ForwardFailure(reason, describe(error), reason == "connect_error") from None
        if upstream.status_code in RETRYABLE_STATUSES:
            await _close(upstream)
            release(None)
            raise ForwardFailure(f"status_{upstream.status_code}", f"answered {upstream.status_code}", False)
        headers_out = {k: v for k, v in upstream.headers.items() if k.lower() not in NOT_FORWARDED_RESPONSE}
        headers_out[REPLICA_HEADER] = replica.url
        if not upstream.headers.get("content-type", "").startswith("text/event-stream"):
            return await self._whole(replica, upstream, headers_out, release)
        return await self._stream(replica, path, upstream, headers_out, release)

    async def _whole(self, replica: Replica, upstream: httpx.Response, headers: dict,
                     release: Callable[[str | None], None]) -> Forwarded:
        try:
            content = await upstream.aread()
        except httpx.HTTPError as error:
            raise ForwardFailure("broken_before_output", describe(error),
                                 True) from None
        finally:
            await _close(upstream)
            release(None)
        response_id = None
        if upstream.status_code == 200 and headers.get("content-type", "").startswith("application/json"):
            response_id = _response_id(content)
        return Forwarded(Response(content, upstream.status_code, headers), response_id)

    async def _stream(self, replica: Replica, path: str, upstream: httpx.Response, headers: dict,
                      release: Callable[[str | None], None]) -> Forwarded:
        chunks = upstream.aiter_raw()
        held = bytearray()
        pending = b""
        response_id = None
        ended = False
        try:
            while len(held) < MAX_HELD_BYTES:
                try:
                    chunk = await anext(chunks)
                except StopAsyncIteration:
                    ended = True
                    break
                held += chunk
                pending += chunk
                *events, pending = pending.replace(b"\r\n", b"\n").split(b"\n\n")
                parsed = [split_event(event) for event in events]
                response_id = response_id or next((_stream_response_id(d) for _, d in parsed
                                                   if _stream_response_id(d)), None)
                if any(carries_output(name, data) for name, data in parsed):
                    break
        except httpx.HTTPError as error:
            await _close(upstream)
            release(None)
            raise ForwardFailure("broken_before_output", describe(error),
                                 True) from None
        except BaseException:
            await _close(upstream)
            release(None)
            raise
        relay = _Relay(bytes(held), None if ended else chunks, upstream, replica, path, release)
        return Forwarded(_RelayResponse(relay, upstream.status_code, headers), response_id)


class _Relay:
    """The rest of a streamed reply: the held opening, then the bytes as they come; closes the
    upstream and releases exactly once, however the client's response ends."""

    def __init__(self, held: bytes, chunks: AsyncIterator[bytes] | None, upstream: httpx.Response,
                 replica: Replica, path: str, release: Callable[[str | None], None]) -> None:
        self.held, self.chunks, self.upstream = held, chunks, upstream
        self.replica, self.path, self.release = replica, path, release
        self.finished = False
        self.completed = False  # every byte reached the client
        self.on_complete: Callable[[], None] | None = None

    async def body(self) -> AsyncIterator[bytes]:
        broken = None
        try:
            yield self.held
            if self.chunks is not None:
                async for chunk in self.chunks:
                    yield chunk
            self.completed = True
        except httpx.HTTPError as error:
            broken = describe(error)
            logger.warning("replica %s failed mid-reply on %s: %s", self.replica.url, self.path, broken)
            yield stream_error_event(self.path, f"the replica serving this reply ({self.replica.url}) failed "
                                     "mid-reply; retry the turn (the router sends it to another replica)")
        finally:
            await self.finish(broken)

    async def finish(self, broken: str | None) -> None:
        if self.finished:
            return
        self.finished = True
        await _close(self.upstream)
        self.release(broken)
        if self.completed and broken is None and self.on_complete is not None and self.upstream.status_code == 200:
            self.on_complete()


class _RelayResponse(StreamingResponse):
    def __init__(self, relay: _Relay, status_code: int, headers: dict) -> None:
        super().__init__(relay.body(), status_code, headers)
        self.relay = relay

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.relay.finish(None)


def _once(release: Callable[[str | None], None]) -> Callable[[str | None], None]:
    done = False

    def release_once(broken: str | None) -> None:
        nonlocal done
        if not done:
            done = True
            release(broken)
    return release_once


async def _close(upstream: httpx.Response) -> None:
    with anyio.CancelScope(shield=True):
        try:
            await upstream.aclose()
        except httpx.HTTPError:
            pass


def _response_id(content: bytes) -> str | None:
    try:
        value = json.loads(content)
    except ValueError:
        return None
    if isinstance(value, dict) and value.get("object") == "response" and isinstance(value.get("id"), str):
        return value["id"]
    return None


def _stream_response_id(data: Any) -> str | None:
    if isinstance(data, dict) and data.get("type") == "response.created":
        response = data.get("response")
        if isinstance(response, dict) and isinstance(response.get("id"), str):
            return response["id"]
    return None
