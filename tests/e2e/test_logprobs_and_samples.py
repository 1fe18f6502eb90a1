"""Log probabilities, n samples and penalties through the official `openai` client, against the server
the README's main command starts; values are checked against a plain forward of the same tokens in
this process (`make_step(all_positions=True)` on the same embedded model)."""
from __future__ import annotations

import uuid

import httpx
import jax
import numpy as np
import pytest

pytestmark = pytest.mark.slow  # every request runs the real model

MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def server(main_server):
    return main_server


@pytest.fixture(scope="module")
def reference():
    """`tokens -> log-softmax of every position's logits`, from one plain forward (fast numerics, as served)."""
    from agentjax import LLM
    from agentjax.ragged_batch import RaggedBatch
    from agentjax.runner.step import make_step

    llm = LLM()
    step = make_step(llm.model_config, "fast", all_positions=True)

    def logprobs(tokens: list[int]) -> np.ndarray:
        kv = llm.model_config.new_kv_pages(2 + -(-len(tokens) // 16), 16)
        logits, _ = step(llm.params, kv, RaggedBatch.from_prompts([tokens], 16))
        return np.asarray(jax.nn.log_softmax(np.asarray(logits[:len(tokens)], np.float32), axis=-1))

    return logprobs


def salted() -> dict:
    """A fresh cache salt: the request computes its whole prompt, as the reference does."""
    return {"cache_salt": uuid.uuid4().hex}


def test_greedy_chat_logprobs_pick_the_top_token_and_match_a_plain_forward(server, reference):
    reply = server.openai().chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=8, temperature=0, logprobs=True, top_logprobs=5,
        extra_body={**salted(), "return_token_ids": True, "prompt_logprobs": 3})
    extra = reply.model_extra
    prompt, tokens = extra["prompt_token_ids"], reply.choices[0].model_extra["token_ids"]
    content = reply.choices[0].logprobs.content
    assert len(content) == len(tokens) == reply.usage.completion_tokens
    expected = reference(prompt + tokens)
    for step, (token, entry) in enumerate(zip(tokens, content)):
        row = expected[len(prompt) - 1 + step]
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
        assert all(t.logprob <= 0 for t in entry.top_logprobs)
        assert sum(np.exp(t.logprob) for t in entry.top_logprobs) <= 1 + 1e-6
        assert entry.logprob == pytest.approx(row[token], abs=1e-4)
        np.testing.assert_allclose([t.logprob for t in entry.top_logprobs], np.sort(row)[::-1][:5], atol=1e-4)
    prompt_logprobs = extra["prompt_logprobs"]
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for position in range(1, len(prompt)):
        entry = prompt_logprobs[position][str(prompt[position])]
        assert entry["logprob"] == pytest.approx(expected[position - 1][prompt[position]], abs=1e-4)
        assert entry["rank"] == 1 + int((expected[position - 1] > expected[position - 1][prompt[position]]).sum())


def test_streamed_chat_logprobs_equal_the_non_streamed_ones(server):
    client = server.openai()
    request = dict(model=MODEL, messages=QUESTION, max_tokens=10, temperature=0, logprobs=True, top_logprobs=3)
    plain = client.chat.completions.create(**request, extra_body=salted()).choices[0].logprobs.content
    streamed = []
    for chunk in client.chat.completions.create(**request, stream=True, extra_body=salted()):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content or []
    assert [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in streamed] == \
        [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in plain]


def test_completion_logprobs_with_echo_cover_prompt_and_completion(server):
    reply = server.openai().completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                               temperature=0, logprobs=2, echo=True, extra_body=salted())
    logprobs = reply.choices[0].logprobs
    prompt_tokens = reply.usage.prompt_tokens
    assert len(logprobs.tokens) == prompt_tokens + reply.usage.completion_tokens
    assert logprobs.token_logprobs[0] is None and all(v <= 0 for v in logprobs.token_logprobs[1:])
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    for step in range(prompt_tokens, len(logprobs.tokens)):  # greedy: each chosen token is the most likely
        top = logprobs.top_logprobs[step]
        assert max(top.values()) == logprobs.token_logprobs[step] and top[logprobs.tokens[step]] <= 0


def test_n_3_with_a_seed_gives_three_reproducible_replies_and_counts_the_prompt_once(server):
    client = server.openai()
    request = dict(model=MODEL, messages=QUESTION, max_tokens=12, temperature=1.0, seed=42, n=3)
    counters = ("agentjax:prompt_tokens_total", "agentjax:prompt_tokens_computed_total")  # prometheus adds _total
    before = {name: server.metric(name) for name in counters}
    first = client.chat.completions.create(**request, extra_body=salted())
    after = {name: server.metric(name) for name in counters}
    again = client.chat.completions.create(**request, extra_body=salted())
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2] and len(set(texts)) == 3
    assert texts == [c.message.content for c in again.choices]
    prompt = first.usage.prompt_tokens
    assert after[counters[0]] - before[counters[0]] == prompt
    computed = after[counters[1]] - before[counters[1]]
    assert prompt <= computed <= prompt + 2 * 16  # the samples after the first run only the last page's tail


def test_streamed_n_2_chunks_carry_their_choice_index(server):
    seen = {0: "", 1: ""}
    for chunk in server.openai().chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, n=2,
                                                         seed=3, stream=True):
        for choice in chunk.choices:
            seen[choice.index] += choice.delta.content or ""
    assert all(seen.values())


def test_logit_bias_of_minus_100_bans_the_greedy_first_token(server):
    client = server.openai()
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, temperature=0,
                                           extra_body={"return_token_ids": True})
    first_token = plain.choices[0].model_extra["token_ids"][0]
    banned = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, temperature=0,
                                            logit_bias={str(first_token): -100}, frequency_penalty=0.5,
                                            presence_penalty=0.5, extra_body={"return_token_ids": True})
    assert first_token not in banned.choices[0].model_extra["token_ids"]


def test_a_bad_logit_bias_token_is_a_400(server):
    response = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                          json={"model": MODEL, "messages": QUESTION, "logit_bias": {"99999999": 5}})
    assert response.status_code == 400 and "logit_bias" in response.json()["error"]["message"]
