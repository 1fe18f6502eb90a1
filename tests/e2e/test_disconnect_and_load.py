"""Pages come back: a stream closed by its client is aborted at once (and counted as an error), and 32 concurrent agent sessions
of 5 turns finish without errors and leave the KV pool as they found it."""
from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest

from tests.e2e.conftest import CLIENT_TIMEOUT_S

MODEL = "smollm2-135m-instruct"
USED = "agentjax:kv_used_blocks"


@pytest.fixture(scope="module")
def server(main_server):
    return main_server


def wait_for_metric_at_most(server, name: str, value: float, within_s: float) -> float:
    """Seconds until `name` is at most `value` (pins of earlier tests may expire meanwhile)."""
    started = time.monotonic()
    while (current := server.metric(name)) > value:
        assert time.monotonic() - started < within_s, f"{name} is {current}, not {value}, after {within_s}s"
        time.sleep(0.02)
    return time.monotonic() - started


def dropped_streams(server) -> float:
    """Replies whose client left before the end: `agentjax:request_errors_total{status="499"}`."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    match = re.search(r'^agentjax:request_errors_total\{status="499"\} (\S+)$', text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_closing_a_stream_after_3_chunks_returns_pages_to_baseline_within_1s(server):
    baseline = server.metric(USED)
    dropped = dropped_streams(server)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a very long story about ships."}],
            "max_tokens": 400, "ignore_eos": True, "temperature": 0.7, "seed": 1, "stream": True}
    with httpx.Client(timeout=CLIENT_TIMEOUT_S) as client:
        with client.stream("POST", f"{server.base_url}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            chunks = 0
            for line in response.iter_lines():
                chunks += line.startswith("data: ")
                if chunks == 3:
                    break
            assert server.metric(USED) > baseline  # the request holds pages while it streams
        # leaving the block closes the connection mid-stream
    wait_for_metric_at_most(server, USED, baseline, within_s=1.0)
    assert server.metric("agentjax:num_requests_running") == 0
    assert dropped_streams(server) == dropped + 1  # the dropped stream is counted as an error
    server.assert_healthy()


@pytest.mark.slow
def test_32_concurrent_streaming_sessions_of_5_turns_finish_without_errors_and_release_pages(server):
    baseline = server.metric(USED)
    topics = ["rust", "jax", "tcp", "sql", "git", "css", "dns", "tls"]

    async def session(client, index: int) -> tuple[int, int]:
        session_id = f"load-{index}"
        messages = [{"role": "system", "content": f"You help agent {index} with {topics[index % 8]}."}]
        errors = cached = 0
        for turn in range(5):
            messages.append({"role": "user", "content": f"Step {turn}: what next for {topics[index % 8]}?"})
            hints = {"session_id": session_id, "turn": turn, "expected_next_turn_s": 2.0,
                     "session_end": turn == 4}
            try:
                stream = await client.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=4, temperature=0.5, seed=index, stream=True,
                    stream_options={"include_usage": True}, extra_body={"agent_hints": hints})
                text, usage = [], None
                async for chunk in stream:
                    if chunk.choices:
                        text.append(chunk.choices[0].delta.content or "")
                    usage = chunk.usage or usage
                cached += usage.prompt_tokens_details.cached_tokens if turn else 0
                messages.append({"role": "assistant", "content": "".join(text)})
            except Exception:  # counted, and the session goes on: the test asserts zero of them
                errors += 1
        return errors, cached

    async def run_all():
        client = server.async_openai(http_client=httpx.AsyncClient(
            limits=httpx.Limits(max_connections=64), timeout=CLIENT_TIMEOUT_S))
        results = await asyncio.gather(*(session(client, i) for i in range(32)))
        await client.close()
        return results

    results = asyncio.run(run_all())
    assert sum(errors for errors, _ in results) == 0
    assert sum(cached for _, cached in results) > 0  # later turns reuse their session's prefix
    wait_for_metric_at_most(server, USED, baseline, within_s=5.0)
    server.assert_healthy()
