"""Log probabilities, parallel samples and penalties on the OpenAI routes, over the fake engine
(`fakes.py` says which values it reports)."""
from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from agentjax.server.openai_logprobs import MIN_LOGPROB
from tests.server.fakes import FakeEngine
from tests.server.test_app import MODEL, assert_error, make_app

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


@pytest.fixture
def client():
    engine = FakeEngine()
    with TestClient(make_app(engine)) as test_client:
        test_client.engine = engine
        yield test_client


def stream_chunks(client, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_chat_logprobs_report_each_token_with_its_top_alternatives(client):
    body = client.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 2}).json()
    content = body["choices"][0]["logprobs"]["content"]
    text = body["choices"][0]["message"]["content"]
    assert [e["token"] for e in content] == list(text)
    assert [e["logprob"] for e in content] == [-0.125, -0.25, -0.375, -0.5]
    first = content[0]
    assert first["bytes"] == list(first["token"].encode())
    assert [t["logprob"] for t in first["top_logprobs"]] == [-0.125, -1.125]
    assert first["top_logprobs"][0]["token"] == first["token"]


def test_chat_without_logprobs_reports_none_and_top_logprobs_alone_is_a_400(client):
    assert client.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["logprobs"] is None
    assert_error(client.post("/v1/chat/completions", json={**CHAT, "top_logprobs": 2}), 400, "logprobs")
    assert_error(client.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 21}), 400,
                 "top_logprobs")


def test_streamed_chat_logprobs_join_to_the_non_streamed_ones(client):
    request = {**CHAT, "max_tokens": 9, "logprobs": True, "top_logprobs": 3, "stop": ["l"]}
    plain = client.post("/v1/chat/completions", json=request).json()["choices"][0]["logprobs"]["content"]
    chunks = stream_chunks(client, "/v1/chat/completions", request)
    streamed = [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == plain and len(plain) >= 3


def test_n_3_returns_three_choices_whose_samples_share_the_first_ones_prompt(client):
    body = client.post("/v1/chat/completions", json={**CHAT, "n": 3, "seed": 9}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert len({c["message"]["content"] for c in body["choices"]}) == 3
    assert body["usage"]["prompt_tokens"] == len("<user>hello<assistant>")  # counted once
    assert body["usage"]["completion_tokens"] == 12
    adds = [c for c in client.engine.calls if c[0] == "add"]
    forks = [c for c in client.engine.calls if c[0] == "fork"]
    assert len(adds) == 3 and [f[2] for f in forks] == [adds[0][1], adds[0][1]]
    assert len({f[3] for f in forks} | {9}) == 3  # each sample its own seed; the first keeps 9


def test_streamed_n_3_chunks_name_their_choice_and_join_to_the_non_streamed_replies(client):
    request = {**CHAT, "n": 3, "max_tokens": 5, "stream_options": {"include_usage": True}}
    plain = client.post("/v1/chat/completions", json=request).json()
    chunks = stream_chunks(client, "/v1/chat/completions", request)
    texts = {i: "" for i in range(3)}
    finishes = {}
    for chunk in chunks[:-1]:
        choice = chunk["choices"][0]
        texts[choice["index"]] += choice["delta"].get("content") or ""
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {c["index"]: c["message"]["content"] for c in plain["choices"]}
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1]["usage"] == plain["usage"]


def test_completions_logprobs_object_with_echo_and_prompt_logprobs(client):
    body = client.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 2, "logprobs": 1,
                                                "echo": True, "prompt_logprobs": 1}).json()
    choice = body["choices"][0]
    logprobs = choice["logprobs"]
    assert choice["text"] == "abcab"
    assert logprobs["tokens"] == list("abcab") and logprobs["text_offset"] == [0, 1, 2, 3, 4]
    assert logprobs["token_logprobs"] == [None, -0.25, -0.5, -0.125, -0.25]
    assert logprobs["top_logprobs"][0] is None
    assert logprobs["top_logprobs"][3] == {"a": -0.125}
    assert choice["prompt_logprobs"][0] is None
    assert choice["prompt_logprobs"][1] == {str(ord("b") + 1): {"logprob": -0.25, "rank": 1, "decoded_token": "b"}}


def test_streamed_completion_logprobs_with_echo_join_to_the_non_streamed_ones(client):
    request = {"model": MODEL, "prompt": "abcd", "max_tokens": 5, "logprobs": 2, "echo": True}
    plain = client.post("/v1/completions", json=request).json()["choices"][0]
    chunks = stream_chunks(client, "/v1/completions", request)
    joined = {key: [v for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                    for v in c["choices"][0]["logprobs"][key]] for key in plain["logprobs"]}
    assert joined == plain["logprobs"]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == plain["text"]


