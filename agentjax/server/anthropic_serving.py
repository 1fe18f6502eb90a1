"""The Anthropic Messages handlers: `/v1/messages` (JSON or server-sent events) and its token count.

A request converts to the shared `ChatInput` (`anthropic_convert`) and runs on the same
`ChatPath`, session, hint and metrics handling as the OpenAI routes (it borrows `OpenAIServing`'s
`engine_kwargs_of` and `finish`); only the shape of the answer differs. A streamed reply whose
client goes away is aborted, so its pages return to the pool. Never touches the engine directly.

Usage follows Anthropic's split of the prompt, `input_tokens + cache_read_input_tokens +
cache_creation_input_tokens` = prompt tokens: `cache_read_input_tokens` are the prompt tokens
found in the prefix cache (any prefix: this server caches every prompt, marked or not), and
`cache_creation_input_tokens` the tokens of the longest `cache_control`-marked prefix that were
not read from the cache, that is, computed by this request and now pinned for the mark's ttl
(0 without marks; the engine pins whole cached pages, so a marked prefix's last partial page is
counted but not held). When streaming, `message_start` cannot know the cache hit yet and reports
the whole prompt as `input_tokens`; `message_delta` carries the final split, which the SDKs
take as the message's usage.
"""
from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentjax.sampling_params import SamplingParams
from agentjax.server.anthropic_convert import cache_marks, chat_input_of, pin_prefixes
from agentjax.server.anthropic_protocol import CountTokensRequest, MessagesRequest, error_body
from agentjax.server.chat_path import (
    ChatInput,
    ChatRun,
    Finished,
    TextDelta,
    ToolCallArguments,
    ToolCallDelta,
    ToolCallStarted,
)
from agentjax.server.errors import APIError, ModelNotFoundError
from agentjax.server.serving import AbortOnCloseStreamingResponse, OpenAIServing, session_id_from
from agentjax.server.tool_parsers import ToolCall

logger = logging.getLogger(__name__)

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}
IGNORED_SETTINGS = ("thinking", "context_management", "output_config")


