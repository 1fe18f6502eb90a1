"""Replicas without a network: an `httpx.MockTransport` that answers for several fake replicas.

A `FakeReplica` answers /health, /metrics, /kv/events, /kv/prompt_hashes, the KV transfer routes
(/kv/prefill, /kv/flush) and the generating routes (a streamed or whole OpenAI, Anthropic or Responses reply),
records what it received, and can be made to refuse connections, answer a status, or break its
stream before or after its first output.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import httpx


def sse(payload: dict, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(payload)}\n\n".encode()


def chat_stream_events(reply_id: str, words: list[str]) -> list[bytes]:
    def chunk(delta: dict, finish: str | None = None) -> bytes:
        return sse({"id": reply_id, "object": "chat.completion.chunk", "created": 0, "model": "m",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    return [chunk({"role": "assistant", "content": ""}), *(chunk({"content": w}) for w in words),
            chunk({}, "stop"), b"data: [DONE]\n\n"]


class BreakingStream(httpx.AsyncByteStream):
    """Yields `chunks`, then raises `httpx.ReadError` if `break_after` is set (as a killed process does)."""

    def __init__(self, chunks: list[bytes], break_after: int | None = None):
        self.chunks = chunks
        self.break_after = break_after

    async def __aiter__(self):
        for index, chunk in enumerate(self.chunks):
            if index == self.break_after:
                raise httpx.ReadError("peer closed connection without sending complete message body")
            yield chunk


@dataclass
class FakeReplica:
    url: str
    mode: str = "ok"  # ok | refuse | drop | status_503 | break_before_output | break_after_output | slow | gated
    health_status: int = 200
    in_server: int = 0
    received: list[httpx.Request] = field(default_factory=list)
    kv_answer: dict | None = None  # GET /kv/events; None: 404
    cancelled: int = 0
    kv_transfer_mode: str = "ok"  # ok | degraded (503 kv_tier_degraded) | refuse
    mooncake_degraded: float | None = None  # agentjax:kv_offload_tier_degraded{tier="mooncake"} on /metrics
    kv_calls: list[tuple[str, dict, httpx.Headers]] = field(default_factory=list)  # (path, body, headers)
    gate_open: bool = False  # mode "gated": the reply waits for it
    router_calls: list[tuple[str, httpx.Headers]] = field(default_factory=list)  # the router's own calls
    prompt_hashes: list[str] = field(default_factory=list)  # POST /kv/prompt_hashes answers these page keys

    def handle(self, request: httpx.Request) -> httpx.Response:
        if self.mode == "refuse":
            raise httpx.ConnectError("All connection attempts failed", request=request)
        path = request.url.path
        if path in ("/health", "/metrics", "/kv/events", "/kv/prompt_hashes"):
            self.router_calls.append((path, request.headers))
        if path == "/kv/prompt_hashes":
            return httpx.Response(200, json={"page_keys": self.prompt_hashes})
        if path == "/health":
            return httpx.Response(self.health_status, json={"status": "ok"})
        if path == "/metrics":
            text = f"# TYPE x gauge\nagentjax:num_requests_in_server {self.in_server}.0\n"
            if self.mooncake_degraded is not None:
                text += f'agentjax:kv_offload_tier_degraded{{tier="mooncake"}} {self.mooncake_degraded}\n'
            return httpx.Response(200, text=text)
        if path in ("/kv/prefill", "/kv/flush"):
            return self._kv_transfer(request, path)
        if path == "/kv/events":
            return httpx.Response(200, json=self.kv_answer) if self.kv_answer else httpx.Response(404, json={})
        self.received.append(request)
        if self.mode == "drop":  # what a closed kept-alive connection, or a process killed mid-request, gives
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        if self.mode == "status_503":
            return httpx.Response(503, json={"error": {"message": "busy"}})
        if self.mode == "slow":
            return self._after(30.0, path)
        if self.mode == "gated":
            return self._when_open(path)
        body = json.loads(request.content or b"{}")
        if not body.get("stream"):
            return self._whole(path)
        events = self._stream_events(path)
        break_after = {"break_before_output": 1, "break_after_output": 3}.get(self.mode)
        return httpx.Response(200, headers={"content-type": "text/event-stream; charset=utf-8"},
                              stream=BreakingStream(events, break_after))

    def _kv_transfer(self, request: httpx.Request, path: str) -> httpx.Response:
        if self.kv_transfer_mode == "refuse":
            raise httpx.ConnectError("All connection attempts failed", request=request)
        body = json.loads(request.content) if request.content else {}
        self.kv_calls.append((path, body, request.headers))
        if self.kv_transfer_mode == "degraded":
            return httpx.Response(503, json={"error": {"message": "the Mooncake tier is out of use", "type":
                                                       "service_unavailable", "param": None,
                                                       "code": "kv_tier_degraded"}})
        if path == "/kv/flush":
            return httpx.Response(200, json={"tiers": ["mooncake"], "degraded": []})
        return httpx.Response(200, json={"prompt_tokens": 40, "cached_tokens": 32})

    async def _when_open(self, path: str) -> httpx.Response:
        """A whole reply held until the test sets `gate_open`."""
        while not self.gate_open:
            await asyncio.sleep(0.01)
        return self._whole(path)

    async def _after(self, seconds: float, path: str) -> httpx.Response:
        """A reply that takes `seconds` (MockTransport awaits it); `cancelled` says if it was cut short."""
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return self._whole(path)

    def _whole(self, path: str) -> httpx.Response:
        if path == "/v1/responses":
            return httpx.Response(200, json={"id": f"resp_{self.url[-1]}{len(self.received)}", "object": "response",
                                             "output": []})
        return httpx.Response(200, json={"id": "x", "object": "chat.completion", "served_by": self.url,
                                         "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                                      "finish_reason": "stop"}]})

    def _stream_events(self, path: str) -> list[bytes]:
        if path == "/v1/messages":
            return [sse({"type": "message_start", "message": {"id": "msg"}}, "message_start"),
                    sse({"type": "content_block_start", "index": 0}, "content_block_start"),
                    sse({"type": "content_block_delta", "delta": {"text": "hi"}}, "content_block_delta"),
                    sse({"type": "content_block_delta", "delta": {"text": " there"}}, "content_block_delta"),
                    sse({"type": "message_stop"}, "message_stop")]
        return chat_stream_events(f"chatcmpl-{self.url}", ["one", " two", " three"])


class FakeCluster:
    """Fake replicas on made-up ports, behind one transport."""

    def __init__(self, count: int):
        self.replicas = [FakeReplica(f"http://127.0.0.1:{9001 + i}") for i in range(count)]
        self.transport = httpx.MockTransport(self._handle)

    def _handle(self, request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        replica = next(r for r in self.replicas if r.url == url)
        return replica.handle(request)

    @property
    def urls(self) -> list[str]:
        return [replica.url for replica in self.replicas]

    def by_url(self, url: str) -> FakeReplica:
        return next(r for r in self.replicas if r.url == url)
