"""Routing in the planning simulator: requests placed across simulated replicas (the attention ranks of a
DEP instance, or whole instances of a deployment) by the router's own policies, agentjax/router/policies.py.

`PolicyPlacement` keeps one `Replica` per simulated target and asks the real `RoutingPolicy.choose`
where each request goes, as `agentjax router` does: a request's session id, parent session and turn come
from its agent hints, the chosen replica is recorded in the `SessionTable`, and a replica's load is its
requests in flight (the router's own count) or, when higher, the requests its engines hold (what a
replica reports on /metrics; read here at every decision instead of every health interval). Under
`prefix`, a replica's `PrefixIndex` is a view of its engines' cached page hashes (exact and current,
where a real router's lags by its event polling) and the prompt's page keys are hashed as the router
hashes a token-id prompt. `FleetBackend` is the AgentX backend of several instances behind one
placement, each stepped by its own driver on the shared virtual clock. Host only: never imports jax.
"""
from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from typing import Any

from agentjax.errors import InvalidRequestError
from agentjax.router.policies import SessionTable, make_policy
from agentjax.router.replicas import Replica
from agentjax.router.routing_request import RoutingRequest

ROUTERS = ("sticky", "prefix", "queue")


def _engines(target) -> list:
    """The Engines of a placement target: an Engine, or a DEP group's ranks."""
    return list(getattr(target, "engines", None) or [target])


class EnginePrefixView:
    """`PrefixIndex.cached_keys` over the routing group (the first prefix-hit group) of a target's
    engines: the leading run of the prompt's page keys one engine's pool holds (the best rank)."""

    hit_rule = "prefix"

    def __init__(self, target) -> None:
        self.kvs = [engine.kv for engine in _engines(target)]
        kv = self.kvs[0]
        self.group = kv.prefix_group() or kv.plan.groups[0]
        self.block_size = kv.block_size
        self.cached: set = set()  # the router's status page counts these; the view reads the pools

    def cached_keys(self, page_keys: Sequence[bytes]) -> int:
        best = 0
        for kv in self.kvs:
            index = kv.cached_index(self.group.group_id)
            count = 0
            for key in page_keys:
                if key not in index:
                    break
                count += 1
            best = max(best, count)
        return best

    def page_keys(self, token_ids: Sequence[int]) -> list[bytes]:
        return self.kvs[0].page_keys(self.group.group_id, list(token_ids))


class PolicyPlacement:
    """Chooses the target (index) of each request through a real routing policy."""

    def __init__(self, policy: str, targets: Sequence[Any], label: str = "replica") -> None:
        if policy not in ROUTERS:
            raise InvalidRequestError(f"router={policy!r}: the simulator runs {', '.join(ROUTERS)}")
        self.targets = list(targets)
        self.replicas = [Replica(f"sim://{label}{index}", healthy=True) for index in range(len(self.targets))]
        self.policy = make_policy(policy, self.replicas)
        self.sessions = SessionTable()
        self.reasons: Counter[str] = Counter()
        self._index = {id(replica): index for index, replica in enumerate(self.replicas)}
        if self.policy.wants_page_keys:
            for replica, target in zip(self.replicas, self.targets):
                replica.prefix = EnginePrefixView(target)

    def place(self, prompt: Sequence[int], session_id: str | None, hints=None) -> int:
        for replica, target in zip(self.replicas, self.targets):
            replica.reported_in_server = sum(e.scheduler.num_waiting + len(e.scheduler.running)
                                             for e in _engines(target))
        turn = getattr(hints, "turn", None)
        request = RoutingRequest("POST", "/v1/completions", "completions", session_id=session_id,
                                 parent_session_id=getattr(hints, "parent_session_id", None),
                                 later_turn=None if turn is None else turn > 0,
                                 expected_next_turn_s=getattr(hints, "expected_next_turn_s", None),
                                 prompt_token_ids=list(prompt))
        if self.policy.wants_page_keys:
            request.page_keys = self.replicas[0].prefix.page_keys(prompt)
        decision = self.policy.choose(request, self.replicas, self.sessions)
        self.sessions.record(session_id, decision.replica)
        decision.replica.in_flight += 1
        decision.replica.requests_routed += 1
        self.reasons[decision.reason] += 1
        return self._index[id(decision.replica)]

    def release(self, index: int) -> None:
        """A request placed on target `index` finished."""
        self.replicas[index].in_flight -= 1

    def snapshot(self) -> dict:
        return {"policy": self.policy.name, "decisions": dict(self.reasons),
                "requests_per_replica": [replica.requests_routed for replica in self.replicas]}


class FleetBackend:
    """Several simulated instances behind one `PolicyPlacement`: an AgentX backend whose `send` routes
    each turn, then waits on the chosen instance's own `EngineBackend`."""

    def __init__(self, backends: Sequence[Any], placement: PolicyPlacement) -> None:
        self.backends, self.placement = list(backends), placement
        self.token_range = self.backends[0].token_range
        self.max_prompt_tokens = min(b.max_prompt_tokens for b in self.backends)

    async def start(self) -> None:
        for backend in self.backends:
            await backend.start()

    async def send(self, request):
        from agentjax.scheduler.request import AgentHints

        index = self.placement.place(request.prompt, request.session_id, AgentHints(**request.hints))
        try:
            return await self.backends[index].send(request)
        finally:
            self.placement.release(index)

    async def close(self) -> None:
        await asyncio.gather(*(backend.close() for backend in self.backends))
