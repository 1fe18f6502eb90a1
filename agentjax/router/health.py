"""Health checks: every `interval_s`, each replica's `GET /health`, its load (and whether its Mooncake
tier is in use) from `GET /metrics`, and its cache changes from `GET /kv/events` (prefix policy).

A replica is down after `unhealthy_after` failed checks in a row, at once when its port refuses
connections, or when the proxy could not reach it; one passing check brings it back. Transitions
are logged at WARNING. Only touches `Replica` state on the event loop. Never imports jax.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Sequence

import httpx

from agentjax.router.replicas import Replica

logger = logging.getLogger(__name__)

LOAD_METRICS = ("agentjax:num_requests_in_server",)
VLLM_LOAD_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")
_MOONCAKE_DEGRADED = re.compile(r'^agentjax:kv_offload_tier_degraded\{tier="mooncake"\} ([-+0-9.eE]+)$',
                                re.MULTILINE)
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})? ([-+0-9.eE]+|NaN)$", re.MULTILINE)


def reported_shared_tier_degraded(metrics_text: str) -> bool | None:
    """Whether the replica's Mooncake tier is out of use (`agentjax:kv_offload_tier_degraded`); None
    when it reports no Mooncake tier."""
    match = _MOONCAKE_DEGRADED.search(metrics_text)
    return None if match is None else float(match.group(1)) > 0


def reported_load(metrics_text: str) -> int | None:
    """Requests the replica holds, from its Prometheus text (agentjax's gauge, else vLLM's
    running + waiting); None when neither is there."""
    samples: dict[str, float] = {}
    for name, value in _SAMPLE.findall(metrics_text):
        with contextlib.suppress(ValueError):
            samples[name] = samples.get(name, 0.0) + float(value)
    for names in (LOAD_METRICS, VLLM_LOAD_METRICS):
        if all(name in samples for name in names):
            return int(sum(samples[name] for name in names))
    return None


class HealthMonitor:
    """Polls the replicas in the background (`start` / `stop`), or once (`check_all`)."""

    def __init__(self, replicas: Sequence[Replica], client: httpx.AsyncClient, interval_s: float = 1.0,
                 timeout_s: float = 2.0, unhealthy_after: int = 2, poll_kv_events: bool = True,
                 headers: dict[str, str] | None = None) -> None:
        """`headers` go with every check (the router's operator key: replicas with keys need it for
        `/metrics` and `/kv/events`)."""
        self.replicas = list(replicas)
        self.headers = dict(headers or {})
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.unhealthy_after = unhealthy_after
        self.poll_kv_events = poll_kv_events
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="router-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.check_all()

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(replica) for replica in self.replicas))

    async def check(self, replica: Replica) -> None:
        try:
            answer = await self.client.get(f"{replica.url}/health", timeout=self.timeout_s, headers=self.headers)
            if answer.status_code != 200:
                raise httpx.HTTPStatusError(f"/health answered {answer.status_code}", request=answer.request,
                                            response=answer)
            metrics = await self.client.get(f"{replica.url}/metrics", timeout=self.timeout_s, headers=self.headers)
            load = reported_load(metrics.text) if metrics.status_code == 200 else None
            if metrics.status_code == 200:
                replica.shared_tier_degraded = reported_shared_tier_degraded(metrics.text)
        except httpx.ConnectError as error:
            self.mark_down(replica, f"connection refused ({error})", at_once=True)
            return
        except (httpx.HTTPError, OSError) as error:
            self.mark_down(replica, f"{type(error).__name__}: {error}")
            return
        if load is not None:
            replica.reported_in_server = load
        self.mark_up(replica)
        if self.poll_kv_events and replica.prefix.available:
            await self._poll_kv_events(replica)

    async def _poll_kv_events(self, replica: Replica) -> None:
        index = replica.prefix
        for _ in range(20):  # bounded catch-up per check
            params = {"after": index.next_change}
            if index.epoch:
                params["epoch"] = index.epoch
            try:
                answer = await self.client.get(f"{replica.url}/kv/events", params=params, timeout=self.timeout_s,
                                               headers=self.headers)
            except httpx.HTTPError as error:
                logger.debug("kv events of %s: %s", replica.url, error)
                return
            if answer.status_code == 404:
                index.available = False
                logger.info("%s publishes no KV events: the prefix policy scores it 0", replica.url)
                return
            if answer.status_code in (401, 403):
                if not index.refused:
                    logger.warning("%s refuses the router's KV event polls (%d): start the router with the "
                                   "replicas' --operator-key for prefix routing", replica.url, answer.status_code)
                index.refused = True
                return
            if answer.status_code != 200:
                return
            body = answer.json()
            index.apply(body)
            if not body.get("more"):
                return

    def mark_down(self, replica: Replica, error: str, at_once: bool = False) -> None:
        replica.consecutive_failures += 1
        replica.last_error = error
        if replica.healthy and (at_once or replica.consecutive_failures >= self.unhealthy_after):
            replica.healthy = False
            replica.prefix.reset()
            logger.warning("replica %s is down: %s", replica.url, error)

    def mark_up(self, replica: Replica) -> None:
        if not replica.healthy:
            logger.warning("replica %s is healthy", replica.url)
        replica.healthy = True
        replica.consecutive_failures = 0
        replica.last_error = None
