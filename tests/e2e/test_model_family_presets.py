"""`agentjax serve --model preset:tiny-minimax-m3`, `preset:tiny-kimi-k3` and `preset:tiny-dsv4` serve
the official openai and anthropic SDKs: chat completions plain and streamed, a second turn that reads
the prefix cache, and Anthropic messages plain and streamed. The tiny presets have random weights, so the replies
are tokens without meaning; the test checks the protocol, the usage figures and the cache."""
from __future__ import annotations

import pytest

from tests.e2e.conftest import CLIENT_TIMEOUT_S, running_server

PRESETS = ["preset:tiny-minimax-m3", "preset:tiny-kimi-k3", "preset:tiny-dsv4"]
HISTORY = "You are a coding agent. " * 40  # a long shared prefix (well over one 64-token state interval)
# Every step of these conversations (prompts of about 300 tokens, 18 pages of 16) as one compiled shape:
# each shape of a tiny preset is seconds of compiling and milliseconds of running.
STEP_BUCKETS = '{"tokens": [512], "rows": [8], "pages": [32]}'


@pytest.fixture(scope="module", params=PRESETS)
def family_server(request, tmp_path_factory):
    with running_server(tmp_path_factory, "--model", request.param, "--block-size", "16",
                        "--step-buckets", STEP_BUCKETS) as server:
        server.model = request.param.removeprefix("preset:")
        yield server


def _served_model(server) -> str:
    return server.openai().models.list().data[0].id


@pytest.mark.slow
def test_the_openai_sdk_chats_streams_and_reads_the_cache_on_a_second_turn(family_server):
    client = family_server.openai()
    model = _served_model(family_server)
    messages = [{"role": "system", "content": HISTORY}, {"role": "user", "content": "List the files."}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert first.choices[0].finish_reason == "length" and first.usage.completion_tokens == 8
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Now open the first one."}]
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert text and usage.completion_tokens == 8
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached >= 64, f"the second turn should hit the first turn's prefix, got {cached} cached tokens"


@pytest.mark.slow
def test_the_anthropic_sdk_gets_messages_and_streams(family_server):
    import anthropic

    client = anthropic.Anthropic(base_url=family_server.base_url, api_key="unused", timeout=CLIENT_TIMEOUT_S,
                                 max_retries=0)
    model = _served_model(family_server)
    reply = client.messages.create(model=model, max_tokens=6, system=HISTORY,
                                   messages=[{"role": "user", "content": "Say hi."}], extra_body={"temperature": 0})
    assert reply.content and reply.usage.output_tokens >= 1
    with client.messages.stream(model=model, max_tokens=6, system=HISTORY,
                                messages=[{"role": "user", "content": "Say hi."}]) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.usage.output_tokens >= 1 and isinstance(streamed, str)
    assert final.usage.cache_read_input_tokens >= 64  # the same system prompt as the first request
