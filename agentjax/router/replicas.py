"""The router's picture of each replica: its URL and role, health, load, and a prefix index.

`Replica.load` is what queue-depth balancing compares: the larger of the router's own requests in
flight there and the requests the replica last reported holding (`agentjax:num_requests_in_server`,
or vLLM's running + waiting). `PrefixIndex` mirrors the replica's cached block hashes from its
`GET /kv/events`. A draining replica takes no new sessions and sees its sessions move at their next
tool gap. Plain state, updated on the event loop only; never does I/O. Never imports jax.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from agentjax.errors import RouterConfigError

ROLES = ("mixed", "prefill", "decode")


class PrefixIndex:
    """The block hashes one replica's routing KV group can hit (hex strings), as its events say."""

    def __init__(self) -> None:
        self.epoch: str | None = None
        self.next_change = 0
        self.cached: set[str] = set()
        self.block_size: int | None = None
        self.hashes_per_page = 1
        self.hit_rule = "prefix"
        self.available = True  # False once the replica answered 404 (it keeps no events)
        self.refused = False  # the replica answered 401/403: the router lacks its operator key (warned once)

    def apply(self, answer: dict) -> None:
        """One `GET /kv/events` answer."""
        if answer.get("snapshot") or answer.get("epoch") != self.epoch:
            self.cached.clear()
        self.epoch = answer.get("epoch")
        self.block_size = int(answer["block_size"])
        self.hashes_per_page = int(answer.get("hashes_per_page", 1))
        self.hit_rule = str(answer.get("hit_rule", "prefix"))
        for op, block_hash in answer.get("events", ()):
            if op == "+":
                self.cached.add(block_hash)
            else:
                self.cached.discard(block_hash)
        self.next_change = int(answer["next"])

    def reset(self) -> None:
        self.epoch, self.next_change = None, 0
        self.cached.clear()

    def cached_keys(self, page_keys: Sequence[str]) -> int:
        """How many of `page_keys` (a prompt's, in order) this replica can serve: the leading run for
        a full-attention group; the deepest present key otherwise (chained hashes name the whole
        prefix, so it is an upper bound)."""
        if self.hit_rule == "prefix":
            count = 0
            for key in page_keys:
                if key not in self.cached:
                    break
                count += 1
            return count
        for depth in range(len(page_keys), 0, -1):
            if page_keys[depth - 1] in self.cached:
                return depth
        return 0


@dataclass(eq=False)
class Replica:
    """One `agentjax serve` (or any OpenAI-compatible server) behind the router."""

    url: str
    role: str = "mixed"
    healthy: bool = False  # until the first health check passes
    consecutive_failures: int = 0
    last_error: str | None = None
    in_flight: int = 0  # requests the router is forwarding there now
    reported_in_server: int = 0  # from the replica's /metrics
    requests_routed: int = 0
    prefix: PrefixIndex = field(default_factory=PrefixIndex)
    draining: bool = False  # an operator asked for its sessions to move off (`POST /router/drain`)
    # From /metrics: whether its Mooncake tier is out of use after a fault; None: it has no such tier
    # (or has not said yet). P/D needs the prefill replica's pages there.
    shared_tier_degraded: bool | None = None

    @property
    def load(self) -> int:
        return max(self.in_flight, self.reported_in_server)

    @property
    def name(self) -> str:
        return self.url

    def serves_first_turns(self) -> bool:
        return self.role in ("mixed", "prefill")

    def serves_later_turns(self) -> bool:
        return self.role in ("mixed", "decode")


def normalized_url(url: str) -> str:
    """`http://host:port` without a trailing slash; a clear error for anything else."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise RouterConfigError(f"replica URL {url!r} must look like http://HOST:PORT")
    if parts.path not in ("", "/"):
        raise RouterConfigError(f"replica URL {url!r} must not have a path (got {parts.path!r}); "
                                "the router forwards /v1/... itself")
    return f"{parts.scheme}://{parts.netloc}"


def build_replicas(mixed: Sequence[str], prefill: Sequence[str] = (), decode: Sequence[str] = ()) -> list[Replica]:
    """One `Replica` per URL, in flag order; a URL named twice is an error."""
    replicas: list[Replica] = []
    seen: set[str] = set()
    for role, urls in (("mixed", mixed), ("prefill", prefill), ("decode", decode)):
        for url in urls:
            normal = normalized_url(url)
            if normal in seen:
                raise RouterConfigError(f"replica {normal} is named twice; each URL may appear once")
            seen.add(normal)
            replicas.append(Replica(normal, role))
    if not replicas:
        raise RouterConfigError("the router needs at least one replica: --replica URL (or --prefill-replica "
                                "and --decode-replica)")
    return replicas
