"""Session KV migration: when a turn ends and the session's next turn will go to another replica (a
first turn's pool switch, a drained replica, a rebalance), move the session there now and have its
KV prefetched in the tool gap, so the next turn starts warm.

The source flushes its stores (the turn's pages reach Mooncake), then the target runs the finished
turn's prompt through `POST /kv/prefill` as the session: pages Mooncake holds are loaded by block
hash, the rest computed, and the session's hints (`expected_next_turn_s`) keep them there for the
next turn. A gap the hints announce shorter than `min_gap_s` is not worth it: the session moves at
its next turn instead. Sessions idle on a drained replica move at their next turn, where the new
replica still loads what Mooncake holds. Never imports jax.
"""
from __future__ import annotations

import asyncio
import logging
import time

from agentjax.router.disagg import KVTransferFailed, KVTransfers
from agentjax.router.metrics import RouterMetrics
from agentjax.router.policies import SessionTable
from agentjax.router.replicas import Replica
from agentjax.router.routing_request import RoutingRequest

logger = logging.getLogger(__name__)


class SessionMigrator:
    """Starts migrations (`migrate`) and keeps their background tasks until they end (`stop`)."""

    def __init__(self, transfers: KVTransfers, metrics: RouterMetrics, sessions: SessionTable,
                 min_gap_s: float = 0.0) -> None:
        self.transfers = transfers
        self.metrics = metrics
        self.sessions = sessions
        self.min_gap_s = min_gap_s
        self._tasks: set[asyncio.Task] = set()

    def migrate(self, routing: RoutingRequest, source: Replica, target: Replica, reason: str,
                headers: list[tuple[str, str]]) -> bool:
        """Moves `routing`'s session from `source` (which served its turn) to `target` and starts the
        prefetch; False when the announced gap is too short (the session stays put until its turn)."""
        gap = routing.expected_next_turn_s
        if gap is not None and gap < self.min_gap_s:
            self.metrics.kv_migrations.labels(reason, "gap_too_short").inc()
            return False
        self.sessions.record(routing.session_id, target)
        self.metrics.migrations.labels(reason).inc()
        logger.info("session %s moves from %s to %s (%s); prefetching its KV in the tool gap%s",
                    routing.session_id, source.url, target.url, reason,
                    f" of {gap:.1f} s" if gap is not None else "")
        task = asyncio.create_task(self._prefetch(routing, source, target, reason, headers),
                                   name=f"migrate-{routing.session_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def _prefetch(self, routing: RoutingRequest, source: Replica, target: Replica, reason: str,
                        headers: list[tuple[str, str]]) -> None:
        started = time.monotonic()
        if source.healthy:
            try:
                await self.transfers.flush(source, headers)
            except KVTransferFailed as failure:  # the target computes what Mooncake lacks
                logger.info("migration of %s: %s did not flush its KV stores (%s)", routing.session_id,
                            source.url, failure.detail)
        try:
            done = await self.transfers.prefill(target, routing, headers, store=False,
                                                session_id=routing.client_session_id)
        except KVTransferFailed as failure:
            self.metrics.kv_migrations.labels(reason, "failed").inc()
            logger.warning("migration of session %s to %s: the prefetch failed (%s); its next turn computes "
                           "what is missing there", routing.session_id, target.url, failure.detail)
            return
        seconds = time.monotonic() - started
        self.metrics.kv_migrations.labels(reason, "prefetched").inc()
        self.metrics.kv_migration_seconds.observe(seconds)
        self.metrics.kv_migration_tokens.labels("cached").inc(done.cached_tokens)
        self.metrics.kv_migration_tokens.labels("computed").inc(done.prompt_tokens - done.cached_tokens)
        logger.info("migration of session %s to %s: %d of %d prompt tokens resident from cache or tiers, "
                    "the rest computed, in %.2f s", routing.session_id, target.url, done.cached_tokens,
                    done.prompt_tokens, seconds)

    async def wait(self) -> None:
        """Until the migrations in flight have ended (tests, benchmarks)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)
