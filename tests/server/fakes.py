"""A jax-free stand-in for the engine and tokenizer, so the HTTP layer tests in milliseconds.

`FakeEngine` follows `agentjax.engine.Engine`'s interface: each step emits one token per live
request (the prompt's characters, echoed; a parallel sample `fork_of` another starts `index`
characters later), holds two pages per live request, and can be paused with `gate` or made to fail
with `fail_next_step`. Asked for log probabilities, it reports token t at position i as
`-(i + 1) / 8`, with alternatives t + 1, t + 2, ... each 1 lower; prompt token i as `-i / 4`.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from agentjax.errors import InvalidRequestError, PromptTooLongError, TokenLimitError
from agentjax.logprobs import TokenLogprobs
from agentjax.scheduler.request import EngineOutput

EOS = 0


class FakeTokenizer:
    """One token per character (id = code point + 1); id 0 is end of sequence."""

    stop_token_ids = (EOS,)

    def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None) -> list[int]:
        if max_tokens is not None and len(text) > max_tokens:
            raise TokenLimitError(len(text), max_tokens)
        return [ord(c) + 1 for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i - 1) for i in ids if i != EOS)

    def encode_chat(self, messages, add_generation_prompt: bool = True, tools=None, max_tokens=None) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""), max_tokens=max_tokens)


@dataclass
class _Live:
    prompt: list[int]
    sampling: object
    generated: list[int] = field(default_factory=list)
    offset: int = 0  # a parallel sample's start in the echo


class FakeEngine:
    max_model_len = 256
    pages_per_request = 2

    def __init__(self, step_s: float = 0.001):
        self.step_s = step_s
        self.live: dict[str, _Live] = {}
        self.calls: list[tuple] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail_next_step = False

    def add_request(self, prompt, sampling, request_id=None, *, session_id=None, priority=0, hints=None,
                    cache_salt=None, pin_prefixes=(), fork_of=None):
        if len(prompt) >= self.max_model_len:
            raise PromptTooLongError(f"prompt has {len(prompt)} tokens; the model's context is {self.max_model_len}")
        if any(t >= 0x110000 for t in prompt):
            raise InvalidRequestError("token id outside the vocabulary")
        if any(t >= 0x110000 for t in (sampling.logit_bias or ())):
            raise InvalidRequestError("logit_bias names a token id outside the vocabulary")
        self.calls.append(("add", request_id, session_id, priority, hints, cache_salt, list(pin_prefixes)))
        if fork_of is not None:
            self.calls.append(("fork", request_id, fork_of, sampling.seed))
        offset = sum(1 for c in self.calls if c[0] == "fork" and c[2] == fork_of) if fork_of else 0
        self.live[request_id] = _Live(list(prompt), sampling, offset=offset)
        return request_id

    def abort(self, request_id):
        self.calls.append(("abort", request_id))
        self.live.pop(request_id, None)

    def end_session(self, session_id):
        self.calls.append(("end_session", session_id))

    def has_unfinished(self) -> bool:
        return bool(self.live)

    def step(self) -> list[EngineOutput]:
        self.gate.wait()
        time.sleep(self.step_s)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("injected step failure")
        outputs = []
        for request_id, live in list(self.live.items()):
            index = len(live.generated)
            token = live.prompt[(index + live.offset) % len(live.prompt)]
            live.generated.append(token)
            done = len(live.generated) >= live.sampling.max_tokens
            text = "".join(chr(t - 1) for t in live.generated)
            stopped = any(s in text for s in live.sampling.stop)
            if done or stopped:
                del self.live[request_id]
            outputs.append(EngineOutput(request_id, [token], done or stopped, "stop" if stopped else
                                        ("length" if done else None), 0, len(live.prompt),
                                        *_logprobs(live, token, index)))
        return outputs

    def stats(self) -> dict:
        used = self.pages_per_request * len(self.live)
        return {"num_running": len(self.live), "num_waiting": 0, "kv_total_blocks": 100,
                "kv_free_blocks": 100 - used, "kv_used_blocks": used, "kv_usage": used / 100}


def _logprobs(live: _Live, token: int, index: int) -> tuple:
    k, prompt_k = live.sampling.logprobs, live.sampling.prompt_logprobs
    value = -(index + 1) / 8
    entry = None if k is None else [TokenLogprobs(token, value, 1, tuple(token + i for i in range(k)),
                                                  tuple(value - i for i in range(k)))]
    prompt = None
    if prompt_k is not None and index == 0 and live.offset == 0:
        prompt = [None] + [TokenLogprobs(t, -i / 4, 1, tuple(t + j for j in range(prompt_k)),
                                         tuple(-i / 4 - j for j in range(prompt_k)))
                           for i, t in enumerate(live.prompt) if i]
    return entry, prompt