def event(payload: dict) -> str:
    """One server-sent event, named by the payload's type as Anthropic's stream names them."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


def stop_reason_of(finished: Finished) -> str:
    if finished.finish_reason == "stop" and finished.stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(finished.finish_reason, "end_turn")


def usage_of(finished: Finished, pinned_tokens: int) -> dict:
    prompt = finished.prompt_tokens
    cached = min(max(0, finished.cached_tokens), prompt)
    created = max(0, min(pinned_tokens, prompt) - cached)
    return {"input_tokens": prompt - cached - created, "output_tokens": finished.completion_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": created}


def tool_use_id(call_id: str) -> str:
    return f"toolu_{call_id.removeprefix('call_')}"


def tool_use_block(call: ToolCall) -> dict:
    """A parsed call as a `tool_use` block; arguments that broke off (a reply cut by max_tokens in
    the middle of a call) give an empty input."""
    try:
        arguments = json.loads(call.arguments)
    except json.JSONDecodeError:
        arguments = None
    return {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name,
            "input": arguments if isinstance(arguments, dict) else {}}


def anthropic_session_id(user_id: str | None) -> str | None:
    """`metadata.user_id`, or its `session_id` when it is a JSON object (Claude Code sends
    `{"device_id": ..., "session_id": ...}`)."""
    if user_id and user_id.lstrip().startswith("{"):
        try:
            value = json.loads(user_id)
        except json.JSONDecodeError:
            return user_id[:256]
        if isinstance(value, dict) and isinstance(value.get("session_id"), str) and value["session_id"]:
            return value["session_id"][:256]
    return user_id[:256] if user_id else None


def content_blocks(parts: list[TextDelta | ToolCallDelta]) -> list[dict]:
    """The reply's blocks in the order the stream sends them: a text block opens once it holds more
    than whitespace, and text after a tool call starts a new block."""
    blocks, held, text_open = [], "", False
    for part in parts:
        if isinstance(part, ToolCallDelta):
            blocks.append(tool_use_block(part.call))
            held, text_open = "", False
        elif text_open:
            blocks[-1]["text"] += part.text
        else:
            held += part.text
            if held.strip():
                blocks.append({"type": "text", "text": held})
                held, text_open = "", True
    return blocks


class AnthropicServing:
    """Serves `/v1/messages` and `/v1/messages/count_tokens` beside an `OpenAIServing`."""

    def __init__(self, openai: OpenAIServing):
        self.openai = openai
        self.chat_path = openai.chat_path

    def prepare(self, body: CountTokensRequest, bounded: bool = True) -> tuple[ChatInput, list[int]]:
        """(chat, prompt ids); 404 for an unknown model, 400 for tools or blocks that do not fit (and,
        `bounded`, for a prompt over the context)."""
        if body.model not in self.openai.model_names:
            raise ModelNotFoundError(f"model {body.model!r} does not exist; this server serves "
                                     f"{self.openai.model_name!r}", param="model", code="model_not_found")
        chat = chat_input_of(body)
        self.chat_path.check_tools(chat)
        cache_marks(body)  # more than 4 marks fail here, before any rendering
        return chat, self.chat_path.prompt_ids(chat, api="anthropic", bounded=bounded)

    def _prepare_with_pins(self, body: MessagesRequest) -> tuple[ChatInput, list[int], list[tuple[int, float]]]:
        chat, prompt = self.prepare(body)
        return chat, prompt, pin_prefixes(self.chat_path, body, chat, prompt)

    async def count_tokens(self, body: CountTokensRequest) -> Response:
        _, prompt = await self.chat_path.off_loop(self.prepare, body, False)
        return JSONResponse({"input_tokens": len(prompt)})

    def sampling_of(self, body: MessagesRequest, prompt_len: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.chat_path.max_tokens_for(body.max_tokens, prompt_len, api="anthropic"),
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            stop=tuple(s for s in body.stop_sequences or () if s),
        )

    async def messages(self, body: MessagesRequest, request: Request) -> Response:
        ignored = [name for name in IGNORED_SETTINGS if getattr(body, name) is not None]
        if ignored:
            logger.info("/v1/messages: ignoring %s (not supported by this server)",
                        ", ".join(f"{name}={json.dumps(getattr(body, name))[:80]}" for name in ignored))
        chat, prompt, pins = await self.chat_path.off_loop(self._prepare_with_pins, body)
        sampling = self.sampling_of(body, len(prompt))
        user_id = body.metadata.user_id if body.metadata is not None else None
        session_id = session_id_from(anthropic_session_id(user_id), body.agent_hints, request)
        kwargs = self.openai.engine_kwargs_of(body, session_id, request)
        if pins:
            kwargs["pin_prefixes"] = pins
        run = (await self.chat_path.start(chat, sampling, prompt, **kwargs)).report_usage_to(request)
        message_id = f"msg_{uuid.uuid4().hex[:24]}"
        pinned = max((n for n, _ in pins), default=0)
        if body.stream:
            return AbortOnCloseStreamingResponse(self._events(run, message_id, body, session_id, pinned), run.abort)
        result = await run.collect(request)
        self.openai.finish(body, session_id)
        content = content_blocks(result.parts)
        done = result.finished
        return JSONResponse({
            "id": message_id, "type": "message", "role": "assistant", "model": self.openai.model_name,
            "content": content, "stop_reason": stop_reason_of(done), "stop_sequence": done.stop_sequence,
            "usage": usage_of(done, pinned),
        })

    async def _events(self, run: ChatRun, message_id: str, body: MessagesRequest, session_id: str | None,
                      pinned: int) -> AsyncIterator[str]:
        start_usage = {"input_tokens": run.prompt_tokens, "output_tokens": 0, "cache_read_input_tokens": 0,
                       "cache_creation_input_tokens": 0}
        yield event({"type": "message_start", "message": {
            "id": message_id, "type": "message", "role": "assistant", "model": self.openai.model_name,
            "content": [], "stop_reason": None, "stop_sequence": None, "usage": start_usage}})
        index, text_open, held = -1, False, ""
        try:
            async for item in run.events():
                if isinstance(item, TextDelta):
                    text = item.text
                    if not text_open:  # a text block opens only once it has more than whitespace
                        held += text
                        if not held.strip():
                            continue
                        index, text_open, text, held = index + 1, True, held, ""
                        yield event({"type": "content_block_start", "index": index,
                                     "content_block": {"type": "text", "text": ""}})
                    yield event({"type": "content_block_delta", "index": index,
                                 "delta": {"type": "text_delta", "text": text}})
                elif isinstance(item, ToolCallStarted):
                    if text_open:
                        yield event({"type": "content_block_stop", "index": index})
                    index, text_open, held = index + 1, False, ""
                    yield event({"type": "content_block_start", "index": index, "content_block": {
                        "type": "tool_use", "id": tool_use_id(item.id), "name": item.name, "input": {}}})
                elif isinstance(item, ToolCallArguments):
                    yield event({"type": "content_block_delta", "index": index,
                                 "delta": {"type": "input_json_delta", "partial_json": item.text}})
                elif isinstance(item, ToolCallDelta):
                    yield event({"type": "content_block_stop", "index": index})
                elif isinstance(item, Finished):
                    if text_open:
                        yield event({"type": "content_block_stop", "index": index})
                    yield event({"type": "message_delta",
                                 "delta": {"stop_reason": stop_reason_of(item), "stop_sequence": item.stop_sequence},
                                 "usage": usage_of(item, pinned)})
                    yield event({"type": "message_stop"})
                    self.openai.finish(body, session_id)
        except APIError as exc:
            yield event(error_body(exc.status_code, exc.message))
