"""The request guard: API keys on every route, operator keys on the cache-revealing ones, body size caps.

Pure ASGI, in front of every route (so a route added later is covered without a line here). With
keys set, only `/health` (and `/metrics` under `--metrics-without-key`) answers without one; the
routes that reveal what other tenants cached (`/kv/events`, `/kv/prompt_hashes`) and `/metrics` need an
operator key. The caller's `Tenant` goes into the ASGI scope for the handlers. A body over the cap
is refused from its `Content-Length` before it is read, or as soon as its bytes pass the cap.
Never imports jax.
"""
from __future__ import annotations

import enum
from collections.abc import Callable

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from agentjax.server.tenancy import OPEN_TENANT, TENANT_SCOPE_KEY, KeyRing, presented_key

ALWAYS_OPEN_PATHS = frozenset({"/health"})
OPERATOR_PATHS = frozenset({"/kv/events", "/kv/prompt_hashes", "/metrics"})
METRICS_PATH = "/metrics"


class Access(enum.Enum):
    OPEN = "open"  # no key needed
    TENANT = "tenant"  # any key
    OPERATOR = "operator"  # an operator key


def route_access(path: str, metrics_without_key: bool = False) -> Access:
    """What a request for `path` needs when the server has keys."""
    if path in ALWAYS_OPEN_PATHS or (metrics_without_key and path == METRICS_PATH):
        return Access.OPEN
    return Access.OPERATOR if path in OPERATOR_PATHS else Access.TENANT


ErrorResponder = Callable[..., Response]  # app.error_response(status, message, type, param=, code=, path=)


class RequestGuardMiddleware:
    """See the module docstring. `error_response` builds the error body the route speaks."""

    def __init__(self, app, *, keys: KeyRing, max_body_bytes: int, error_response: ErrorResponder,
                 metrics_without_key: bool = False):
        self.app = app
        self.keys = keys
        self.max_body_bytes = max_body_bytes
        self.error_response = error_response
        self.metrics_without_key = metrics_without_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        path = scope["path"]
        refusal = self._authorize(scope, headers, path)
        if refusal is None:
            refusal = self._refuse_declared_size(headers, path)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        received = 0

        async def counting_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise StarletteHTTPException(413, self._too_large(received))
            return message

        await self.app(scope, counting_receive, send)

    def _authorize(self, scope, headers: dict[bytes, bytes], path: str) -> Response | None:
        """None when the request may go on (its tenant is then in the scope), else the refusal."""
        if not self.keys.enabled:
            scope[TENANT_SCOPE_KEY] = OPEN_TENANT
            return None
        access = route_access(path, self.metrics_without_key)
        if access is Access.OPEN:
            return None
        tenant = self.keys.tenant_for(presented_key(headers))
        if tenant is None:
            return self.error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>' or "
                                       "'x-api-key: <key>'", "authentication_error", code="invalid_api_key", path=path)
        if access is Access.OPERATOR and not tenant.operator:
            return self.error_response(403, f"{path} needs an operator key (--operator-key, or \"operator\": true "
                                       "in --api-keys-file)", "permission_error", code="operator_key_required",
                                       path=path)
        scope[TENANT_SCOPE_KEY] = tenant
        return None

    def _refuse_declared_size(self, headers: dict[bytes, bytes], path: str) -> Response | None:
        declared = headers.get(b"content-length")
        if declared is None:
            return None
        if not declared.isdigit():
            return self.error_response(400, f"Content-Length {declared.decode(errors='replace')!r} is not a "
                                       "number", path=path)
        if int(declared) > self.max_body_bytes:
            return self.error_response(413, self._too_large(int(declared)), code="request_too_large", path=path)
        return None

    def _too_large(self, size: int) -> str:
        return (f"request body of {size} bytes exceeds the limit of {self.max_body_bytes} bytes "
                f"(--max-request-body-bytes)")
