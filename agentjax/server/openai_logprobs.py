"""OpenAI's log-probability JSON from `TokenLogprobs`: chat's `logprobs.content`, the text completions
`logprobs` object (with `echo`, the prompt's tokens first), and vLLM's `prompt_logprobs` extension.

JSON has no infinity: a token ruled out (-inf) reports -9999.0, as vLLM does. Token texts are each
token decoded alone (special tokens spelled out), cached per id. Never imports jax.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from agentjax.logprobs import TokenLogprobs

MIN_LOGPROB = -9999.0


def json_logprob(value: float) -> float:
    return MIN_LOGPROB if math.isnan(value) or value < MIN_LOGPROB else value


class TokenTexts:
    """Token id -> its text, decoded alone."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def _chat_token(texts: TokenTexts, token_id: int, value: float) -> dict:
    text = texts(token_id)
    return {"token": text, "logprob": json_logprob(value), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: Sequence[TokenLogprobs], texts: TokenTexts) -> list[dict]:
    """Chat's `logprobs.content`: per token its text, value, bytes and the requested top alternatives."""
    return [{**_chat_token(texts, e.token_id, e.logprob),
             "top_logprobs": [_chat_token(texts, t, v) for t, v in zip(e.top_token_ids, e.top_logprobs)]}
            for e in entries]


class CompletionLogprobs:
    """The completions `logprobs` object, built chunk by chunk so that `text_offset` runs on across a
    stream (`offset` is where the first token's text begins: after the echoed prompt, if any)."""

    def __init__(self, texts: TokenTexts, offset: int = 0):
        self.texts = texts
        self.offset = offset

    def chunk(self, entries: Sequence[TokenLogprobs | None], token_ids: Sequence[int] | None = None) -> dict:
        """The object for `entries`; an entry None (a prompt's first token) reports None for its value
        and alternatives, and needs its id from `token_ids`."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for index, entry in enumerate(entries):
            token_id = entry.token_id if entry is not None else token_ids[index]
            text = self.texts(token_id)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
            else:
                out["token_logprobs"].append(json_logprob(entry.logprob))
                out["top_logprobs"].append({self.texts(t): json_logprob(v) for t, v in entry.as_dict().items()})
        return out


def join_completion_logprobs(parts: Sequence[dict]) -> dict:
    """One object from several chunks' (echoed prompt, then the completion)."""
    return {key: [value for part in parts for value in part[key]]
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def prompt_logprobs_json(entries: Sequence[TokenLogprobs | None] | None, texts: TokenTexts) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or `{token id: {logprob, rank,
    decoded_token}}` for the prompt token and the requested top alternatives."""
    if entries is None:
        return None
    out: list[dict | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        values = {str(t): {"logprob": json_logprob(v), "rank": rank, "decoded_token": texts(t)}
                  for rank, (t, v) in enumerate(zip(entry.top_token_ids, entry.top_logprobs), start=1)}
        values.setdefault(str(entry.token_id), {"logprob": json_logprob(entry.logprob), "rank": entry.rank,
                                                "decoded_token": texts(entry.token_id)})
        out.append(values)
    return out
