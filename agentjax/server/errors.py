"""Errors the HTTP layer raises on purpose, each with its status code and OpenAI error type.

They subclass `agentjax.errors.AgentjaxError`, so the same catch-all works everywhere; the
mapping from engine errors to HTTP statuses lives in `app.py`. Never imports jax.
"""
from __future__ import annotations

from agentjax.errors import AgentjaxError


class APIError(AgentjaxError):
    """An error that becomes an OpenAI-style error body with this status. A subclass names its own
    status and type in its header: `class X(APIError, status_code=404)` (unnamed ones are inherited)."""

    status_code = 400
    error_type = "invalid_request_error"

    def __init_subclass__(cls, *, status_code: int | None = None, error_type: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if status_code is not None:
            cls.status_code = status_code
        if error_type is not None:
            cls.error_type = error_type

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class AuthenticationError(APIError, status_code=401, error_type="authentication_error"):
    """The request's API key is missing or not one the server accepts."""


class ModelNotFoundError(APIError, status_code=404):
    """The request names a model this server does not serve."""


class NotFoundError(APIError, status_code=404):
    """Something the request names (a stored response) does not exist."""


class RequestTooLargeError(APIError, status_code=413):
    """The request's body is larger than the server accepts."""


class ServerOverloadedError(APIError, status_code=429, error_type="rate_limit_error"):
    """More requests are queued or running than the server's bound (`--max-queued-requests`)."""


class ClientDisconnectedError(APIError, status_code=499, error_type="client_closed_request"):
    """The client went away before its reply was ready (nginx's 499); nobody reads this answer."""


class EngineFailedError(APIError, status_code=500, error_type="server_error"):
    """The engine's step raised; the requests in flight at that moment are failed."""


class ServerShuttingDownError(APIError, status_code=503, error_type="service_unavailable"):
    """The server is stopping and its graceful-shutdown time is up: the reply ends here (retry elsewhere)."""


class KVTierUnavailableError(APIError, status_code=503, error_type="service_unavailable"):
    """A KV transfer a router asked for cannot be made: the shared tier is out of use or too slow."""
