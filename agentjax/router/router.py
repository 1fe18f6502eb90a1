"""The router's app: `GET /health`, `GET /metrics`, and every other route forwarded to a replica.

Per request: read the routing fields (`routing_request`), let the policy pick among the healthy
replicas (drained ones only when nothing else is left), run the P/D prefill step when the policy
names a prefill replica (`disagg`), forward (`proxy`). If the replica fails before any output
reached the client, it is marked down and the request goes once more to another replica; a
session whose replica is gone continues elsewhere (its KV is recomputed there, or loaded from
Mooncake). When a turn's reply has reached the client and the policy would send the session's next
turn elsewhere, the session moves now and its KV is prefetched in the tool gap (`migration`). 503
when no healthy replica is left. Routes without a session (models, tokenize, count_tokens, ...) go
to the least loaded replica. `POST /router/drain` and `/router/undrain` take a replica out of (or
back into) placement. Clients' keys pass through to the replicas, which check them; the router's
own calls (health, metrics, KV events, prompt hashes) carry its `operator_key`, which with one set
also guards its own routes but `/health`. A prompt's page keys are computed in the client's cache
namespace (asked of a replica for a client that sends a key), so prefix routing only ever matches a
client's own cached pages. Never imports jax.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
from collections.abc import Awaitable, Sequence
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from agentjax.kv.hashing import block_hashes
from agentjax.router.disagg import KVTransfers
from agentjax.router.health import HealthMonitor
from agentjax.router.metrics import RouterMetrics
from agentjax.router.migration import SessionMigrator
from agentjax.router.policies import RoutingDecision, RoutingPolicy, SessionTable, least_loaded
from agentjax.router.proxy import ForwardFailure, Forwarded, Proxy
from agentjax.router.replicas import Replica
from agentjax.router.routing_request import RoutingRequest, parse_routing_request
from agentjax.server import anthropic_protocol
from agentjax.server.tenancy import TENANT_KEY_HEADER, presented_key

logger = logging.getLogger(__name__)

ALL_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
PROMPT_HASH_TIMEOUT_S = 5.0
DISCONNECT_POLL_S = 0.5  # how often a request waiting for its reply checks that the client is still there
REASON_HEADER = "x-agentjax-route-reason"  # beside the proxy's x-agentjax-replica
PREFILL_HEADER = "x-agentjax-prefill-replica"  # P/D: the replica that computed the prompt's KV
FALLBACK_WHY = {"no_prefill_replica": "no prefill replica is healthy",
                "mooncake_degraded": "every prefill replica reports its Mooncake tier out of use"}
UPSTREAM_KEEPALIVE_S = 2.0
CLIENT_KEEPALIVE_S = 75.0  # longer than clients keep idle connections (httpx: 5 s), so they close them first


class Router:
    """Routing state (replicas, sessions, policy) and the per-request flow."""

    def __init__(self, replicas: Sequence[Replica], policy: RoutingPolicy, *, upstream_timeout_s: float = 600.0,
                 health_interval_s: float = 1.0, health_timeout_s: float = 2.0, unhealthy_after: int = 2,
                 kv_transfer_timeout_s: float = 120.0, migration_min_gap_s: float = 0.0,
                 operator_key: str | None = None, transport: httpx.AsyncBaseTransport | None = None) -> None:
        """`transport` replaces the network (tests pass an `httpx.MockTransport`). A P/D prefill or a
        migration's prefetch waits `kv_transfer_timeout_s` at most; a tool gap that agent hints
        announce shorter than `migration_min_gap_s` moves no KV ahead of the next turn. `operator_key`
        is the replicas' operator key (see the module docstring)."""
        self.replicas = list(replicas)
        self.operator_key = operator_key or None
        self.operator_headers = {"authorization": f"Bearer {operator_key}"} if operator_key else {}
        self.policy = policy
        self.sessions = SessionTable()
        self.metrics = RouterMetrics(self.replicas, lambda: len(self.sessions.replica_of))
        # Idle connections are dropped before the replicas' uvicorn closes them (after 5 s), so a
        # request never races a replica's close of the connection it reuses.
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256,
                              keepalive_expiry=UPSTREAM_KEEPALIVE_S)
        timeout = httpx.Timeout(upstream_timeout_s, connect=5.0)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport)
        self.proxy = Proxy(self.client)
        self.monitor = HealthMonitor(self.replicas, self.client, health_interval_s, health_timeout_s,
                                     unhealthy_after, poll_kv_events=policy.wants_page_keys,
                                     headers=self.operator_headers)
        self.kv_transfers = KVTransfers(self.client, self.metrics, kv_transfer_timeout_s)
        self.migrator = SessionMigrator(self.kv_transfers, self.metrics, self.sessions, migration_min_gap_s)

    async def start(self) -> None:
        await self.monitor.check_all()
        self.monitor.start()
        healthy = sum(r.healthy for r in self.replicas)
        logger.warning("routing with policy %r over %d replicas (%d healthy)", self.policy.name,
                       len(self.replicas), healthy)

    async def stop(self) -> None:
        await self.migrator.stop()
        await self.monitor.stop()
        await self.client.aclose()

    def candidates(self, tried: Sequence[Replica] = ()) -> list[Replica]:
        """Healthy replicas not yet tried; drained ones only when no other is left."""
        healthy = [r for r in self.replicas if r.healthy and r not in tried]
        return [r for r in healthy if not r.draining] or healthy

    def set_draining(self, url: str, draining: bool) -> Replica | None:
        replica = next((r for r in self.replicas if r.url == url.rstrip("/")), None)
        if replica is not None and replica.draining != draining:
            replica.draining = draining
            logger.warning("replica %s %s", replica.url, "is drained: its sessions move at their next tool gap"
                           if draining else "takes sessions again")
        return replica

    # ---- one request ------------------------------------------------------------------------
    async def handle(self, request: Request) -> Response:
        body = await request.body()
        headers = [(k.lower(), v) for k, v in request.headers.items()]
        routing = parse_routing_request(request.method, request.url.path, dict(headers), body)
        if routing.session_id is None and routing.previous_response_id:
            routing.session_id = (self.sessions.session_of(routing.previous_response_id)
                                  or f"response:{routing.previous_response_id}")
        failures: list[str] = []
        tried: list[Replica] = []
        last_failure: ForwardFailure | None = None
        for attempt in range(2):
            candidates = self.candidates(tried)
            if not candidates:
                break
            if last_failure is not None:
                self.metrics.retries.labels(last_failure.reason).inc()
            decision = await self._decide(routing, candidates, tried)
            replica = decision.replica
            prefilled_on = None
            if attempt == 0 and (decision.prefill_on is not None or decision.pd_fallback):
                finished, prefilled_on = await self._unless_client_leaves(request, self._pd_prefill(decision, routing,
                                                                                                   headers))
                if not finished:
                    return Response(status_code=499)
            tried.append(replica)
            self.metrics.decisions.labels(self.policy.name, decision.reason).inc()
            self.metrics.requests.labels(replica.url).inc()
            replica.in_flight += 1
            replica.requests_routed += 1
            try:
                forwarded = await self._forward_unless_client_leaves(request, replica, headers, body)
                if forwarded is None:  # the client left: the replica saw the connection close and aborted
                    return Response(status_code=499)
            except ForwardFailure as failure:
                failures.append(f"{replica.url}: {failure.detail}")
                last_failure = failure
                self.monitor.mark_down(replica, failure.detail, at_once=failure.replica_broken)
                logger.warning("%s %s failed on %s before any output (%s)%s", request.method, request.url.path,
                               replica.url, failure.detail, "; retrying once elsewhere" if attempt == 0 else "")
                continue
            self._remember(routing, decision, forwarded.response_id)
            forwarded.response.headers[REASON_HEADER] = decision.reason
            if prefilled_on is not None:
                forwarded.response.headers[PREFILL_HEADER] = prefilled_on.url
            forwarded.when_complete(lambda: self._after_turn(routing, replica, headers))
            return forwarded.response
        return self._unavailable(routing.path, failures)

    async def _forward_unless_client_leaves(self, request: Request, replica: Replica, headers: list,
                                            body: bytes) -> Forwarded | None:
        """The forwarded reply, or None when the client disconnected first (the forwarding is then
        cancelled, which closes the replica's connection: it aborts the request and frees its pages)."""
        forwarding = self.proxy.forward(replica, request.method, request.url.path, request.url.query, headers, body,
                                        self._releaser(replica))
        finished, outcome = await self._unless_client_leaves(request, forwarding)
        if finished:
            return outcome
        if isinstance(outcome, Forwarded):  # it finished as the client left
            await outcome.discard()
        logger.info("client left %s %s before the reply; cancelled on %s", request.method, request.url.path,
                    replica.url)
        return None

    @staticmethod
    async def _unless_client_leaves(request: Request, work: Awaitable) -> tuple[bool, object]:
        """(True, the result of `work`), or (False, what it ended with) when the client disconnected
        first: `work` is then cancelled."""
        task = asyncio.ensure_future(work)
        while True:
            try:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            except asyncio.CancelledError:  # the router itself is stopping
                task.cancel()
                raise
            if done:
                return True, task.result()
            if await request.is_disconnected():
                task.cancel()
                return False, (await asyncio.gather(task, return_exceptions=True))[0]

    async def _pd_prefill(self, decision: RoutingDecision, routing: RoutingRequest,
                          headers: list) -> Replica | None:
        """The P/D prefill step: the prefill replica when the prompt's pages are in Mooncake, else None
        (the decode replica serves the request whole; logged and counted)."""
        if decision.prefill_on is None:
            why = FALLBACK_WHY.get(decision.pd_fallback, decision.pd_fallback)
            self.kv_transfers.fall_back(decision.pd_fallback, decision.replica, why)
            return None
        failed = await self.kv_transfers.pd_prefill(decision.prefill_on, decision.replica, routing, headers)
        if failed in ("connect_error", "unreachable"):
            self.monitor.mark_down(decision.prefill_on, "the P/D prefill could not reach it",
                                   at_once=failed == "connect_error")
        return None if failed else decision.prefill_on

    def _after_turn(self, routing: RoutingRequest, served: Replica, headers: list) -> None:
        """A turn's reply reached the client: if the policy would send the session's next turn to
        another replica, the session moves there now and its KV is prefetched in the tool gap."""
        if (not self.policy.keeps_sessions or not routing.generates or not routing.session_id
                or routing.previous_response_id or routing.api == "responses"):
            return  # a Responses chain is pinned to the replica that stores it
        if self.sessions.get(routing.session_id) is not served:
            return  # a later turn already went elsewhere
        candidates = self.candidates()
        if not candidates:
            return
        try:
            upcoming = dataclasses.replace(routing, later_turn=True, page_keys=None)
            decision = self.policy.choose(upcoming, candidates, self.sessions)
        except Exception:  # a policy bug must not break the reply that just ended
            logger.exception("choosing the next replica of session %s failed", routing.session_id)
            return
        if decision.replica is served:
            return
        reason = "drained" if served.draining else (decision.move_reason or "rebalance")
        self.migrator.migrate(routing, served, decision.replica, reason, headers)

    async def _decide(self, routing: RoutingRequest, candidates: list[Replica],
                      tried: Sequence[Replica]) -> RoutingDecision:
        stored = routing.response_id if routing.api == "response_lookup" else routing.previous_response_id
        if stored is not None:  # only the replica that stored a response can return or continue it
            owner = self.sessions.owner_of(stored)
            if owner is not None and owner.healthy and owner not in tried:  # drained or not
                previous = self.sessions.get(routing.session_id)
                moved = previous if previous is not None and previous is not owner else None
                return RoutingDecision(owner, "response_owner", moved, "response_owner" if moved else None)
            if routing.api == "response_lookup":
                return RoutingDecision(least_loaded(candidates), "response_owner_down")
        if not routing.generates:
            return RoutingDecision(least_loaded(candidates), "stateless")
        if self.policy.wants_page_keys and routing.page_keys is None:
            routing.page_keys = await self._page_keys(routing, candidates)
        return self.policy.choose(routing, candidates, self.sessions)

    def _releaser(self, replica: Replica):
        def release(broken: str | None) -> None:
            replica.in_flight -= 1
            if broken is not None:
                self.metrics.broken_streams.labels(replica.url).inc()
                self.monitor.mark_down(replica, broken, at_once=True)
        return release

    def _remember(self, routing: RoutingRequest, decision: RoutingDecision, response_id: str | None) -> None:
        if not routing.generates:
            return
        session_id = routing.session_id
        if response_id is not None:
            session_id = session_id or f"response:{response_id}"
            self.sessions.record_response(response_id, session_id, decision.replica)
        if decision.moved_from is not None:
            self.metrics.migrations.labels(decision.move_reason or "rebalance").inc()
            logger.info("session %s moved from %s to %s (%s)", session_id, decision.moved_from.url,
                        decision.replica.url, decision.move_reason)
        self.sessions.record(session_id, decision.replica)

    async def _page_keys(self, routing: RoutingRequest, candidates: list[Replica]) -> list[str]:
        """The prompt's KV page keys as the replicas' caches name them: hashed here for a token-id
        prompt of a client without a key (or when the router has no operator key: replicas without
        keys), else by one replica's `POST /kv/prompt_hashes` (which tokenizes as its route does, in
        the namespace of the client's key)."""
        indexed = [r for r in candidates if r.prefix.block_size]
        if not indexed:
            return []
        reference = indexed[0].prefix
        namespaced = routing.client_key is not None and self.operator_key is not None
        if routing.prompt_token_ids is not None and not namespaced:
            step = reference.hashes_per_page
            keys = block_hashes(routing.prompt_token_ids, reference.block_size, routing.cache_salt)
            return [key.hex() for key in (keys if step == 1 else keys[step - 1::step])]
        if routing.body is None:
            return []
        helper = least_loaded(indexed)
        headers = dict(self.operator_headers)
        if namespaced:
            headers[TENANT_KEY_HEADER] = routing.client_key
        try:
            answer = await self.client.post(f"{helper.url}/kv/prompt_hashes", timeout=PROMPT_HASH_TIMEOUT_S,
                                            json={"path": routing.path, "body": routing.body}, headers=headers)
        except httpx.HTTPError as error:
            logger.debug("prompt hashes from %s failed: %s", helper.url, error)
            return []
        return answer.json().get("page_keys", []) if answer.status_code == 200 else []

    def _unavailable(self, path: str, failures: list[str]) -> Response:
        self.metrics.unavailable.inc()
        down = "; ".join(f"{r.url}: {r.last_error or 'not yet healthy'}" for r in self.replicas if not r.healthy)
        message = (f"no healthy replica: the router has {len(self.replicas)} replica(s) and none is left to try"
                   + (f" (failed on this request: {'; '.join(failures)})" if failures else "")
                   + (f" (down: {down})" if down else ""))
        if anthropic_protocol.is_messages_path(path):
            body = {"type": "error", "error": {"type": "api_error", "message": message}}
        else:
            body = {"error": {"message": message, "type": "service_unavailable", "param": None,
                              "code": "no_healthy_replica"}}
        return JSONResponse(body, status_code=503)

    def health(self) -> Response:
        replicas = [{"url": r.url, "role": r.role, "healthy": r.healthy, "draining": r.draining, "load": r.load,
                     "in_flight": r.in_flight, "last_error": r.last_error, "indexed_blocks": len(r.prefix.cached),
                     "mooncake_degraded": r.shared_tier_degraded} for r in self.replicas]
        healthy = any(r.healthy for r in self.replicas)
        return JSONResponse({"status": "ok" if healthy else "no_healthy_replica", "policy": self.policy.name,
                             "replicas": replicas}, status_code=200 if healthy else 503)


