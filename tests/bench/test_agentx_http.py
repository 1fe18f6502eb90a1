"""The AgentX replay's HTTP backend against a scripted OpenAI-compatible server (no sockets)."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from agentjax.bench.agentx import AgentxConfig, AgentxRun
from agentjax.bench.backends import HttpBackend, TurnRequest
from agentjax.bench.traces import Session, Turn

MAX_MODEL_LEN = 64


class ScriptedServer:
    """Lists one model with `max_model_len`; streams two text chunks, then a usage chunk."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.headers: list[httpx.Headers] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [
                {"id": "m", "object": "model", "created": 0, "owned_by": "t",
                 "max_model_len": MAX_MODEL_LEN}]})
        body = json.loads(request.content)
        self.bodies.append(body)
        self.headers.append(request.headers)
        prompt_tokens = len(body["prompt"])
        chunks = [{"id": "c", "object": "text_completion", "created": 0, "model": "m",
                   "choices": [{"index": 0, "text": text, "finish_reason": None}]} for text in ("a", "b")]
        chunks.append({"id": "c", "object": "text_completion", "created": 0, "model": "m", "choices": [],
                       "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 3,
                                 "total_tokens": prompt_tokens + 3,
                                 "prompt_tokens_details": {"cached_tokens": prompt_tokens // 2}}})
        sse = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, content=sse.encode(), headers={"content-type": "text/event-stream"})


def _backend(server: ScriptedServer) -> HttpBackend:
    return HttpBackend("http://test", http_client=httpx.AsyncClient(transport=httpx.MockTransport(server)))


def test_http_backend_sends_agent_fields_and_reads_usage():
    server = ScriptedServer()

    async def main():
        backend = _backend(server)
        await backend.start()
        record = await backend.send(TurnRequest(list(range(256, 266)), 3, "s-1", 4, {"turn": 4}))
        await backend.close()
        return backend, record

    backend, record = asyncio.run(main())
    assert backend.model == "m" and backend.max_prompt_tokens == MAX_MODEL_LEN - 1
    body, headers = server.bodies[0], server.headers[0]
    assert body["stream"] and body["ignore_eos"] and body["stream_options"] == {"include_usage": True}
    assert body["session_id"] == "s-1" and body["agent_hints"] == {"turn": 4}
    assert headers["x-session-id"] == "s-1"
    assert record.error is None
    assert (record.input_tokens, record.cached_tokens, record.output_tokens) == (10, 5, 3)
    assert record.ttft_s is not None and len(record.inter_token_latencies_s) == 1  # two text chunks, one gap


def test_http_replay_caps_prompts_at_the_served_context():
    """Without --max-context the prompts still fit the model card's max_model_len."""
    server = ScriptedServer()
    turns = [Turn(i, _ids(10 + 20 * i), 10 + 20 * i, 4, 0.0, float(i)) for i in range(6)]
    session = Session("long", turns, 8, "scope")
    config = AgentxConfig(lanes=1, duration_s=0.5, warmup_requests_per_lane=0)
    summary = asyncio.run(AgentxRun(config, [session], _backend(server)).run())
    assert summary["errors"] == 0 and server.bodies
    for body in server.bodies:
        assert len(body["prompt"]) + body["max_tokens"] <= MAX_MODEL_LEN


def _ids(num_tokens: int):
    import numpy as np

    return np.arange(-(-num_tokens // 8), dtype=np.int64)


@pytest.mark.parametrize("status", [400, 500])
def test_http_errors_become_failed_records(status):
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return ScriptedServer()(request)
        return httpx.Response(status, json={"error": {"message": "no", "type": "x", "code": status}})

    async def main():
        backend = HttpBackend("http://test", http_client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
        await backend.start()
        record = await backend.send(TurnRequest([300, 301], 2, "s", 0))
        await backend.close()
        return record

    record = asyncio.run(main())
    assert record.error is not None and record.output_tokens == 0
