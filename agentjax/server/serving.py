"""The OpenAI chat and text completion handlers, and vLLM's `/tokenize` and `/detokenize`.

Turns validated schemas into token ids, `SamplingParams`, a session id and `AgentHints`, queues
them on the shared `ChatPath` (chat requests through the template and tool parser, text
completions as plain text runs), and streams or collects the `ChatRun` events. A request whose
client goes away is aborted, so its pages return to the pool. Never touches the engine directly:
everything goes through `AsyncEngine`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from agentjax.sampling_params import SamplingParams
from agentjax.scheduler.request import AgentHints
from agentjax.server.async_engine import AsyncEngine
from agentjax.logprobs import cumulative_logprob
from agentjax.server.chat_path import ChatInput, ChatPath, ChatResult, ChatRun, ToolChoice
from agentjax.server.errors import APIError, ModelNotFoundError
from agentjax.server.protocol import (
    AgentHintsModel,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    NamedToolChoice,
    ResponseFormat,
    SamplingFields,
    TokenizeRequest,
)
from agentjax.server.openai_logprobs import (
    CompletionLogprobs,
    TokenTexts,
    chat_logprobs,
    join_completion_logprobs,
    prompt_logprobs_json,
)
from agentjax.server.openai_stream import ChatStream, CompletionStream, error_info, sse, usage_of  # noqa: F401
from agentjax.server.tenancy import tenant_of
from agentjax.server.text import chat_messages
from agentjax.server.tool_parsers import ToolCall
from agentjax.structured.spec import StructuredOutput

logger = logging.getLogger(__name__)

SESSION_HEADERS = ("x-session-id", "x-correlation-id")
_HINT_FIELDS = {f.name for f in dataclasses.fields(AgentHints)}


def session_id_from(body_id: str | None, hints: AgentHintsModel | None, request: Request) -> str | None:
    """The request's session id: the API's own body field, then `agent_hints.session_id`, then the
    first session header present; within the caller's namespace (tenants' sessions never meet)."""
    return tenant_of(request.scope).session(_named_session(body_id, hints, request))


def _named_session(body_id: str | None, hints: AgentHintsModel | None, request: Request) -> str | None:
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
    """Bounds on what one request may ask for. `max_tokens_limit` is the operator's cap on output
    budgets (None: only the context left after the prompt bounds them, as in vLLM);
    `default_max_tokens` the budget of a request that sets none (None: the context left)."""

    max_tokens_limit: int | None = None
    default_max_tokens: int | None = None
    max_request_body_bytes: int = 8 * 2**20
    max_queued_requests: int = 256


class AbortOnCloseStreamingResponse(StreamingResponse):
    """A streaming response that runs `on_close` however it ends: finished, failed or disconnected.
    A stream its client left before the end counts in the app's `agentjax:request_errors{status="499"}`,
    as a non-streamed request whose client left does."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        self.ended = False  # the content ran to its end (or failed): not a dropped stream
        super().__init__(self._watched(content), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def _watched(self, content: AsyncIterator[str]) -> AsyncIterator[str]:
        try:
            async for chunk in content:
                yield chunk
        except Exception:
            self.ended = True
            raise
        self.ended = True

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            metrics = getattr(getattr(scope.get("app"), "state", None), "metrics", None)
            if not self.ended and metrics is not None:
                metrics.request_errors.labels(status="499").inc()
            self.on_close()


class OpenAIServing:
    """Serves `/v1/chat/completions`, `/v1/completions`, `/tokenize` and `/detokenize` on one
    `AsyncEngine`."""

    def __init__(self, engine: AsyncEngine, tokenizer, model_name: str, limits: ServerLimits,
                 model_aliases: tuple[str, ...] = (), chat_path: ChatPath | None = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.chat_path = chat_path or ChatPath(engine, tokenizer, max_tokens_limit=limits.max_tokens_limit,
                                               default_max_tokens=limits.default_max_tokens)
        self.model_name = model_name
        self.model_names = {model_name, *model_aliases}
        self.limits = limits

    # ---- shared preparation -----------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise ModelNotFoundError(f"model {model!r} does not exist; this server serves {self.model_name!r}",
                                     param="model", code="model_not_found")

    def check_request(self, body: SamplingFields) -> None:
        self.check_model(body.model)
        bad = [key for key in body.logit_bias or () if not key.isdigit()]
        if bad:
            raise APIError(f"logit_bias keys must be token ids (decimal strings), got {bad[0]!r}", param="logit_bias")

    def session_id_of(self, body: SamplingFields, request: Request) -> str | None:
        return session_id_from(body.session_id, body.agent_hints, request)

    def sampling_of(self, body: SamplingFields, requested: int | None, prompt_len: int,
                    param: str = "max_tokens", prompt_param: str = "messages") -> SamplingParams:
        max_tokens = self.chat_path.max_tokens_for(requested, prompt_len, param, prompt_param=prompt_param)
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
            n=body.n,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            logit_bias={int(token): value for token, value in body.logit_bias.items()} if body.logit_bias else None,
            prompt_logprobs=body.prompt_logprobs,
        )

    def engine_kwargs_of(self, body, session_id: str | None, request: Request) -> dict:
        """Session, priority, hints and cache salt for `Engine.add_request` (any API's body with
        `agent_hints`, `priority` and `cache_salt` fields); the salt carries the caller's cache
        namespace (`agentjax.server.tenancy`), so it reads and writes only its own cached pages."""
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
        salt = tenant_of(request.scope).salt(body.cache_salt)
        if salt is not None:
            kwargs["cache_salt"] = salt
        return kwargs

    def finish(self, body, session_id: str | None) -> None:
        """After the last output: a `session_end` hint releases the session's pins."""
        if session_id and body.agent_hints is not None and body.agent_hints.session_end:
            self.engine.end_session(session_id)

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

    def _chat_prompt(self, body: ChatCompletionRequest) -> tuple[ChatInput, list[int]]:
        chat = self.chat_input_of(body)
        self.chat_path.check_tools(chat)
        return chat, self.chat_path.prompt_ids(chat)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_request(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
        chat, prompt = await self.chat_path.off_loop(self._chat_prompt, body)
        if body.max_completion_tokens is not None:
            sampling = self.sampling_of(body, body.max_completion_tokens, len(prompt), "max_completion_tokens")
        else:
            sampling = self.sampling_of(body, body.max_tokens, len(prompt))
        if body.logprobs:
            sampling = dataclasses.replace(sampling, logprobs=body.top_logprobs or 0)
        session_id = self.session_id_of(body, request)
        runs = await self.chat_path.start_samples(chat, sampling, prompt,
                                                  **self.engine_kwargs_of(body, session_id, request))
        for run in runs:
            run.report_usage_to(request)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        texts = TokenTexts(self.tokenizer)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = ChatStream(self.model_name, response_id, texts, include_usage,
                                lambda: self.finish(body, session_id))
            return AbortOnCloseStreamingResponse(stream.events(runs, body.prompt_logprobs is not None),
                                                 lambda: _abort(runs))
        results = await _collect(runs, request)
        self.finish(body, session_id)
        choices = []
        for index, result in enumerate(results):
            message = {"role": "assistant", "content": result.text if result.text or not result.tool_calls else None}
            if result.tool_calls:
                message["tool_calls"] = [_tool_call_json(call) for call in result.tool_calls]
            logprobs = {"content": chat_logprobs(result.logprobs, texts)} if result.logprobs is not None else None
            choices.append({"index": index, "message": message, "finish_reason": result.finished.finish_reason,
                            "logprobs": logprobs, **({"token_ids": result.token_ids} if body.return_token_ids else {})})
        first = results[0].finished
        reply = {"id": response_id, "object": "chat.completion", "created": _now(), "model": self.model_name,
                 "choices": choices,
                 "usage": usage_of(first.prompt_tokens, sum(r.finished.completion_tokens for r in results),
                                   first.cached_tokens)}
        if body.prompt_logprobs is not None:
            reply["prompt_logprobs"] = prompt_logprobs_json(first.prompt_logprobs, texts)
        if body.return_token_ids:
            reply["prompt_token_ids"] = list(prompt)
        return JSONResponse(reply)

    # ---- text completions ---------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self.check_request(body)
        if body.suffix:
            raise APIError("suffix is not supported", param="suffix")
        prompts = await self.chat_path.off_loop(self._prompts_of, body.prompt)
        if body.stream and len(prompts) > 1:
            raise APIError("a streaming completion takes one prompt; got a list of "
                           f"{len(prompts)}", param="prompt")
        best_of = body.best_of if body.best_of is not None and body.best_of != body.n else None
        if best_of is not None and best_of < body.n:
            raise APIError(f"best_of={best_of} must be >= n={body.n}", param="best_of")
        if best_of is not None and body.stream:
            raise APIError("best_of > n cannot be streamed (the best samples are known only at the end)",
                           param="best_of")
        session_id = self.session_id_of(body, request)
        kwargs = self.engine_kwargs_of(body, session_id, request)
        samplings = [self._completion_sampling(body, len(p), best_of) for p in prompts]
        groups: list[list[ChatRun]] = []
        try:
            for prompt, sampling in zip(prompts, samplings):
                groups.append(await self.chat_path.start_samples(None, sampling, prompt, **kwargs))
                for run in groups[-1]:
                    run.report_usage_to(request)
        except BaseException:
            _abort([run for group in groups for run in group])
            raise
        response_id = f"cmpl-{uuid.uuid4().hex}"
        texts = TokenTexts(self.tokenizer)
        echoes = await self.chat_path.off_loop(lambda: [self.tokenizer.decode(p) if body.echo else "" for p in prompts])
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = CompletionStream(self.model_name, response_id, texts, include_usage,
                                      lambda: self.finish(body, session_id))
            events = stream.events(groups[0], prompts[0], echoes[0], body.logprobs is not None,
                                   body.prompt_logprobs is not None)
            return AbortOnCloseStreamingResponse(events, lambda: _abort(groups[0]))
        results = await _collect([run for group in groups for run in group], request)
        self.finish(body, session_id)
        choices, prompt_tokens, completion_tokens, cached_tokens, at = [], 0, 0, 0, 0
        for prompt, echo, group in zip(prompts, echoes, groups):
            samples = results[at:at + len(group)]
            at += len(group)
            first = samples[0].finished
            prompt_tokens += first.prompt_tokens
            cached_tokens += first.cached_tokens
            completion_tokens += sum(r.finished.completion_tokens for r in samples)
            if len(samples) > body.n:  # best_of: the n samples of highest cumulative log probability
                samples = sorted(samples, key=lambda r: -cumulative_logprob(r.logprobs))[:body.n]
            for result in samples:
                choice = {"index": len(choices), "text": echo + result.text,
                          "finish_reason": result.finished.finish_reason, "logprobs": None}
                if body.logprobs is not None:
                    builder = CompletionLogprobs(texts)
                    parts = [builder.chunk(first.prompt_logprobs, prompt)] if body.echo else []
                    choice["logprobs"] = join_completion_logprobs([*parts, builder.chunk(result.logprobs)])
                if body.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(first.prompt_logprobs, texts)
                if body.return_token_ids:
                    choice.update(prompt_token_ids=list(prompt), token_ids=result.token_ids)
                choices.append(choice)
        return JSONResponse({"id": response_id, "object": "text_completion", "created": _now(),
                             "model": self.model_name, "choices": choices,
                             "usage": usage_of(prompt_tokens, completion_tokens, cached_tokens)})

    def _completion_sampling(self, body: CompletionRequest, prompt_len: int, best_of: int | None) -> SamplingParams:
        """The request's settings; best_of needs each sample's log probabilities to rank them, and echo
        with logprobs needs the prompt's."""
        sampling = self.sampling_of(body, body.max_tokens, prompt_len, prompt_param="prompt")
        logprobs = body.logprobs if body.logprobs is not None else (0 if best_of is not None else None)
        prompt_logprobs = body.prompt_logprobs
        if body.echo and body.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, body.logprobs)
        return dataclasses.replace(sampling, best_of=best_of, logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    def _prompts_of(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self.chat_path.text_ids(prompt)]
        if prompt and isinstance(prompt[0], int):
            return [list(prompt)]
        return [self.chat_path.text_ids(p) if isinstance(p, str) else list(p) for p in prompt]

    # ---- tokenizer routes (vLLM's extension) ----------------------------------------------------
    async def tokenize(self, body: TokenizeRequest) -> dict:
        return await self.chat_path.off_loop(self._tokenize, body)

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        return await self.chat_path.off_loop(self._detokenize, body)

    def _tokenize(self, body: TokenizeRequest) -> dict:
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("send either prompt (text) or messages (a chat), not both or neither", param="prompt")
        if body.prompt is not None:
            tokens = self.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            tools = [tool.model_dump(exclude_none=True) for tool in body.tools or ()]
            chat = ChatInput(chat_messages(body.messages), tools)
            self.chat_path.check_tools(chat)
            tokens = self.chat_path.prompt_ids(chat, add_generation_prompt=body.add_generation_prompt, bounded=False)
        strs = [self.tokenizer.decode([t], skip_special_tokens=False) for t in tokens] if body.return_token_strs else None
        return {"count": len(tokens), "max_model_len": self.engine.max_model_len, "tokens": tokens,
                "token_strs": strs}

    def _detokenize(self, body: DetokenizeRequest) -> dict:
        self.check_model(body.model)
        vocab = getattr(self.tokenizer, "vocab_size", None)
        if isinstance(vocab, int):
            bad = [t for t in body.tokens if t >= vocab]
            if bad:
                raise APIError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}


def _now() -> int:
    return int(time.time())


def _abort(runs: list[ChatRun]) -> None:
    for run in runs:
        run.abort()


async def _collect(runs: list[ChatRun], request: Request) -> list[ChatResult]:
    """Every run's result; if one fails, the others are aborted too."""
    try:
        return list(await asyncio.gather(*(run.collect(request) for run in runs)))
    except BaseException:
        _abort(runs)
        raise


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
