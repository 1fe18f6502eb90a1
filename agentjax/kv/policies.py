"""Built-in KV policies (the protocol is `agentjax.kv.policy`): LRU, hint-aware session pins, Marconi,
and Belady's offline MIN as the yardstick the others are measured against.

Every policy here ranks cached free pages from facts it was told (turn ends, agent hints) and
never looks ahead, except `BeladyPolicy`, which a simulator feeds the future on purpose. Host only:
never imports jax.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable

import numpy as np

from agentjax.errors import InvalidRequestError
from agentjax.kv.policy import PagePolicy, TurnEnd

__all__ = ["LRUPolicy", "HintAwarePolicy", "MarconiPolicy", "BeladyPolicy", "make_policy", "engine_policy",
           "POLICY_NAMES", "ENGINE_POLICY_NAMES"]


class LRUPolicy(PagePolicy):
    """Least recently freed first; a request frees its tail before its head, so tails go first."""

    name = "lru"

    def priority(self, pages: np.ndarray, now: float) -> tuple[np.ndarray, np.ndarray]:
        return self.recency[pages].astype(np.float64), np.zeros(len(pages))


class HintAwarePolicy(PagePolicy):
    """Soft session pins from agent hints: evicts the pages whose next use is expected farthest away.

    A session's next turn is expected at its last turn end plus `expected_next_turn_s` (without a
    hint: `default_next_turn_s` after it). A page's next use is the sooner of the expected next
    turns of the (up to two) sessions that used it last, so a prefix shared by a parent and its
    subagents counts for both; a session that sent `session_end` is never expected again, and a
    page its owner's latest turn left behind (a compacted or abandoned context; branch-point
    prompts excepted) is not expected by that owner any more. Pages never expected again go
    first; ties go deepest position first (tails before heads). Once the expected time has passed,
    the turn is taken to be `overdue_s_per_s` seconds away per second late (0: imminent).
    `branch_pin` can also hard-pin a branch point's prompt (see `PagePolicy`); the default relies
    on the subagents' own turns instead, which measured better in `agentjax bench kv-sim`.

    Session pins, when a turn end carries the agent's `pin` hint (the engine's do; the simulator's
    replay does not): "soft" pins the turn's pages under ("session", id) until `pin_margin` x the
    expected gap (`expected_next_turn_s`, else `default_next_turn_s`) + `pin_slack_s` has passed,
    "session" until `session_end`, "none" pins nothing and expects no next turn. Pinned pages go
    after every unpinned one (`PagePolicy.evict_order`); `session_end` releases the pins.
    """

    name = "hints"

    def __init__(self, clock: Callable[[], float] = time.monotonic, default_next_turn_s: float = 30.0,
                 overdue_s_per_s: float = 0.0, prefetch_lead_s: float = 5.0, branch_pin: str | None = None,
                 pin_margin: float = 1.5, pin_slack_s: float = 1.0):
        super().__init__(clock, branch_pin)
        if not all(value >= 0 for value in (default_next_turn_s, overdue_s_per_s, prefetch_lead_s, pin_margin,
                                            pin_slack_s)):
            raise InvalidRequestError(
                f"default_next_turn_s={default_next_turn_s}, overdue_s_per_s={overdue_s_per_s}, "
                f"prefetch_lead_s={prefetch_lead_s}, pin_margin={pin_margin} and pin_slack_s={pin_slack_s} "
                f"must all be >= 0")
        self.default_next_turn_s = default_next_turn_s
        self.overdue_s_per_s = overdue_s_per_s
        self.prefetch_lead_s = prefetch_lead_s
        self.pin_margin = pin_margin
        self.pin_slack_s = pin_slack_s

    def on_turn_end(self, turn: TurnEnd) -> None:
        super().on_turn_end(turn)
        key = ("session", turn.session_id)
        if turn.session_end:
            self.unpin(key)
        elif turn.pin == "none":  # the agent keeps nothing for this session: never expected again
            self.session_next_turn_at[self._session_index[turn.session_id]] = math.inf
        elif turn.pin in ("soft", "session") and len(turn.pages):
            gap = self.default_next_turn_s if turn.expected_next_turn_s is None else turn.expected_next_turn_s
            expires_at = None if turn.pin == "session" else turn.now + self.pin_margin * gap + self.pin_slack_s
            self.pin(key, turn.pages, expires_at)

    def expected_next_use(self, sessions: np.ndarray, now: float) -> np.ndarray:
        """Absolute expected next-turn time per session index (inf: ended, or NO_SESSION)."""
        return self._session_table(now)[sessions]

    def _session_table(self, now: float) -> np.ndarray:
        """Expected next-turn time of every session, then inf at index -1 (NO_SESSION)."""
        count = len(self._session_ids)
        expected = self.session_next_turn_at[:count]
        last_end = self.session_last_turn_end[:count]
        expected = np.where(np.isnan(expected), last_end + self.default_next_turn_s, expected)
        if self.overdue_s_per_s > 0:
            late = now - expected
            expected = np.where(late > 0, now + self.overdue_s_per_s * late, expected)
        expected = np.where(self.session_ended[:count], math.inf, expected)
        return np.append(expected, math.inf)

    def priority(self, pages: np.ndarray, now: float) -> tuple[np.ndarray, np.ndarray]:
        table = self._session_table(now)
        by_owner = np.where(self.left_behind(pages), math.inf, table[self.owner[pages]])
        next_use = np.minimum(by_owner, table[self.owner2[pages]])
        return -next_use, -self.position[pages].astype(np.float64)

    def prefetch(self, session_id: Hashable) -> list:
        """The block keys of the session's last turn once its next turn is `prefetch_lead_s` away."""
        index = self._session_index.get(session_id)
        if index is None or index not in self._session_keys or self.session_ended[index]:
            return []
        now = self.clock()
        due = self.expected_next_use(np.asarray([index]), now)[0]
        return list(self._session_keys[index]) if due - now <= self.prefetch_lead_s else []

    def sessions_due(self, now: float, horizon_s: float) -> list[Hashable]:
        """Live sessions whose next turn is expected within `horizon_s` of `now` (prefetch candidates)."""
        count = len(self._session_ids)
        expected = self.expected_next_use(np.arange(count), now)
        return [self._session_ids[i] for i in np.flatnonzero(expected - now <= horizon_s).tolist()]