def create_router_app(router: Router) -> FastAPI:
    """The FastAPI app around `router`; health checks run while its lifespan does."""

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="agentjax router", summary="Session-aware routing over agentjax serve replicas",
                  lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.state.router = router

    def refused(request: Request) -> Response | None:
        """With an operator key set, the router's own routes (not `/health`) need it: 401 otherwise."""
        if router.operator_key is None:
            return None
        headers = {name.encode("latin-1"): value.encode("latin-1") for name, value in request.headers.items()}
        key = presented_key(headers)
        if key is not None and hmac.compare_digest(key, router.operator_key.encode()):
            return None
        return JSONResponse({"error": {"message": f"{request.url.path} needs the router's operator key "
                                       "('Authorization: Bearer KEY')", "type": "authentication_error",
                                       "param": None, "code": "invalid_api_key"}}, 401)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        return router.health()

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics(request: Request) -> Response:
        return refused(request) or Response(router.metrics.render(),
                                            media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/router/drain")
    async def drain(request: Request) -> Response:
        return refused(request) or await _set_draining(request, True)

    @app.post("/router/undrain")
    async def undrain(request: Request) -> Response:
        return refused(request) or await _set_draining(request, False)

    async def _set_draining(request: Request, draining: bool) -> Response:
        try:
            url = (await request.json())["replica"]
        except (ValueError, KeyError, TypeError):
            return JSONResponse({"error": {"message": 'send {"replica": "http://HOST:PORT"}', "type":
                                           "invalid_request_error", "param": "replica", "code": None}}, 400)
        replica = router.set_draining(str(url), draining)
        if replica is None:
            known = ", ".join(r.url for r in router.replicas)
            return JSONResponse({"error": {"message": f"no replica {url!r}; the router has {known}", "type":
                                           "invalid_request_error", "param": "replica", "code": None}}, 404)
        sessions = sum(1 for home in router.sessions.replica_of.values() if home is replica)
        return JSONResponse({"replica": replica.url, "draining": replica.draining, "sessions": sessions})

    @app.api_route("/{path:path}", methods=ALL_METHODS)
    async def forward(request: Request) -> Response:
        return await router.handle(request)

    return app