def test_best_of_keeps_the_n_samples_of_highest_cumulative_logprob_and_cannot_stream(client):
    body = client.post("/v1/completions", json={"model": MODEL, "prompt": "abcdef", "max_tokens": 2, "n": 2,
                                                "best_of": 3}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 6  # every sample drawn is counted
    assert_error(client.post("/v1/completions", json={"model": MODEL, "prompt": "ab", "n": 2, "best_of": 3,
                                                      "stream": True}), 400, "best_of")
    assert_error(client.post("/v1/completions", json={"model": MODEL, "prompt": "ab", "n": 3, "best_of": 2}), 400,
                 "best_of")


def test_completions_with_two_prompts_and_n_2_number_choices_prompt_by_prompt(client):
    body = client.post("/v1/completions", json={"model": MODEL, "prompt": ["ab", "xy"], "max_tokens": 1,
                                                "n": 2}).json()
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "a"), (1, "b"), (2, "x"), (3, "y")]
    assert body["usage"]["prompt_tokens"] == 4


@pytest.mark.parametrize("field, value, needle", [
    ("presence_penalty", 2.5, "presence_penalty"),
    ("frequency_penalty", -3, "frequency_penalty"),
    ("repetition_penalty", 0, "repetition_penalty"),
    ("logit_bias", {"abc": 1}, "logit_bias"),
    ("logit_bias", {"5": 101}, "logit_bias"),
    ("logit_bias", {"2000000": -100}, "outside the vocabulary"),
    ("n", 0, "n"),
])
def test_out_of_range_penalties_and_samples_get_a_400_that_names_them(client, field, value, needle):
    assert_error(client.post("/v1/chat/completions", json={**CHAT, field: value}), 400, needle)


def test_penalties_and_logit_bias_reach_the_engine(client):
    captured = []
    add = client.engine.add_request

    def spy(prompt, sampling, *args, **kwargs):
        captured.append(sampling)
        return add(prompt, sampling, *args, **kwargs)

    client.engine.add_request = spy
    client.post("/v1/chat/completions", json={**CHAT, "presence_penalty": 0.5, "frequency_penalty": -0.5,
                                              "repetition_penalty": 1.2, "logit_bias": {"7": -100}})
    sampling = captured[0]
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty) == (0.5, -0.5, 1.2)
    assert sampling.logit_bias == {7: -100.0}


def test_minus_infinity_becomes_vllms_floor_in_json():
    from agentjax.logprobs import TokenLogprobs
    from agentjax.server.openai_logprobs import TokenTexts, chat_logprobs

    class Tokenizer:
        def decode(self, ids, skip_special_tokens=True):
            return "x"

    entry = TokenLogprobs(1, float("-inf"), 7, (2,), (float("-inf"),))
    assert chat_logprobs([entry], TokenTexts(Tokenizer()))[0]["logprob"] == MIN_LOGPROB


def test_responses_output_text_logprobs_stream_and_plain_alike(client):
    request = {"model": MODEL, "input": "hello", "max_output_tokens": 6, "top_logprobs": 2,
               "include": ["message.output_text.logprobs"]}
    plain = client.post("/v1/responses", json=request).json()
    part = plain["output"][0]["content"][0]
    assert [e["token"] for e in part["logprobs"]] == list(part["text"])
    assert [len(e["top_logprobs"]) for e in part["logprobs"]] == [2] * 6
    with client.stream("POST", "/v1/responses", json={**request, "stream": True}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [x for d in deltas for x in d["logprobs"]] == part["logprobs"]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert done["logprobs"] == part["logprobs"]
    without = client.post("/v1/responses", json={**request, "include": []}).json()
    assert without["output"][0]["content"][0]["logprobs"] == []


def test_return_token_ids_gives_the_prompt_and_each_choices_ids(client):
    body = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3, "return_token_ids": True}).json()
    assert body["prompt_token_ids"] == [ord(c) + 1 for c in "<user>hello<assistant>"]
    assert body["choices"][0]["token_ids"] == body["prompt_token_ids"][:3]
    text = client.post("/v1/completions", json={"model": MODEL, "prompt": "xyz", "max_tokens": 2,
                                                "return_token_ids": True}).json()["choices"][0]
    assert text["prompt_token_ids"] == [ord(c) + 1 for c in "xyz"] and text["token_ids"] == text["prompt_token_ids"][:2]