class MarconiPolicy(PagePolicy):
    """Marconi-style utility: keep what a second turn has reused (or a branch point's prompt holds),
    and what is costly to recompute, while it stays recent.

    utility = recency (0 oldest .. 1 newest among the candidates) + `reuse_bonus` if the content
    served two turns or belongs to a branch point + `flop_weight` x recompute FLOPs per byte
    (normalised the same way, from `flops_per_byte(position) -> array`); the lowest goes first.
    Reuse is counted per page, so content that is evicted and recomputed starts over.
    """

    name = "marconi"

    def __init__(self, clock: Callable[[], float] = time.monotonic, reuse_bonus: float = 0.5,
                 flop_weight: float = 0.0, flops_per_byte: Callable[[np.ndarray], np.ndarray] | None = None,
                 branch_pin: str | None = None):
        super().__init__(clock, branch_pin)
        if not reuse_bonus >= 0 or not flop_weight >= 0:
            raise InvalidRequestError(f"reuse_bonus={reuse_bonus} and flop_weight={flop_weight} must be >= 0")
        if flop_weight > 0 and flops_per_byte is None:
            raise InvalidRequestError("flop_weight > 0 needs flops_per_byte (see agentjax.kv.offload.policies)")
        self.reuse_bonus = reuse_bonus
        self.flop_weight = flop_weight
        self.flops_per_byte = flops_per_byte

    def priority(self, pages: np.ndarray, now: float) -> tuple[np.ndarray, np.ndarray]:
        utility = _normalised(self.recency[pages].astype(np.float64))
        if self.reuse_bonus > 0:
            utility = utility + self.reuse_bonus * ((self.uses[pages] >= 2) | self.page_branch[pages])
        if self.flop_weight > 0:
            utility = utility + self.flop_weight * _normalised(self.flops_per_byte(self.position[pages]))
        return utility, -self.position[pages].astype(np.float64)


class BeladyPolicy(PagePolicy):
    """Offline MIN: evicts the page whose next use is farthest away (never: first), deepest first.

    Not an online policy: a simulator that knows the future calls `set_next_use(pages, next_use)`
    after each turn with, per page, the index of the next request that uses its block (inf: none).
    """

    name = "belady"

    def bind(self, num_pages: int) -> None:
        super().bind(num_pages)
        self.next_use = np.full(num_pages, math.inf)

    def set_next_use(self, pages: np.ndarray, next_use: np.ndarray) -> None:
        self.next_use[np.asarray(pages, dtype=np.int64)] = next_use

    def on_evict(self, pages: np.ndarray) -> None:
        super().on_evict(pages)
        self.next_use[pages] = math.inf

    def priority(self, pages: np.ndarray, now: float) -> tuple[np.ndarray, np.ndarray]:
        return -self.next_use[pages], -self.position[pages].astype(np.float64)


def _normalised(values: np.ndarray) -> np.ndarray:
    if len(values) == 0:
        return values
    low, high = float(values.min()), float(values.max())
    return (values - low) / (high - low) if high > low else np.zeros(len(values))


POLICY_NAMES = ("lru", "hints", "marconi", "belady")
ENGINE_POLICY_NAMES = ("lru", "hints", "marconi")  # online policies: what the engine's `kv_policy` takes


def make_policy(name: str, clock: Callable[[], float] = time.monotonic, **options) -> PagePolicy:
    """A built-in policy by name (`POLICY_NAMES`); options go to its constructor."""
    classes = {"lru": LRUPolicy, "hints": HintAwarePolicy, "marconi": MarconiPolicy, "belady": BeladyPolicy}
    if name not in classes:
        raise InvalidRequestError(f"unknown KV policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    return classes[name](clock, **options)



def engine_policy(name: str, clock: Callable[[], float] = time.monotonic) -> PagePolicy:
    """The policy of the engine's `kv_policy` setting. "hints" (the default) is `HintAwarePolicy` with
    the engine's session pins: branch points pinned until `session_end`, and a session that is late
    for its expected turn counted a second further away per second late (so sessions that never
    come back stop holding pages); "lru" and "marconi" are the built-ins as they are."""
    if name not in ENGINE_POLICY_NAMES:
        raise InvalidRequestError(f"unknown kv_policy {name!r}; choose one of {', '.join(ENGINE_POLICY_NAMES)}")
    if name == "hints":
        return HintAwarePolicy(clock, overdue_s_per_s=1.0, branch_pin="session")
    return make_policy(name, clock)
