"""What the offload tiers share: their names, their counters and their health.

`OffloadStats` counts pages stored and loaded per tier and failures per tier and reason (the
`agentjax:kv_offload_*` metrics); `TierHealth` takes a failing tier out of use for a back-off period
and logs why, so a full disk or a dead Mooncake master degrades to the other tiers instead of
failing requests; `log_failed_load` is the one warning a failed load gets. Thread-safe (the offload
worker's threads report here). Host only: never imports jax.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

logger = logging.getLogger(__name__)

TIER_NAMES = ("host", "disk", "mooncake")  # nearest first: a page is loaded from the first tier holding it
DEFAULT_BACKOFF_S = 30.0


class OffloadStats:
    """Counters keyed by (counter name, tier, reason); reason is "" for plain counts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str, str]] = Counter()

    def add(self, name: str, tier: str, count: int = 1, reason: str = "") -> None:
        if count:
            with self._lock:
                self._counts[(name, tier, reason)] += count

    def get(self, name: str, tier: str, reason: str = "") -> int:
        with self._lock:
            return self._counts[(name, tier, reason)]

    def total(self, name: str, tier: str | None = None) -> int:
        with self._lock:
            return sum(v for (n, t, _), v in self._counts.items() if n == name and (tier is None or t == tier))

    def snapshot(self) -> dict[tuple[str, str, str], int]:
        with self._lock:
            return dict(self._counts)


class TierHealth:
    """Whether a tier may be used now. `fail` takes it (or only its stores) out for `backoff_s`
    seconds; the first use after that is a retry, and a success puts it back for good."""

    def __init__(self, tier: str, stats: OffloadStats, backoff_s: float = DEFAULT_BACKOFF_S,
                 clock: Callable[[], float] = time.monotonic):
        self.tier = tier
        self.stats = stats
        self.backoff_s = backoff_s
        self.clock = clock
        self._down_until = 0.0  # no loads, lookups or stores before this time
        self._stores_down_until = 0.0  # no stores before this time (a full disk still serves reads)
        self.reason = ""

    def usable(self) -> bool:
        return self.clock() >= self._down_until

    def storable(self) -> bool:
        now = self.clock()
        return now >= self._down_until and now >= self._stores_down_until

    @property
    def degraded(self) -> bool:
        return not self.storable()

    def fail(self, reason: str, detail: str, stores_only: bool = False) -> None:
        """A fault that makes the tier unusable for a while (a full disk: stores only)."""
        until = self.clock() + self.backoff_s
        first = not self.degraded
        if stores_only:
            self._stores_down_until = until
        else:
            self._down_until = until
        self.reason = reason
        self.stats.add("degradations", self.tier, reason=reason)
        if first:
            logger.warning("KV offload tier %s degraded (%s): %s; %s for %.0f s", self.tier, reason, detail,
                           "no stores" if stores_only else "not used", self.backoff_s)

    def recovered(self) -> None:
        if self.reason and self.storable():
            logger.warning("KV offload tier %s is back in use", self.tier)
            self.reason = ""


def log_failed_load(owner, transfers: list, failed: dict) -> None:
    """One warning for a load job some of whose pages failed (`failed`: key -> (reason, detail)): which
    request (or prefetch), how many pages of which tier, why, and the first few details."""
    reasons = Counter(reason for reason, _ in failed.values())
    tiers = sorted({t.tier for t in transfers if (t.group, t.key) in failed})
    details = list(dict.fromkeys(detail for _, detail in failed.values() if detail))
    shown = "; ".join(details[:3]) + (f"; and {len(details) - 3} more" if len(details) > 3 else "")
    who = f"request {owner}" if isinstance(owner, str) else f"the prefetch of session {owner[-1]}"
    logger.warning("KV load for %s: %d of %d pages from the %s tier failed (%s): %s; its pages are released "
                   "and those tokens are recomputed", who, len(failed), len(transfers), "/".join(tiers) or "?",
                   ", ".join(f"{count} {reason}" for reason, count in sorted(reasons.items())), shown)
