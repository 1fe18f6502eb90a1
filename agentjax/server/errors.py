"""Errors the HTTP layer raises on purpose, each with its status code and OpenAI error type.

They subclass `agentjax.errors.AgentjaxError`, so the same catch-all works everywhere; the
mapping from engine errors to HTTP statuses lives in `app.py`. Never imports jax.
"""
from __future__ import annotations

from agentjax.errors import AgentjaxError


class APIError(AgentjaxError):
    """An error that becomes an OpenAI-style error body with this status."""

    status_code = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class AuthenticationError(APIError):
    status_code = 401
    error_type = "authentication_error"


class ModelNotFoundError(APIError):
    status_code = 404
    error_type = "invalid_request_error"


class NotFoundError(APIError):
    """Something the request names (a stored response) does not exist."""

    status_code = 404
    error_type = "invalid_request_error"


class RequestTooLargeError(APIError):
    status_code = 413
    error_type = "invalid_request_error"


class ServerOverloadedError(APIError):
    """More requests are queued or running than the server's bound (`--max-queued-requests`)."""

    status_code = 429
    error_type = "rate_limit_error"


class ClientDisconnectedError(APIError):
    """The client went away before its reply was ready (nginx's 499); nobody reads this answer."""

    status_code = 499
    error_type = "client_closed_request"


class EngineFailedError(APIError):
    """The engine's step raised; the requests in flight at that moment are failed."""

    status_code = 500
    error_type = "server_error"


class ServerShuttingDownError(APIError):
    """The server is stopping and its graceful-shutdown time is up: the reply ends here (retry elsewhere)."""

    status_code = 503
    error_type = "service_unavailable"


class KVTierUnavailableError(APIError):
    """A KV transfer a router asked for cannot be made: the shared tier is out of use or too slow."""

    status_code = 503
    error_type = "service_unavailable"
