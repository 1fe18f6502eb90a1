"""Server-sent events of OpenAI chat and text completions: one or n choices, with log probabilities.

`ChatStream` and `CompletionStream` turn the `ChatRun` events of a request's samples (merged as
they arrive; each chunk names its choice's index) into OpenAI's chunks. A token's log probabilities
ride on the next chunk of their choice, so a stream's `logprobs` join to the non-streamed reply's.
A failure mid-stream ends it with an error event, then `[DONE]`. Never imports jax.
"""
from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence

from agentjax.server.chat_run import (ChatRun, Finished, LogprobsDelta, PromptLogprobs, TextDelta, ToolCallArguments,
                                      ToolCallStarted, merged_events)
from agentjax.server.errors import APIError
from agentjax.server.openai_logprobs import CompletionLogprobs, TokenTexts, chat_logprobs, prompt_logprobs_json
from agentjax.server.protocol import ErrorInfo

DONE = "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": max(0, cached_tokens)}}


def error_info(exc: APIError) -> dict:
    return ErrorInfo(message=exc.message, type=exc.error_type, param=exc.param, code=exc.code).model_dump()


class _Stream:
    """Shared chunk framing; `on_finish` runs once every sample has finished."""

    object_name = ""

    def __init__(self, model_name: str, response_id: str, texts: TokenTexts, include_usage: bool,
                 on_finish: Callable[[], None]):
        self.model_name = model_name
        self.response_id = response_id
        self.texts = texts
        self.include_usage = include_usage
        self.on_finish = on_finish
        self.created = int(time.time())

    def chunk(self, choice: dict, **top: object) -> str:
        payload = {"id": self.response_id, "object": self.object_name, "created": self.created,
                   "model": self.model_name, "choices": [choice], **top}
        if self.include_usage:
            payload["usage"] = None
        return sse(payload)

    def usage_chunk(self, finished: Sequence[Finished]) -> str:
        first = finished[0]
        return sse({"id": self.response_id, "object": self.object_name, "created": self.created,
                    "model": self.model_name, "choices": [],
                    "usage": usage_of(first.prompt_tokens, sum(f.completion_tokens for f in finished),
                                      first.cached_tokens)})

    async def framed(self, chunks: AsyncIterator[str], finished: dict[int, Finished]) -> AsyncIterator[str]:
        """`chunks`, then the usage chunk of the samples `finished` (filled as `chunks` runs) and `[DONE]`;
        an `APIError` mid-stream ends it with an error event, then `[DONE]`."""
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    yield chunk
            if self.include_usage:
                yield self.usage_chunk([finished[i] for i in sorted(finished)])
            self.on_finish()
        except APIError as exc:
            yield sse({"error": error_info(exc)})
        yield DONE


class ChatStream(_Stream):
    object_name = "chat.completion.chunk"

    def _choice(self, index: int, delta: dict, pending: dict, finish_reason: str | None = None) -> dict:
        entries = pending.pop(index, None)
        logprobs = {"content": chat_logprobs(entries, self.texts)} if entries is not None else None
        return {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}

    async def events(self, runs: Sequence[ChatRun], report_prompt_logprobs: bool) -> AsyncIterator[str]:
        for index in range(len(runs)):
            yield self.chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                              "logprobs": None})
        finished: dict[int, Finished] = {}
        async for chunk in self.framed(self._chunks(runs, report_prompt_logprobs, finished), finished):
            yield chunk

    async def _chunks(self, runs: Sequence[ChatRun], report_prompt_logprobs: bool,
                      finished: dict[int, Finished]) -> AsyncIterator[str]:
        pending: dict[int, list] = {}
        async for index, event in merged_events(runs):
            if isinstance(event, LogprobsDelta):
                pending.setdefault(index, []).extend(event.entries)
            elif isinstance(event, TextDelta):
                yield self.chunk(self._choice(index, {"content": event.text}, pending))
            elif isinstance(event, ToolCallStarted):
                call = {"index": event.index, "id": event.id, "type": "function",
                        "function": {"name": event.name, "arguments": ""}}
                yield self.chunk(self._choice(index, {"tool_calls": [call]}, pending))
            elif isinstance(event, ToolCallArguments):
                call = {"index": event.index, "function": {"arguments": event.text}}
                yield self.chunk(self._choice(index, {"tool_calls": [call]}, pending))
            elif isinstance(event, Finished):
                finished[index] = event
                top = {}
                if report_prompt_logprobs and index == 0:
                    top["prompt_logprobs"] = prompt_logprobs_json(event.prompt_logprobs, self.texts)
                yield self.chunk(self._choice(index, {}, pending, event.finish_reason), **top)


class CompletionStream(_Stream):
    object_name = "text_completion"

    async def events(self, runs: Sequence[ChatRun], prompt: Sequence[int], echo: str, logprobs: bool,
                     report_prompt_logprobs: bool) -> AsyncIterator[str]:
        """`echo` (the prompt's text) opens each choice; with `logprobs` it waits for the prompt's log
        probabilities, which come with the first generated token."""
        finished: dict[int, Finished] = {}
        chunks = self._chunks(runs, prompt, echo, logprobs, report_prompt_logprobs, finished)
        async for chunk in self.framed(chunks, finished):
            yield chunk

    async def _chunks(self, runs: Sequence[ChatRun], prompt: Sequence[int], echo: str, logprobs: bool,
                      report_prompt_logprobs: bool, finished: dict[int, Finished]) -> AsyncIterator[str]:
        builders = {index: CompletionLogprobs(self.texts) for index in range(len(runs))}
        pending: dict[int, list] = {}
        echo_waits = bool(echo) and logprobs

        def choice(index: int, text: str, finish_reason: str | None = None, **extra: object) -> dict:
            entries = pending.pop(index, None)
            chunk_logprobs = builders[index].chunk(entries) if logprobs and entries is not None else None
            return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": chunk_logprobs,
                    **extra}

        if echo and not echo_waits:
            for index in range(len(runs)):
                yield self.chunk(choice(index, echo))
        async for index, event in merged_events(runs):
            if isinstance(event, PromptLogprobs):  # the first sample's, before any other sample's tokens
                extra = {"prompt_logprobs": prompt_logprobs_json(event.entries, self.texts)} \
                    if report_prompt_logprobs else {}
                for each in range(len(runs)) if echo_waits else ([index] if extra else []):
                    echoed = builders[each].chunk(event.entries, prompt) if echo_waits else None
                    yield self.chunk({"index": each, "text": echo if echo_waits else "", "finish_reason": None,
                                      "logprobs": echoed, **extra})
            elif isinstance(event, LogprobsDelta):
                pending.setdefault(index, []).extend(event.entries)
            elif isinstance(event, TextDelta):
                yield self.chunk(choice(index, event.text))
            elif isinstance(event, Finished):
                finished[index] = event
                yield self.chunk(choice(index, "", event.finish_reason))
