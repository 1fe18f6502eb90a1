"""The chat and text completion handlers: request -> engine request(s) -> JSON or server-sent events.

Turns validated schemas into token ids, `SamplingParams`, a session id and `AgentHints`, then
streams or collects the engine's outputs. A request whose client goes away is aborted, so its
pages return to the pool. Never touches the engine directly: everything goes through `AsyncEngine`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from agentjax.sampling_params import SamplingParams
from agentjax.scheduler.request import AgentHints
from agentjax.server.async_engine import AsyncEngine, RequestStream
from agentjax.server.errors import APIError, ClientDisconnectedError, ModelNotFoundError
from agentjax.server.chat_path import ChatInput, ChatPath, ChatRun, TextDelta, ToolCallDelta, ToolChoice
from agentjax.server.protocol import (
    AgentHintsModel,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    NamedToolChoice,
    ResponseFormat,
    SamplingFields,
)
from agentjax.server.tool_parsers import ToolCall
from agentjax.structured.spec import StructuredOutput
from agentjax.server.text import StopTextBuffer, apply_stop, chat_messages
from checkpoints.tokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)

SESSION_HEADERS = ("x-session-id", "x-correlation-id")
DISCONNECT_POLL_S = 1.0
_HINT_FIELDS = {f.name for f in dataclasses.fields(AgentHints)}


def session_id_from(body_id: str | None, hints: AgentHintsModel | None, request: Request) -> str | None:
    """The request's session id: the API's own body field, then `agent_hints.session_id`, then the
    first session header present."""
    if body_id:
        return body_id
    if hints is not None and hints.session_id:
        return hints.session_id
    for header in SESSION_HEADERS:
        if request.headers.get(header):
            return request.headers[header][:256]
    return None


@dataclass(frozen=True)
class ServerLimits:
    """Bounds on what one request may ask for."""

    max_tokens_limit: int = 4096
    max_request_body_bytes: int = 8 * 2**20
    max_queued_requests: int = 256


class AbortOnCloseStreamingResponse(StreamingResponse):
    """A streaming response that runs `on_close` however it ends: finished, failed or disconnected."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": max(0, cached_tokens)}}


