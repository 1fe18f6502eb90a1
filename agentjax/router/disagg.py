"""KV transfers the router asks replicas for: the P/D prefill step, and the flush and prefetch of a
session migration (both through a replica's `POST /kv/prefill` and `POST /kv/flush`).

P/D prefill: the prefill replica runs the prompt and answers once its pages are in Mooncake, named
by their chained block hashes (equal on every replica of the same model, page size and numerics);
the decode replica then finds them by those names when the request reaches it. Any failure is a
reason to serve the request whole on one replica, never an error for the client. Never imports jax.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import httpx

from agentjax.router.metrics import RouterMetrics
from agentjax.router.proxy import describe
from agentjax.router.replicas import Replica
from agentjax.router.routing_request import RoutingRequest

logger = logging.getLogger(__name__)

AUTH_HEADERS = ("authorization", "x-api-key")
DEGRADED_CODES = frozenset({"kv_tier_degraded", "kv_store_timeout"})


def auth_headers(headers: list[tuple[str, str]]) -> dict[str, str]:
    """The client's credentials, for the replica calls the router makes on its behalf."""
    return {name: value for name, value in headers if name.lower() in AUTH_HEADERS}


@dataclass
class Prefilled:
    """What a replica's `/kv/prefill` answered: the prompt's tokens and how many were cached there."""

    prompt_tokens: int
    cached_tokens: int


class KVTransferFailed(Exception):
    """A replica could not do a KV transfer; `reason` is a metric label."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class KVTransfers:
    """The replica calls behind P/D and migrations, on the router's shared client."""

    def __init__(self, client: httpx.AsyncClient, metrics: RouterMetrics, timeout_s: float = 120.0) -> None:
        self.client = client
        self.metrics = metrics
        self.timeout_s = timeout_s

    async def prefill(self, replica: Replica, routing: RoutingRequest, headers: list[tuple[str, str]], *,
                      store: bool, session_id: str | None = None) -> Prefilled:
        """`replica` makes the prompt of `routing` resident (`store`: and puts its pages in Mooncake);
        raises `KVTransferFailed`. Counted in the replica's in-flight load while it runs."""
        if routing.body is None:
            raise KVTransferFailed("unreadable_body", "the request body is not a JSON object")
        payload = {"path": routing.path, "body": routing.body, "store": store, "session_id": session_id}
        replica.in_flight += 1
        try:
            answer = await self.client.post(f"{replica.url}/kv/prefill", json=payload, headers=auth_headers(headers),
                                            timeout=self.timeout_s)
        except httpx.HTTPError as error:
            raise KVTransferFailed(_failure_reason(error), describe(error)) from None
        finally:
            replica.in_flight -= 1
        if answer.status_code != 200:
            code, message = _error_of(answer)
            if code in DEGRADED_CODES:
                replica.shared_tier_degraded = True  # until its next health check says otherwise
            raise KVTransferFailed(code or f"status_{answer.status_code}", f"{answer.status_code}: {message}")
        body = answer.json()
        return Prefilled(int(body.get("prompt_tokens", 0)), int(body.get("cached_tokens", 0)))

    async def flush(self, replica: Replica, headers: list[tuple[str, str]]) -> None:
        """Returns once the replica's ended turns have their pages in its tiers; raises `KVTransferFailed`."""
        try:
            answer = await self.client.post(f"{replica.url}/kv/flush", headers=auth_headers(headers),
                                            timeout=self.timeout_s)
        except httpx.HTTPError as error:
            raise KVTransferFailed(_failure_reason(error), describe(error)) from None
        if answer.status_code != 200:
            code, message = _error_of(answer)
            raise KVTransferFailed(code or f"status_{answer.status_code}", f"{answer.status_code}: {message}")

    async def pd_prefill(self, prefill: Replica, decode: Replica, routing: RoutingRequest,
                         headers: list[tuple[str, str]]) -> str | None:
        """The P/D prefill step of one request: None once its pages are in Mooncake, else the reason
        it falls back to `decode` serving it whole (logged, counted)."""
        started = time.monotonic()
        try:
            done = await self.prefill(prefill, routing, headers, store=True)
        except KVTransferFailed as failure:
            self.metrics.pd_prefills.labels("failed").inc()
            self.fall_back(failure.reason, decode, f"the prefill on {prefill.url} failed ({failure.detail})")
            return failure.reason
        self.metrics.pd_prefills.labels("stored").inc()
        self.metrics.pd_prefill_seconds.observe(time.monotonic() - started)
        logger.debug("P/D: %s computed %d prompt tokens (%d cached) for %s", prefill.url,
                     done.prompt_tokens - done.cached_tokens, done.cached_tokens, decode.url)
        return None

    def fall_back(self, reason: str, decode: Replica, why: str) -> None:
        self.metrics.pd_fallbacks.labels(reason).inc()
        logger.warning("P/D fallback: %s; %s serves the request whole", why, decode.url)


def _failure_reason(error: httpx.HTTPError) -> str:
    if isinstance(error, httpx.ConnectError):
        return "connect_error"  # the replica is probably gone
    return "timeout" if isinstance(error, httpx.TimeoutException) else "unreachable"


def _error_of(answer: httpx.Response) -> tuple[str | None, str]:
    """(error code, message) of a replica's error answer, in OpenAI's shape."""
    try:
        error = answer.json().get("error", {})
    except ValueError:
        return None, answer.text[:200]
    if not isinstance(error, dict):
        return None, str(error)[:200]
    return error.get("code"), str(error.get("message", ""))[:300]
