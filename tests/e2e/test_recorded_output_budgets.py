"""Every output length recorded in the dev traces is a budget `agentjax serve` accepts with default flags.

The AgentX client sends each turn's recorded output length as `max_completion_tokens`. A ten-minute
replay on this CPU reaches only a few of those turns, so this test sends the budgets themselves: each
distinct recorded length above 4,096 (the cap the server once had) and the longest, over
`preset:tiny-long` (1M positions), streamed, and leaves after the first token. Every one gets a 200 and
a token; afterwards nothing is left running and the pages of the aborted replies are free."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from agentjax.bench.traces import iter_all_sessions, load_weka_traces
from tests.e2e.conftest import REPO, running_server

TRACES = REPO.parent / "shared" / "traces" / "agentx-dev"
OLD_CAP = 4096

pytestmark = pytest.mark.slow


def recorded_output_lengths() -> list[int]:
    """The distinct recorded output lengths above the old cap, and the longest one."""
    lengths = {turn.output_tokens for root in load_weka_traces(TRACES)
               for session in iter_all_sessions([root]) for turn in session.turns}
    return sorted({n for n in lengths if n > OLD_CAP} | {max(lengths)})


def first_token(lines) -> str:
    """The first non-empty text delta of a chat completion stream ("" if it ends without one)."""
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[len("data: "):]).get("choices", []):
            if choice["delta"].get("content"):
                return choice["delta"]["content"]
    return ""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory, "--model", "preset:tiny-long") as server:
        yield server


def test_every_recorded_output_length_is_accepted_as_a_budget(server):
    lengths = recorded_output_lengths()
    assert lengths and max(lengths) > OLD_CAP
    refused = {}
    model = server.openai().models.list().data[0].id
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        for budget in lengths:
            body = {"model": model, "messages": [{"role": "user", "content": "Write a long story."}],
                    "max_completion_tokens": budget, "stream": True, "temperature": 0}
            with client.stream("POST", "/v1/chat/completions", json=body) as reply:
                if reply.status_code != 200:
                    refused[budget] = (reply.status_code, reply.read().decode()[:200])
                    continue
                assert first_token(reply.iter_lines()), f"no token streamed for max_completion_tokens={budget}"
    assert not refused, f"{len(refused)} of {len(lengths)} recorded budgets refused: {refused}"
    deadline = time.monotonic() + 30  # the server aborts each reply when its client leaves
    while time.monotonic() < deadline and (server.metric("agentjax:num_requests_running") > 0
                                           or server.metric("agentjax:kv_cache_usage_perc") > 0):
        time.sleep(0.2)
    assert server.metric("agentjax:num_requests_running") == 0
    assert server.metric("agentjax:kv_cache_usage_perc") == 0
    server.assert_healthy()
