"""The one request path both HTTP APIs (OpenAI chat, Anthropic messages) share.

A front end turns its request into a `ChatInput` (OpenAI-style message dicts, function tools, a
`ToolChoice`) and `SamplingParams`; `ChatPath` renders the prompt through the chat template,
adds the structured-output constraint that a forced tool choice needs, queues the request, and
gives back a `ChatRun` whose `events()` are text deltas, whole tool calls and a final
`Finished`. The non-streaming reply is those same events collected, so a streamed reply always
reassembles to the non-streamed one. Never imports jax.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from starlette.requests import Request

from agentjax.sampling_params import SamplingParams
from agentjax.server.async_engine import AsyncEngine, RequestStream
from agentjax.server.errors import APIError, ClientDisconnectedError
from agentjax.server.text import StopTextBuffer
from agentjax.server.tool_parsers import TextPiece, ToolCall, ToolParser, tool_parser_class
from agentjax.structured.spec import StructuredOutput
from checkpoints.tokenizer import IncrementalDetokenizer

DISCONNECT_POLL_S = 1.0


@dataclass(frozen=True)
class ToolChoice:
    """`auto` (the model decides), `none` (no tools), `required` (at least one call), or `function`
    (a call of `name`)."""

    mode: Literal["auto", "none", "required", "function"] = "auto"
    name: str | None = None


@dataclass
class ChatInput:
    """A chat request, independent of the API it came through."""

    messages: list[dict]  # role, content (text), and OpenAI-style tool_calls / tool_call_id
    tools: list[dict] = field(default_factory=list)  # [{"type": "function", "function": {name, description, parameters}}]
    tool_choice: ToolChoice = ToolChoice()
    parallel_tool_calls: bool = True
    structured: StructuredOutput | None = None  # a response format (JSON schema or object)


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A whole tool call: the parser emits a call once it has read it entirely."""

    index: int
    call: ToolCall


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # stop, length, tool_calls (ended normally after calls) or abort
    stop_sequence: str | None  # the stop string that ended the reply, if one did
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


ChatEvent = TextDelta | ToolCallDelta | Finished


@dataclass
class ChatResult:
    text: str
    tool_calls: list[ToolCall]
    finished: Finished
    parts: list[TextDelta | ToolCallDelta] = field(default_factory=list)  # the events in order


class ChatRun:
    """One queued chat request; iterate `events()` once, or `collect()` it."""

    def __init__(self, path: ChatPath, stream: RequestStream, prompt_tokens: int, sampling: SamplingParams,
                 parser: ToolParser | None):
        self.path = path
        self.stream = stream
        self.request_id = stream.request_id
        self.prompt_tokens = prompt_tokens
        self.sampling = sampling
        self.parser = parser

    def abort(self) -> None:
        self.path.engine.abort(self.request_id)

    async def events(self) -> AsyncIterator[ChatEvent]:
        """Text deltas and tool calls as they are decoded, then `Finished`. Engine failures raise
        `APIError`."""
        detokenizer = IncrementalDetokenizer(self.path.tokenizer)
        buffer = StopTextBuffer(self.sampling.stop)
        completion_tokens, cached, finish_reason, num_calls = 0, 0, "abort", 0
        async for output in self.stream:
            completion_tokens += len(output.new_token_ids)
            cached = max(0, output.num_cached_tokens)
            delta = detokenizer.add_tokens(output.new_token_ids)
            if output.finished:
                delta += detokenizer.flush()
                finish_reason = output.finish_reason or "stop"
            text = buffer.push(delta, output.finished)
            if self.parser is None:
                pieces = [TextPiece(text)] if text else []
            else:
                pieces = self.parser.feed(text, output.finished)
            for piece in pieces:
                if isinstance(piece, ToolCall):
                    yield ToolCallDelta(num_calls, piece)
                    num_calls += 1
                elif piece.text:
                    yield TextDelta(piece.text)
        if num_calls and finish_reason == "stop":
            finish_reason = "tool_calls"  # a reply cut off by max_tokens still says "length"
        yield Finished(finish_reason, buffer.matched, self.prompt_tokens, completion_tokens, cached)

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
        async for event in self.events():
            if isinstance(event, TextDelta):
                texts.append(event.text)
            elif isinstance(event, ToolCallDelta):
                calls.append(event.call)
            else:
                return ChatResult("".join(texts), calls, event, parts)
            parts.append(event)
        raise APIError("the reply ended without finishing", code="internal_error")


