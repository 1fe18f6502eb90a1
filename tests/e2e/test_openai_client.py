"""The official `openai` client, unchanged, against the server the README's main command starts."""
from __future__ import annotations

import asyncio
import uuid

import pytest

MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(main_server):
    return main_server


def test_sync_chat_returns_a_reply_with_usage(server):
    reply = server.openai().chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0)
    assert reply.object == "chat.completion"
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens > 0 and 0 < reply.usage.completion_tokens <= 12
    assert reply.usage.prompt_tokens_details.cached_tokens >= 0


def test_async_streaming_chat_yields_deltas_then_usage(server):
    async def stream() -> tuple[list[str], object]:
        client = server.async_openai()
        chunks = await client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True})
        deltas, usage = [], None
        async for chunk in chunks:
            if chunk.choices:
                deltas.append(chunk.choices[0].delta.content or "")
            if chunk.usage is not None:
                usage = chunk.usage
        await client.close()
        return deltas, usage

    deltas, usage = asyncio.run(stream())
    assert len([d for d in deltas if d]) >= 2
    assert "Paris" in "".join(deltas)
    assert usage.completion_tokens <= 10 and usage.prompt_tokens_details is not None


def test_completions_accept_text_and_token_id_prompts(server):
    client = server.openai()
    text = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert text.object == "text_completion" and text.choices[0].text
    ids = client.completions.create(model=MODEL, prompt=[504, 3575, 282, 4649, 314], max_tokens=4, temperature=0)
    assert ids.usage.prompt_tokens == 5 and ids.choices[0].text


def test_models_list_names_the_served_model(server):
    models = server.openai().models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_second_turn_of_a_session_reports_cached_tokens(server):
    client = server.openai()
    session = {"X-Session-ID": f"cache-{uuid.uuid4().hex}"}
    messages = [{"role": "system", "content": "You are a terse assistant for a coding agent. " * 4}, *QUESTION]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                           extra_headers=session)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And of Germany?"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                            extra_headers=session)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.usage.prompt_tokens_details.cached_tokens <= second.usage.prompt_tokens


@pytest.mark.slow
def test_streamed_text_equals_non_streamed_text_for_a_greedy_request(server):
    client = server.openai()
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    # Distinct cache salts: both requests compute the whole prompt the same way, with no cache hits.
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                           extra_body={"cache_salt": uuid.uuid4().hex})
    chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                            stream=True, extra_body={"cache_salt": uuid.uuid4().hex})
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert streamed == plain.choices[0].message.content
    assert streamed
