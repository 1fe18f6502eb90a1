"""The Responses API handler: `POST /v1/responses` (JSON or server-sent events) and
`GET /v1/responses/{id}`.

A request converts to the shared `ChatInput` (`responses_convert`) and runs on the same
`ChatPath`, session, hint and metrics handling as the other routes. `OutputBuilder` turns the
run's events into output items (an assistant `message` with `output_text`, `function_call` items
whose arguments stream as they decode) and into the Responses event sequence, so a streamed
reply always reassembles to the non-streamed one. Asked for `message.output_text.logprobs`, text
deltas carry their tokens' log probabilities (tokens of tool calls go to the next text). A stored
response (`store`, the default) can be continued with `previous_response_id`; the chain runs in
one session, so its pages stay pinned between turns. `prompt_cache_key` is the session id. Never touches the engine directly.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentjax.sampling_params import SamplingParams
from agentjax.server.chat_path import (
    ChatInput,
    ChatRun,
    Finished,
    LogprobsDelta,
    TextDelta,
    ToolCallArguments,
    ToolCallDelta,
    ToolCallStarted,
)
from agentjax.server.errors import APIError, NotFoundError
from agentjax.server.openai_logprobs import TokenTexts, chat_logprobs
from agentjax.server.responses_convert import ResponseStore, StoredResponse, chat_input_of, conversation_size
from agentjax.server.responses_protocol import ResponsesRequest
from agentjax.server.serving import AbortOnCloseStreamingResponse, OpenAIServing, session_id_from
from agentjax.server.tenancy import tenant_of


LOGPROBS_INCLUDE = "message.output_text.logprobs"


def sse(payload: dict) -> str:
    """One server-sent event, named by its type as OpenAI's Responses stream names them."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


def usage_of(finished: Finished) -> dict:
    return {"input_tokens": finished.prompt_tokens,
            "input_tokens_details": {"cached_tokens": max(0, finished.cached_tokens), "cache_write_tokens": 0},
            "output_tokens": finished.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": finished.prompt_tokens + finished.completion_tokens}


class OutputBuilder:
    """Output items and Responses stream events from `ChatRun` events.

    A message item opens at the first text that is more than whitespace and closes when a call
    starts or the reply ends; each call is a `function_call` item.
    """

    def __init__(self, texts: TokenTexts | None = None):
        self.texts = texts
        self.logprobs: list = []  # log probabilities not yet attached to text
        self.output: list[dict] = []
        self.sequence = 0
        self.message: dict | None = None  # the open message item
        self.held = ""  # leading whitespace not yet in a message
        self.calls: dict[int, dict] = {}  # call index -> its open function_call item

    def event(self, kind: str, **fields: Any) -> dict:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return payload

    def feed(self, item) -> list[dict]:
        """The stream events for one `ChatRun` event (the final `Finished` closes what is open)."""
        if isinstance(item, LogprobsDelta):
            self.logprobs.extend(item.entries)
            return []
        if isinstance(item, TextDelta):
            return self._text(item.text)
        if isinstance(item, ToolCallStarted):
            events = self._close_message()
            call = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": item.id,
                    "name": item.name, "arguments": "", "status": "in_progress"}
            self.calls[item.index] = call
            self.output.append(call)
            return [*events, self.event("response.output_item.added", output_index=len(self.output) - 1,
                                        item=dict(call))]
        if isinstance(item, ToolCallArguments):
            call = self.calls[item.index]
            call["arguments"] += item.text
            return [self.event("response.function_call_arguments.delta", item_id=call["id"],
                               output_index=self.output.index(call), delta=item.text)]
        if isinstance(item, ToolCallDelta):
            call = self.calls.pop(item.index)
            call["status"] = "completed"
            index = self.output.index(call)
            return [self.event("response.function_call_arguments.done", item_id=call["id"], output_index=index,
                               name=call["name"], arguments=call["arguments"]),
                    self.event("response.output_item.done", output_index=index, item=dict(call))]
        return self._close_message()

    def _text(self, text: str) -> list[dict]:
        events = []
        if self.message is None:
            self.held += text
            if not self.held.strip():
                return []
            text, self.held = self.held, ""
            self.message = {"type": "message", "id": f"msg_{uuid.uuid4().hex[:24]}", "status": "in_progress",
                            "role": "assistant", "content": []}
            self.output.append(self.message)
            index = len(self.output) - 1
            events.append(self.event("response.output_item.added", output_index=index, item=_copy(self.message)))
            self.message["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            events.append(self.event("response.content_part.added", item_id=self.message["id"], output_index=index,
                                     content_index=0, part=dict(self.message["content"][0])))
        part = self.message["content"][0]
        part["text"] += text
        logprobs = self._take_logprobs()
        part["logprobs"] += logprobs
        events.append(self.event("response.output_text.delta", item_id=self.message["id"],
                                 output_index=self.output.index(self.message), content_index=0, delta=text,
                                 logprobs=logprobs))
        return events

    def _take_logprobs(self) -> list[dict]:
        entries, self.logprobs = self.logprobs, []
        return chat_logprobs(entries, self.texts) if entries and self.texts is not None else []

    def _close_message(self) -> list[dict]:
        self.held = ""
        message, self.message = self.message, None
        if message is None:
            return []
        index = self.output.index(message)
        part = message["content"][0]
        part["logprobs"] += self._take_logprobs()  # the reply's last tokens, if their text was held back
        message["status"] = "completed"
        return [self.event("response.output_text.done", item_id=message["id"], output_index=index, content_index=0,
                           text=part["text"], logprobs=part["logprobs"]),
                self.event("response.content_part.done", item_id=message["id"], output_index=index,
                           content_index=0, part=dict(part)),
                self.event("response.output_item.done", output_index=index, item=_copy(message))]

    def assistant_message(self) -> dict:
        """The reply as a chat message, for the stored conversation."""
        text = "".join(item["content"][0]["text"] for item in self.output if item["type"] == "message")
        calls = [{"id": item["call_id"], "type": "function",
                  "function": {"name": item["name"], "arguments": item["arguments"]}}
                 for item in self.output if item["type"] == "function_call"]
        return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}


