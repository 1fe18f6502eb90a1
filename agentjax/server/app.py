"""The FastAPI app: routes, the auth and body-size guard, and OpenAI- or Anthropic-shaped errors.

`create_app(engine, tokenizer, ...)` wraps an `Engine` (or anything with its interface) in an
`AsyncEngine` whose thread starts and stops with the app's lifespan. Every failure a client can
cause becomes a 4xx with `{"error": {"message", "type", "param", "code"}}`, or on `/v1/messages*`
Anthropic's `{"type": "error", "error": {"type", "message"}}`; nothing it sends should produce a
5xx. Never imports jax.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from agentjax.errors import InvalidRequestError, OutOfPagesError, PromptTooLongError, TokenizerError
from agentjax.server import anthropic_protocol as anthropic
from agentjax.server.anthropic_serving import AnthropicServing
from agentjax.server.async_engine import AsyncEngine
from agentjax.server.chat_path import ChatPath
from agentjax.server.chat_run import USAGE_SCOPE_KEY
from agentjax.server.responses_protocol import ResponseObject, ResponsesRequest
from agentjax.server.responses_serving import ResponsesServing
from agentjax.server.tool_parsers import DEFAULT_TOOL_PARSER
from agentjax.server.edge import EdgeRoute
from agentjax.server.errors import APIError
from agentjax.server.guard import RequestGuardMiddleware
from agentjax.server.kv_transfer import install_kv_transfer_routes
from agentjax.server.kv_view import attach_kv_event_log, install_kv_routes
from agentjax.server.metrics import ServerMetrics
from agentjax.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from agentjax.server.serving import OpenAIServing, ServerLimits
from agentjax.server.tenancy import KeyRing
from agentjax.server.worker_pool import WorkerPool

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("agentjax.server.access")

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429)
}
_ANTHROPIC_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": anthropic.AnthropicErrorResponse} for status in (400, 401, 404, 413, 429)
}


def error_response(status: int, message: str, error_type: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None, path: str = "") -> JSONResponse:
    """The error body the route at `path` speaks: Anthropic's on /v1/messages*, else OpenAI's."""
    if anthropic.is_messages_path(path):
        return JSONResponse(anthropic.error_body(status, message), status_code=status)
    return JSONResponse({"error": {"message": message, "type": error_type, "param": param, "code": code}},
                        status_code=status)


class AccessLogMiddleware:
    """Pure ASGI: one INFO line per HTTP request once its response has ended (streams included):
    method, path, status, seconds, and the reply's token counts when it ran on the engine. A request
    uvicorn cancels at the end of its graceful shutdown ends here, its response closed, with one
    WARNING line instead of a CancelledError traceback."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        usage: dict = {}
        scope[USAGE_SCOPE_KEY] = usage
        status = 500
        started = time.perf_counter()
        response_started = False

        async def recording_send(message):
            nonlocal status, response_started
            if message["type"] == "http.response.start":
                status, response_started = message["status"], True
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        except asyncio.CancelledError:
            if not getattr(getattr(scope.get("app"), "state", None), "shutting_down", False):
                raise  # a client that left (some servers cancel its task): not ours to end
            access_logger.warning("%s %s cancelled: the graceful shutdown's time is up", scope.get("method"),
                                  scope.get("path"))
            with contextlib.suppress(Exception):
                if response_started:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                else:
                    status = 503
                    await error_response(503, "the server is shutting down", "service_unavailable",
                                         code="shutting_down", path=scope.get("path", ""))(scope, receive, send)
        finally:
            counts = "".join(f" {key}={value}" for key, value in usage.items())
            access_logger.info("%s %s %d %.3fs%s", scope.get("method"), scope.get("path"), status,
                               time.perf_counter() - started, counts)


# The body field that carries the prompt, by route (errors about the prompt name it as `param`).
PROMPT_PARAMS = {"/v1/chat/completions": "messages", "/v1/completions": "prompt", "/v1/responses": "input",
                 "/v1/messages": "messages", "/v1/messages/count_tokens": "messages"}


def prompt_param(path: str) -> str | None:
    """`messages` on chat routes, `prompt` on /v1/completions, `input` on /v1/responses; None elsewhere."""
    return PROMPT_PARAMS.get(path)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "the request is invalid", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"the request body is not valid JSON: {detail}".rstrip(": "), None
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    if not location:
        return f"the request body is invalid: {first.get('msg')}", None
    param = ".".join(location)
    message = f"{param}: {first.get('msg')}"
    if "input" in first and first["type"] not in ("missing",):
        shown = repr(first["input"])
        message += f" (got {shown[:80]}{'...' if len(shown) > 80 else ''})"
    if len(errors) > 1:
        message += f"; and {len(errors) - 1} more problem(s)"
    return message, param


