"""`ChatRun`: one queued request's outputs as API-neutral events, for every front end.

Events are `TextDelta`s, tool calls as they decode (`ToolCallStarted` with id and name,
`ToolCallArguments` fragments, `ToolCallDelta` with the whole call) and a final `Finished`;
`LogprobsDelta` (the new tokens' log probabilities, before their text) and `PromptLogprobs` only
when the request asked for them. A parser that reads a call only whole still yields all three, so
front ends handle one shape. The non-streaming reply is the same events collected, so a streamed
reply always reassembles to the non-streamed one. Under a forced tool choice a reply that repeats
a call it already made is over: the repeat is dropped and the request aborted (finish reason
`tool_calls`). `merged_events` interleaves the runs of parallel samples. Never imports jax.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from agentjax.logprobs import TokenLogprobs
from agentjax.sampling_params import SamplingParams
from agentjax.server.async_engine import AsyncEngine, RequestStream
from agentjax.server.errors import APIError, ClientDisconnectedError
from agentjax.server.tool_parsers import ParsedPiece, TextPiece, ToolCall, ToolCallStart, ToolParser
from agentjax.server.tool_parsers import ToolCallArguments as ParsedArguments
from agentjax.stop_strings import ReplyText

DISCONNECT_POLL_S = 1.0
USAGE_SCOPE_KEY = "agentjax.usage"  # where the access log finds a request's token counts


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStarted:
    """A call's id and name, before any of its arguments."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    """A fragment of call `index`'s arguments (the fragments join to the finished call's)."""

    index: int
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """Call `index`, complete."""

    index: int
    call: ToolCall


@dataclass(frozen=True)
class LogprobsDelta:
    """The log probabilities of the tokens whose text follows (one entry per generated token)."""

    entries: list[TokenLogprobs]


@dataclass(frozen=True)
class PromptLogprobs:
    """The prompt's log probabilities (one entry per prompt token, the first None), when asked for;
    they arrive with the first generated token."""

    entries: list[TokenLogprobs | None]


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # stop, length, tool_calls (ended normally after calls) or abort
    stop_sequence: str | None  # the stop string that ended the reply, if one did
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # when the request asked for them


ChatEvent = TextDelta | ToolCallStarted | ToolCallArguments | ToolCallDelta | LogprobsDelta | PromptLogprobs | Finished


@dataclass
class ChatResult:
    text: str
    tool_calls: list[ToolCall]
    finished: Finished
    # text, whole calls and (when asked for) log probabilities, in order
    parts: list[TextDelta | ToolCallDelta | LogprobsDelta] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None  # every generated token's, when asked for
    token_ids: list[int] = field(default_factory=list)  # every generated token


class _CallSequencer:
    """Numbers the parser's calls and, under a forced tool choice, holds back a call while it could
    still be a repeat of one this reply already made (its arguments so far begin an earlier call's)."""

    def __init__(self, forced: bool):
        self.forced = forced
        self.done: list[ToolCall] = []
        self.index = -1
        self.open = False  # a started call awaits its end
        self.name = ""
        self.arguments = ""
        self.held: list[ChatEvent] | None = None  # events of a possible repeat, not yet sent
        self.repeated = False

    def _could_repeat(self, name: str, arguments: str, whole: bool) -> bool:
        return any(call.name == name and (call.arguments == arguments if whole else call.arguments.startswith(arguments))
                   for call in self.done)

    def events(self, pieces: list[ParsedPiece]) -> Iterator[ChatEvent]:
        for piece in pieces:
            if self.repeated:
                return
            if isinstance(piece, TextPiece):
                # Under a forced tool choice only a cut-off call can follow a complete one: dropped.
                if piece.text and not (self.forced and self.done):
                    yield TextDelta(piece.text)
            elif isinstance(piece, ToolCallStart):
                self.index += 1
                self.open, self.name, self.arguments = True, piece.name, ""
                started = ToolCallStarted(self.index, piece.id, piece.name)
                if self.forced and self._could_repeat(piece.name, "", whole=False):
                    self.held = [started]
                else:
                    yield started
            elif isinstance(piece, ParsedArguments):
                self.arguments += piece.text
                event = ToolCallArguments(self.index, piece.text)
                if self.held is None:
                    yield event
                else:
                    self.held.append(event)
                    if self._could_repeat(self.name, self.arguments, whole=True):
                        self.repeated = True  # its arguments object is closed: a whole repeat
                    elif not self._could_repeat(self.name, self.arguments, whole=False):
                        yield from self.held
                        self.held = None
            else:
                yield from self._finished(piece)

    def complete(self) -> bool:
        """Whether the calls made so far are whole (arguments that parse) and none is still being sent."""
        if not self.done or (self.open and self.held is None):
            return False
        return all(_is_object(call.arguments) for call in self.done)

    def _finished(self, call: ToolCall) -> Iterator[ChatEvent]:
        if self.forced and self._could_repeat(call.name, call.arguments, whole=True):
            self.repeated = True
            return
        if not self.open:  # a parser that reads calls whole: start and arguments come with the end
            self.index += 1
            yield ToolCallStarted(self.index, call.id, call.name)
            yield ToolCallArguments(self.index, call.arguments)
        elif self.held is not None:
            yield from self.held
        self.held, self.open = None, False
        self.done.append(call)
        yield ToolCallDelta(self.index, call)


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


class ChatRun:
    """One queued request; iterate `events()` once, or `collect()` it."""

    def __init__(self, engine: AsyncEngine, tokenizer: Any, stream: RequestStream, prompt_tokens: int,
                 sampling: SamplingParams, parser: ToolParser | None, *, forced_calls: bool = False):
        self.engine = engine
        self.tokenizer = tokenizer
        self.stream = stream
        self.request_id = stream.request_id
        self.prompt_tokens = prompt_tokens
        self.sampling = sampling
        self.parser = parser
        self.forced_calls = forced_calls
        self.usage: dict | None = None  # token counts are added here as the reply runs
        self.counts_prompt = True  # False for a parallel sample after the first: its prompt is counted once
        self.token_ids: list[int] = []  # generated so far

    def report_usage_to(self, request: Request) -> ChatRun:
        """Adds this reply's token counts to the request's access-log entry as they become known
        (prompt and cached tokens with the first output), so a reply its client left is logged too."""
        self.usage = request.scope.get(USAGE_SCOPE_KEY)
        return self

    def _add_usage(self, **counts) -> None:
        if self.usage is not None:
            for key, value in counts.items():
                self.usage[key] = self.usage.get(key, 0) + value

    def abort(self) -> None:
        self.engine.abort(self.request_id)

    async def events(self) -> AsyncIterator[ChatEvent]:
        """Text deltas and tool calls as they are decoded, then `Finished`. Engine failures raise
        `APIError`."""
        reply = ReplyText(self.tokenizer, self.sampling.stop)
        calls = _CallSequencer(self.forced_calls)
        completion_tokens, cached, finish_reason, prompt_logprobs = 0, 0, "abort", None
        first_output = True
        async for output in self.stream:
            if first_output and self.counts_prompt:
                self._add_usage(prompt_tokens=self.prompt_tokens, cached_tokens=max(0, output.num_cached_tokens))
            first_output = False
            completion_tokens += len(output.new_token_ids)
            self._add_usage(completion_tokens=len(output.new_token_ids))
            self.token_ids.extend(output.new_token_ids)
            cached = max(0, output.num_cached_tokens)
            if getattr(output, "prompt_logprobs", None) is not None:
                prompt_logprobs = output.prompt_logprobs
                yield PromptLogprobs(prompt_logprobs)
            if self.sampling.logprobs is not None and getattr(output, "logprobs", None):
                yield LogprobsDelta(list(output.logprobs))
            if output.finished:
                finish_reason = output.finish_reason or "stop"
            text = reply.push(output.new_token_ids, output.finished)
            if self.parser is None:
                pieces: list[ParsedPiece] = [TextPiece(text)] if text else []
            else:
                pieces = self.parser.feed(text, output.finished)
            for event in calls.events(pieces):
                yield event
            if calls.repeated:  # a forced reply repeating a call: nothing new can follow
                self.abort()
                finish_reason = "stop"
                break
        if self.forced_calls and finish_reason == "length" and calls.complete():
            finish_reason = "stop"  # cut off after whole calls (in a repeat, or a call's first tokens)
        if calls.done and finish_reason == "stop":
            finish_reason = "tool_calls"  # a reply cut off by max_tokens still says "length"
        if self.usage is not None:
            self.usage["finish_reason"] = finish_reason
        yield Finished(finish_reason, reply.matched, self.prompt_tokens, completion_tokens, cached, prompt_logprobs)

    async def collect(self, request: Request | None = None) -> ChatResult:
        """All events at once; aborts the request if the client disconnects first."""
        task = asyncio.ensure_future(self._gather())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if request is not None and await request.is_disconnected():
                    task.cancel()
                    raise ClientDisconnectedError("the client disconnected; the request was aborted")
        finally:
            self.abort()  # no-op once finished

    async def _gather(self) -> ChatResult:
        texts, calls, parts = [], [], []
        logprobs = [] if self.sampling.logprobs is not None else None
        async for event in self.events():
            if isinstance(event, LogprobsDelta):
                logprobs.extend(event.entries)
                parts.append(event)
            elif isinstance(event, TextDelta):
                texts.append(event.text)
                parts.append(event)
            elif isinstance(event, ToolCallDelta):
                calls.append(event.call)
                parts.append(event)
            elif isinstance(event, Finished):
                return ChatResult("".join(texts), calls, event, parts, logprobs, list(self.token_ids))
        raise APIError("the reply ended without finishing", code="internal_error")


async def merged_events(runs: Sequence[ChatRun]) -> AsyncIterator[tuple[int, ChatEvent]]:
    """The events of several runs (parallel samples) as they arrive, each with its run's index; a
    run's failure is raised here. Closing the iterator stops reading the runs (the caller aborts them)."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, run: ChatRun) -> None:
        try:
            async for event in run.events():
                queue.put_nowait((index, event))
        except Exception as exc:  # handed to the reader, which raises it
            queue.put_nowait((index, exc))
        finally:
            queue.put_nowait((index, done))

    tasks = [asyncio.ensure_future(pump(index, run)) for index, run in enumerate(runs)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