def _copy(item: dict) -> dict:
    return json.loads(json.dumps(item))


class ResponsesServing:
    """Serves `/v1/responses` beside an `OpenAIServing`, with an in-memory store of responses."""

    def __init__(self, openai: OpenAIServing, store: ResponseStore | None = None):
        self.openai = openai
        self.chat_path = openai.chat_path
        self.store = store or ResponseStore()

    def retrieve(self, response_id: str, request: Request) -> Response:
        stored = self.store.get(response_id, tenant_of(request.scope).namespace)
        if stored is None:
            raise NotFoundError(f"Response with id {response_id!r} not found.", param="response_id",
                                code="response_not_found")
        return JSONResponse(stored.response)

    async def create(self, body: ResponsesRequest, request: Request) -> Response:
        self.openai.check_model(body.model)
        previous = None
        if body.previous_response_id is not None:
            previous = self.store.get(body.previous_response_id, tenant_of(request.scope).namespace)
            if previous is None:
                raise NotFoundError(f"Previous response with id {body.previous_response_id!r} not found.",
                                    param="previous_response_id", code="previous_response_not_found")
        chat, conversation, prompt = await self.chat_path.off_loop(self._prepare, body, previous)
        sampling = self.sampling_of(body, len(prompt))
        response_id = f"resp_{uuid.uuid4().hex}"
        session_id = self._session_id(body, request, previous, response_id)
        run = await self.chat_path.start(chat, sampling, prompt,
                                         **self.openai.engine_kwargs_of(body, session_id, request))
        run.report_usage_to(request)
        shell = self._shell(body, response_id)
        if body.stream:
            events = self._events(run, body, shell, conversation, session_id, tenant_of(request.scope).namespace)
            return AbortOnCloseStreamingResponse(events, run.abort)
        builder = OutputBuilder(self._texts(body))
        result = await run.collect(request)
        for part in result.parts:
            if isinstance(part, ToolCallDelta):
                builder.feed(ToolCallStarted(part.index, part.call.id, part.call.name))
                builder.feed(ToolCallArguments(part.index, part.call.arguments))
            builder.feed(part)
        builder.feed(result.finished)
        response = self._finish(shell, builder, result.finished, body, conversation, session_id,
                                tenant_of(request.scope).namespace)
        return JSONResponse(response)

    def _prepare(self, body: ResponsesRequest, previous: StoredResponse | None) -> tuple[ChatInput, list[dict], list[int]]:
        chat, conversation = chat_input_of(body, previous.messages if previous is not None else [])
        self.chat_path.check_tools(chat)
        return chat, conversation, self.chat_path.prompt_ids(chat, prompt_param="input")

    def sampling_of(self, body: ResponsesRequest, prompt_len: int) -> SamplingParams:
        max_tokens = self.chat_path.max_tokens_for(body.max_output_tokens, prompt_len, "max_output_tokens",
                                                   prompt_param="input")
        return SamplingParams(max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
                              top_p=1.0 if body.top_p is None else body.top_p,
                              logprobs=(body.top_logprobs or 0) if self._wants_logprobs(body) else None)

    @staticmethod
    def _wants_logprobs(body: ResponsesRequest) -> bool:
        return LOGPROBS_INCLUDE in (body.include or ())

    def _texts(self, body: ResponsesRequest) -> TokenTexts | None:
        return TokenTexts(self.openai.tokenizer) if self._wants_logprobs(body) else None

    def _session_id(self, body: ResponsesRequest, request: Request, previous: StoredResponse | None,
                    response_id: str) -> str:
        """`prompt_cache_key` (Codex sends one per conversation), a hint or header, else the chain's."""
        key = body.prompt_cache_key[:256] if body.prompt_cache_key else None
        named = session_id_from(key, body.agent_hints, request)
        if named:
            return named
        return previous.session_id if previous is not None else f"session-{response_id}"

    def _shell(self, body: ResponsesRequest, response_id: str) -> dict:
        fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format \
            else {"type": "text"}
        choice = body.tool_choice
        return {
            "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "error": None, "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "model": self.openai.model_name, "output": [],
            "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
            "prompt_cache_key": body.prompt_cache_key, "reasoning": body.reasoning, "store": body.store,
            "temperature": 1.0 if body.temperature is None else body.temperature, "text": {"format": fmt},
            "tool_choice": choice.model_dump() if hasattr(choice, "model_dump") else (choice or "auto"),
            "tools": list(body.tools or []), "top_p": 1.0 if body.top_p is None else body.top_p,
            "top_logprobs": body.top_logprobs,
            "truncation": "disabled", "usage": None, "user": body.user, "metadata": body.metadata or {},
        }

    def _finish(self, shell: dict, builder: OutputBuilder, finished: Finished, body: ResponsesRequest,
                conversation: list[dict], session_id: str, namespace: str | None) -> dict:
        response = {**shell, "output": builder.output, "usage": usage_of(finished)}
        if finished.finish_reason == "length":
            response["status"], response["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        else:
            response["status"] = "completed"
        if body.store:
            messages = [*conversation, builder.assistant_message()]
            self.store.put(shell["id"], StoredResponse(messages, response, session_id, conversation_size(messages),
                                                       namespace))
        self.openai.finish(body, session_id)
        return response

    async def _events(self, run: ChatRun, body: ResponsesRequest, shell: dict, conversation: list[dict],
                      session_id: str, namespace: str | None) -> AsyncIterator[str]:
        builder = OutputBuilder(self._texts(body))
        yield sse(builder.event("response.created", response=shell))
        yield sse(builder.event("response.in_progress", response=shell))
        try:
            async for item in run.events():
                for payload in builder.feed(item):
                    yield sse(payload)
                if isinstance(item, Finished):
                    response = self._finish(shell, builder, item, body, conversation, session_id, namespace)
                    kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
                    yield sse(builder.event(kind, response=response))
        except APIError as exc:
            yield sse(builder.event("error", code=exc.code, message=exc.message, param=exc.param))
            failed = {**shell, "status": "failed", "output": builder.output,
                      "error": {"code": exc.code or "server_error", "message": exc.message}}
            yield sse(builder.event("response.failed", response=failed))