def _install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    def failed(request: Request, status: int, *args, **kwargs) -> JSONResponse:
        metrics.request_errors.labels(status=str(status)).inc()
        return error_response(status, *args, path=request.url.path, **kwargs)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return failed(request, exc.status_code, exc.message, exc.error_type, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        if anthropic.is_messages_path(request.url.path):
            return failed(request, 400, anthropic.validation_message(list(exc.errors())))
        message, param = _validation_message(exc)
        return failed(request, 400, message, param=param, code="invalid_request")

    @app.exception_handler(PromptTooLongError)
    async def prompt_too_long(request: Request, exc: PromptTooLongError):
        return failed(request, 400, str(exc), param=prompt_param(request.url.path), code="context_length_exceeded")

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(request: Request, exc: InvalidRequestError):
        return failed(request, 400, str(exc), code="invalid_request")

    @app.exception_handler(TokenizerError)
    async def tokenizer_error(request: Request, exc: TokenizerError):
        return failed(request, 400, str(exc), param=prompt_param(request.url.path), code="invalid_prompt")

    @app.exception_handler(OutOfPagesError)
    async def out_of_pages(request: Request, exc: OutOfPagesError):
        param = prompt_param(request.url.path) if exc.cause == "prompt" else "max_tokens"
        return failed(request, 400, str(exc), param=param, code="kv_pool_too_small")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        return failed(request, exc.status_code, str(exc.detail), code=code)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        logger.exception("unexpected error while serving a request")
        return failed(request, 500, f"internal error: {type(exc).__name__}", "server_error", code="internal_error")


def create_app(engine: Any, tokenizer: Any, *, model_name: str, model_aliases: tuple[str, ...] = (),
               api_key: str | None = None, keys: KeyRing | None = None, metrics_without_key: bool = False,
               limits: ServerLimits = ServerLimits(),
               tool_call_parser: str = DEFAULT_TOOL_PARSER) -> FastAPI:  # noqa: PLR0915 (one route each)
    """The app; the engine thread runs while the app's lifespan does. `keys` (or one `api_key`) are the
    keys it accepts (`agentjax.server.tenancy`; none: open); `tool_call_parser` names how tool calls are
    read from replies (`agentjax.server.tool_parsers`)."""
    keys = keys if keys is not None else KeyRing.build([api_key] if api_key else [])
    async_engine = AsyncEngine(engine, max_queued_requests=limits.max_queued_requests)
    metrics = ServerMetrics(lambda: async_engine.stats, lambda: async_engine.num_in_flight)
    async_engine.on_output = metrics.observe_output
    workers = WorkerPool()
    chat_path = ChatPath(async_engine, tokenizer, max_tokens_limit=limits.max_tokens_limit,
                         default_max_tokens=limits.default_max_tokens,
                         tool_parser=tool_call_parser, workers=workers)
    serving = OpenAIServing(async_engine, tokenizer, model_name, limits, model_aliases, chat_path)
    messages_serving = AnthropicServing(serving)
    responses_serving = ResponsesServing(serving)
    kv_event_log = attach_kv_event_log(async_engine)  # for routers: GET /kv/events

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        async_engine.start()
        logger.info("serving %s", model_name)
        try:
            yield
        finally:
            async_engine.stop()
            workers.shutdown()

    app = FastAPI(title="agentjax", summary="OpenAI-compatible server for agentic LLM traffic",
                  lifespan=lifespan)
    app.router.route_class = EdgeRoute  # every JSON body is parsed and its text checked once (edge.py)
    started = int(time.time())
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.state.keys = keys
    app.add_middleware(RequestGuardMiddleware, keys=keys, max_body_bytes=limits.max_request_body_bytes,
                       error_response=error_response, metrics_without_key=metrics_without_key)
    app.add_middleware(AccessLogMiddleware)  # added last: the outermost, so it sees 401s and 413s too
    _install_error_handlers(app, metrics)

    @app.post("/v1/chat/completions", responses=_ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """An assistant reply to `messages` (OpenAI chat completions; `stream` for server-sent events)."""
        return await serving.chat(body, request)

    @app.post("/v1/completions", responses=_ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """A continuation of `prompt` (text, token ids, or a list of either)."""
        return await serving.completions(body, request)

    @app.post("/v1/responses", response_model=ResponseObject, responses=_ERROR_RESPONSES)
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        """A model response to `input` (OpenAI Responses API; `stream` for server-sent events)."""
        return await responses_serving.create(body, request)

    @app.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=_ERROR_RESPONSES)
    async def get_response(response_id: str, request: Request) -> Response:
        """A stored response (kept in memory, a bounded number of the most recent)."""
        return responses_serving.retrieve(response_id, request)

    @app.post("/v1/messages", responses=_ANTHROPIC_ERROR_RESPONSES)
    async def messages(body: anthropic.MessagesRequest, request: Request) -> Response:
        """An assistant reply to `messages` (Anthropic Messages API; `stream` for server-sent events)."""
        return await messages_serving.messages(body, request)

    @app.post("/v1/messages/count_tokens", response_model=anthropic.CountTokensResponse,
              responses=_ANTHROPIC_ERROR_RESPONSES)
    async def count_tokens(body: anthropic.CountTokensRequest) -> Response:
        """How many prompt tokens the same request to `/v1/messages` would have."""
        return await messages_serving.count_tokens(body)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERROR_RESPONSES)
    async def tokenize(body: TokenizeRequest) -> dict:
        """vLLM's extension: the token ids of a text `prompt`, or of `messages` through the chat template."""
        return await serving.tokenize(body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest) -> dict:
        """vLLM's extension: the text of `tokens`."""
        return await serving.detokenize(body)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": started,
                                            "owned_by": "agentjax", "max_model_len": async_engine.max_model_len}]}

    install_kv_routes(app, kv_event_log, serving, messages_serving, responses_serving)
    install_kv_transfer_routes(app, async_engine, serving, messages_serving, responses_serving)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if not async_engine.is_running:
            return error_response(503, "the engine thread is not running", "server_error", code="unhealthy")
        return JSONResponse({"status": "ok"})

    @app.api_route("/metrics", methods=["GET", "HEAD"])  # scrapers probe with HEAD first (AgentX's does)
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
