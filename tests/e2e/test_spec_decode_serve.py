"""`agentjax serve --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'` (one server for
the module): the official openai and anthropic SDKs, plain and streamed, the AgentX replay with no
errors, /metrics showing drafts and accepted tokens; a bad config stops the server at start-up."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import CLIENT_TIMEOUT_S, REPO, running_server

SPEC = '{"method": "ngram", "num_speculative_tokens": 4}'
TRACES = REPO.parent / "shared" / "traces" / "agentx-dev"
COPY = ("Repeat this code exactly:\n"
        "def total(items):\n    result = 0\n    for item in items:\n        result += item.price * item.count\n"
        "    return result\n")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory, "--speculative-config", SPEC) as server:
        yield server


def _model(server) -> str:
    return server.openai().models.list().data[0].id


@pytest.mark.slow
def test_the_openai_sdk_chats_and_streams_with_drafts(server):
    client = server.openai()
    messages = [{"role": "user", "content": COPY}]
    plain = client.chat.completions.create(model=_model(server), messages=messages, max_tokens=48, temperature=0)
    stream = client.chat.completions.create(model=_model(server), messages=messages, max_tokens=48, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == plain.choices[0].message.content and streamed
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    completion = client.completions.create(model=_model(server), prompt=COPY, max_tokens=16, temperature=0.8, seed=3)
    again = client.completions.create(model=_model(server), prompt=COPY, max_tokens=16, temperature=0.8, seed=3)
    assert completion.choices[0].text == again.choices[0].text  # a seeded request stays reproducible


@pytest.mark.slow
def test_the_anthropic_sdk_gets_messages_and_streams_with_drafts(server):
    import anthropic

    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", timeout=CLIENT_TIMEOUT_S, max_retries=0)
    reply = client.messages.create(model=_model(server), max_tokens=32, messages=[{"role": "user", "content": COPY}],
                                   extra_body={"temperature": 0})
    with client.messages.stream(model=_model(server), max_tokens=32, messages=[{"role": "user", "content": COPY}],
                                extra_body={"temperature": 0}) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == reply.content[0].text and final.usage.output_tokens == reply.usage.output_tokens


@pytest.mark.slow
@pytest.mark.skipif(not TRACES.is_dir(), reason=f"no dev traces at {TRACES}")
def test_the_agentx_replay_runs_without_errors(server, tmp_path):
    traces = tmp_path / "traces"
    traces.mkdir()
    for path in sorted(TRACES.glob("*.json.gz"))[:4]:
        shutil.copy(path, traces / path.name)
    out = tmp_path / "r.json"
    subprocess.run([sys.executable, "-m", "agentjax.cli", "bench", "agentx", "--url", server.base_url,
                    "--traces", str(traces), "--lanes", "2", "--context-scale", "0.005", "--duration", "20",
                    "--out", str(out)], cwd=REPO, check=True, timeout=600)
    summary = json.loads(out.read_text())
    assert summary["errors"] == 0 and summary["requests"] > 0


@pytest.mark.slow
def test_metrics_show_the_drafts_and_their_acceptance(server):
    server.openai().chat.completions.create(model=_model(server), messages=[{"role": "user", "content": COPY}],
                                            max_tokens=32, temperature=0)
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    drafts = server.metric("agentjax:spec_decode_num_drafts_total")
    draft_tokens = server.metric("agentjax:spec_decode_num_draft_tokens_total")
    accepted = server.metric("agentjax:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= draft_tokens <= 4 * drafts
    per_position = [float(v) for v in re.findall(
        r'^agentjax:spec_decode_num_accepted_tokens_per_pos_total\{position="\d"\} (\S+)$', text, re.MULTILINE)]
    assert len(per_position) == 4 and sum(per_position) == accepted
    assert per_position == sorted(per_position, reverse=True)  # a later position is accepted only after the earlier


@pytest.mark.slow
def test_a_bad_speculative_config_stops_the_server_at_start_up(tmp_path):
    result = subprocess.run([sys.executable, "-m", "agentjax.cli", "serve", "--model", "preset:tiny-dense",
                             "--port", "1", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "num_speculative_tokens must be an integer in [1, 16]" in result.stderr