class ChatPath:
    """Renders chats, applies tool choice, and queues them on one `AsyncEngine`."""

    def __init__(self, engine: AsyncEngine, tokenizer: Any, *, max_tokens_limit: int, tool_parser: str = "hermes"):
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_tokens_limit = max_tokens_limit
        self.tool_parser = tool_parser_class(tool_parser)

    def max_tokens_for(self, requested: int | None, prompt_tokens: int, param: str = "max_tokens") -> int:
        """The request's token budget: what it asked for, or what the context leaves; at most the limit."""
        limit = self.max_tokens_limit
        if requested is None:
            return max(1, min(limit, self.engine.max_model_len - prompt_tokens))
        if requested > limit:
            raise APIError(f"{param}={requested} exceeds this server's limit of {limit} tokens "
                           f"(--max-tokens-limit)", param=param, code="max_tokens_too_large")
        return requested

    def check_tools(self, chat: ChatInput, param: str = "tools") -> None:
        names = set()
        for index, tool in enumerate(chat.tools):
            function = tool.get("function") if isinstance(tool, Mapping) else None
            if tool.get("type", "function") != "function" or not isinstance(function, Mapping) \
                    or not isinstance(function.get("name"), str) or not function["name"]:
                raise APIError(f"{param}[{index}] must be a function tool with a name", param=f"{param}[{index}]")
            parameters = function.get("parameters")
            if parameters is not None and not isinstance(parameters, Mapping):
                raise APIError(f"{param}[{index}]'s parameters must be a JSON schema object",
                               param=f"{param}[{index}]")
            names.add(function["name"])
        choice = chat.tool_choice
        if choice.mode in ("required", "function") and not chat.tools:
            raise APIError(f"tool_choice {choice.mode!r} needs tools", param="tool_choice")
        if choice.mode == "function" and choice.name not in names:
            raise APIError(f"tool_choice names {choice.name!r}, which is not among the tools "
                           f"({', '.join(sorted(names))})", param="tool_choice")

    def prompt_ids(self, chat: ChatInput, add_generation_prompt: bool = True) -> list[int]:
        """The rendered prompt. Tools are rendered even with tool choice `none`, so that an agent that
        switches tool choice between turns keeps its prompt prefix (and its cache hits)."""
        return self.tokenizer.encode_chat(chat.messages, add_generation_prompt=add_generation_prompt,
                                          tools=chat.tools or None)

    def constraint(self, chat: ChatInput) -> StructuredOutput | None:
        """What decoding must produce: a call when the tool choice forces one, else the response format."""
        choice = chat.tool_choice
        if choice.mode not in ("required", "function"):
            return chat.structured
        if chat.structured is not None:
            raise APIError("a response format cannot be combined with a forced tool choice", param="tool_choice")
        functions = [t["function"] for t in chat.tools if choice.mode == "required" or t["function"]["name"] == choice.name]
        return self.tool_parser.constraint(functions, chat.parallel_tool_calls and choice.mode == "required")

    async def start(self, chat: ChatInput, sampling: SamplingParams, prompt: Sequence[int] | None = None,
                    **engine_kwargs: Any) -> ChatRun:
        """Queues the chat; `engine_kwargs` go to `Engine.add_request`. A caller that passes `prompt`
        has rendered it with `prompt_ids` after `check_tools`."""
        if prompt is None:
            self.check_tools(chat)
            prompt = self.prompt_ids(chat)
        constraint = self.constraint(chat)
        if constraint is not None:
            sampling = replace(sampling, structured=constraint)
        parser = self.tool_parser(chat.tools) if chat.tools and chat.tool_choice.mode != "none" else None
        stream = await self.engine.add_request(prompt, sampling, **engine_kwargs)
        return ChatRun(self, stream, len(prompt), sampling, parser)