class OpenAIServing:
    """Serves `/v1/chat/completions` and `/v1/completions` on one `AsyncEngine`."""

    def __init__(self, engine: AsyncEngine, tokenizer, model_name: str, limits: ServerLimits,
                 model_aliases: tuple[str, ...] = (), chat_path: ChatPath | None = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.chat_path = chat_path or ChatPath(engine, tokenizer, max_tokens_limit=limits.max_tokens_limit)
        self.model_name = model_name
        self.model_names = {model_name, *model_aliases}
        self.limits = limits

    # ---- shared preparation -----------------------------------------------------------------
    def check_request(self, body: SamplingFields) -> None:
        if body.model is not None and body.model not in self.model_names:
            raise ModelNotFoundError(f"model {body.model!r} does not exist; this server serves {self.model_name!r}",
                                     param="model", code="model_not_found")
        if body.logprobs:
            raise APIError("logprobs are not supported", param="logprobs")

    def session_id_of(self, body: SamplingFields, request: Request) -> str | None:
        return session_id_from(body.session_id, body.agent_hints, request)

    def sampling_of(self, body: SamplingFields, requested: int | None, prompt_len: int) -> SamplingParams:
        max_tokens = self.chat_path.max_tokens_for(requested, prompt_len)
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(s for s in body.stop or () if s)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=max(0, body.top_k or 0),
            seed=body.seed,
            stop=stop,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            min_tokens=min(body.min_tokens, max_tokens),
        )

    def engine_kwargs_of(self, body: SamplingFields, session_id: str | None) -> dict:
        hints = None
        priority = body.priority
        if body.agent_hints is not None:
            values = {k: v for k, v in body.agent_hints.model_dump(exclude_none=True).items() if k in _HINT_FIELDS}
            if session_id is not None:
                values["session_id"] = session_id
            hints = AgentHints(**values)
            if priority is None:
                priority = body.agent_hints.priority
        kwargs = {"session_id": session_id, "priority": priority or 0, "hints": hints}
        if body.cache_salt is not None:
            kwargs["cache_salt"] = body.cache_salt
        return kwargs

    def finish(self, body: SamplingFields, session_id: str | None) -> None:
        """After the last output: a `session_end` hint releases the session's pins."""
        if session_id and body.agent_hints is not None and body.agent_hints.session_end:
            self.engine.end_session(session_id)

    async def collect(self, stream: RequestStream, request: Request) -> tuple[list[int], str | None, int, int]:
        """(token ids, finish reason, cached tokens, prompt tokens); aborts if the client leaves."""
        token_ids: list[int] = []
        finish_reason, cached, prompt_len = None, 0, 0
        try:
            while True:
                try:
                    output = await asyncio.wait_for(anext(stream), DISCONNECT_POLL_S)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    if await request.is_disconnected():
                        raise ClientDisconnectedError("the client disconnected; the request was aborted")
                    continue
                token_ids.extend(output.new_token_ids)
                finish_reason = output.finish_reason or finish_reason
                cached, prompt_len = output.num_cached_tokens, output.num_prompt_tokens
        finally:
            self.engine.abort(stream.request_id)  # no-op once finished
        return token_ids, finish_reason, cached, prompt_len

    # ---- chat ---------------------------------------------------------------------------------
    def chat_input_of(self, body: ChatCompletionRequest) -> ChatInput:
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools or ()]
        choice = body.tool_choice
        if isinstance(choice, NamedToolChoice):
            tool_choice = ToolChoice("function", choice.function.name)
        else:
            tool_choice = ToolChoice(choice or ("auto" if tools else "none"))
        return ChatInput(chat_messages(body.messages), tools, tool_choice, body.parallel_tool_calls,
                         structured_output_of(body.response_format))

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_request(body)
        chat = self.chat_input_of(body)
        self.chat_path.check_tools(chat)
        prompt = self.chat_path.prompt_ids(chat)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        sampling = self.sampling_of(body, requested, len(prompt))
        session_id = self.session_id_of(body, request)
        run = await self.chat_path.start(chat, sampling, prompt, **self.engine_kwargs_of(body, session_id))
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = self._chat_events(run, response_id, body, include_usage, session_id)
            return AbortOnCloseStreamingResponse(events, run.abort)
        result = await run.collect(request)
        self.finish(body, session_id)
        message = {"role": "assistant", "content": result.text if result.text or not result.tool_calls else None}
        if result.tool_calls:
            message["tool_calls"] = [_tool_call_json(call) for call in result.tool_calls]
        done = result.finished
        return JSONResponse({
            "id": response_id, "object": "chat.completion", "created": _now(), "model": self.model_name,
            "choices": [{"index": 0, "message": message, "finish_reason": done.finish_reason, "logprobs": None}],
            "usage": usage_of(done.prompt_tokens, done.completion_tokens, done.cached_tokens),
        })

    async def _chat_events(self, run: ChatRun, response_id: str, body: ChatCompletionRequest,
                           include_usage: bool, session_id: str | None) -> AsyncIterator[str]:
        created = _now()

        def chunk(delta: dict, finish_reason: str | None = None) -> str:
            payload = {"id": response_id, "object": "chat.completion.chunk", "created": created,
                       "model": self.model_name,
                       "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}
            if include_usage:
                payload["usage"] = None
            return sse(payload)

        yield chunk({"role": "assistant", "content": ""})
        try:
            async for event in run.events():
                if isinstance(event, TextDelta):
                    yield chunk({"content": event.text})
                elif isinstance(event, ToolCallDelta):
                    call = event.call
                    yield chunk({"tool_calls": [{"index": event.index, "id": call.id, "type": "function",
                                                 "function": {"name": call.name, "arguments": ""}}]})
                    yield chunk({"tool_calls": [{"index": event.index, "function": {"arguments": call.arguments}}]})
                else:
                    yield chunk({}, event.finish_reason)
                    if include_usage:
                        yield sse({"id": response_id, "object": "chat.completion.chunk", "created": created,
                                   "model": self.model_name, "choices": [],
                                   "usage": usage_of(event.prompt_tokens, event.completion_tokens,
                                                     event.cached_tokens)})
                    self.finish(body, session_id)
        except APIError as exc:
            yield sse({"error": ErrorInfo(message=exc.message, type=exc.error_type, code=exc.code).model_dump()})
        yield "data: [DONE]\n\n"

    async def _text_deltas(self, stream: RequestStream, sampling: SamplingParams) -> AsyncIterator[tuple[str, object]]:
        """("text", delta) items, then ("done", (finish_reason, completion_tokens, cached)) or ("error", info)."""
        detokenizer = IncrementalDetokenizer(self.tokenizer)
        buffer = StopTextBuffer(sampling.stop)
        completion_tokens, cached, finish_reason = 0, 0, None
        try:
            async for output in stream:
                completion_tokens += len(output.new_token_ids)
                cached = output.num_cached_tokens
                delta = detokenizer.add_tokens(output.new_token_ids)
                if output.finished:
                    delta += detokenizer.flush()
                    finish_reason = output.finish_reason
                text = buffer.push(delta, output.finished)
                if text:
                    yield "text", text
        except APIError as exc:
            yield "error", ErrorInfo(message=exc.message, type=exc.error_type, code=exc.code).model_dump()
            return
        yield "done", (finish_reason, completion_tokens, cached)

    # ---- text completions ---------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self.check_request(body)
        if body.echo or body.suffix:
            raise APIError("echo and suffix are not supported", param="echo" if body.echo else "suffix")
        prompts = self._prompts_of(body.prompt)
        if body.stream and len(prompts) > 1:
            raise APIError("a streaming completion takes one prompt; got a list of "
                           f"{len(prompts)}", param="prompt")
        session_id = self.session_id_of(body, request)
        kwargs = self.engine_kwargs_of(body, session_id)
        samplings = [self.sampling_of(body, body.max_tokens, len(p)) for p in prompts]
        streams: list[RequestStream] = []
        try:
            for prompt, sampling in zip(prompts, samplings):
                streams.append(await self.engine.add_request(prompt, sampling, **kwargs))
        except BaseException:
            for stream in streams:
                self.engine.abort(stream.request_id)
            raise
        response_id = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = self._completion_events(streams[0], response_id, body, samplings[0], len(prompts[0]),
                                             include_usage, session_id)
            return AbortOnCloseStreamingResponse(events, lambda: self.engine.abort(streams[0].request_id))
        results = await asyncio.gather(*(self.collect(s, request) for s in streams))
        self.finish(body, session_id)
        choices, prompt_tokens, completion_tokens, cached_tokens = [], 0, 0, 0
        for index, ((token_ids, reason, cached, _), prompt, sampling) in enumerate(zip(results, prompts, samplings)):
            text = apply_stop(self.tokenizer.decode(token_ids), sampling.stop)
            choices.append({"index": index, "text": text, "finish_reason": reason, "logprobs": None})
            prompt_tokens += len(prompt)
            completion_tokens += len(token_ids)
            cached_tokens += max(0, cached)
        return JSONResponse({"id": response_id, "object": "text_completion", "created": _now(),
                             "model": self.model_name, "choices": choices,
                             "usage": usage_of(prompt_tokens, completion_tokens, cached_tokens)})

    def _prompts_of(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self.tokenizer.encode(prompt)]
        if prompt and isinstance(prompt[0], int):
            return [list(prompt)]
        return [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]

    async def _completion_events(self, stream: RequestStream, response_id: str, body: CompletionRequest,
                                 sampling: SamplingParams, prompt_len: int, include_usage: bool,
                                 session_id: str | None) -> AsyncIterator[str]:
        created = _now()

        def chunk(text: str, finish_reason: str | None = None) -> str:
            payload = {"id": response_id, "object": "text_completion", "created": created, "model": self.model_name,
                       "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}]}
            if include_usage:
                payload["usage"] = None
            return sse(payload)

        async for kind, value in self._text_deltas(stream, sampling):
            if kind == "text":
                yield chunk(value)
            elif kind == "error":
                yield sse({"error": value})
                break
            else:
                finish_reason, completion_tokens, cached = value
                yield chunk("", finish_reason)
                if include_usage:
                    yield sse({"id": response_id, "object": "text_completion", "created": created,
                               "model": self.model_name, "choices": [],
                               "usage": usage_of(prompt_len, completion_tokens, cached)})
                self.finish(body, session_id)
        yield "data: [DONE]\n\n"


def _now() -> int:
    return int(time.time())


def _tool_call_json(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def structured_output_of(response_format: ResponseFormat | None) -> StructuredOutput | None:
    """OpenAI's `response_format` as a decoding constraint (`text`: none)."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutput.json_object()
    if response_format.json_schema is None:
        raise APIError("response_format of type json_schema needs its json_schema", param="response_format")
    schema = response_format.json_schema.schema_ or {"type": "object"}
    return StructuredOutput.json_schema(schema)
