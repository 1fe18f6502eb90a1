"""`agentjax bench kv-sim`: token hit rates of KV policies on a replay of agent traces, per tier.

Drives the real `KVCacheManager` (one manager token per 64-token trace block, block_size 1, so a
request costs a few numpy passes and no per-token work) with a `PolicyEvictionOrder` on a virtual
clock, for each policy in one run, next to Belady's offline MIN and a cache that never evicts. Each
request hits its longest device-resident prefix, then continues it from the host tier, then from
the disk tier (simulated block stores with the same policy and a retention policy), and then makes
all its blocks resident. Replay model: `agentjax.bench.kv_replay`. Host only: never imports jax,
never sleeps.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from agentjax.bench.kv_replay import Replay, ReplayRequest, infinite_cache_hits, next_uses
from agentjax.bench.kv_sim_states import StatePlan, StateStore
from agentjax.errors import InvalidRequestError
from agentjax.kv.hashing import block_hashes
from agentjax.kv.manager import KVCacheManager
from agentjax.kv.offload.policies import RetentionPolicy, make_retention
from agentjax.kv.policies import BeladyPolicy, make_policy
from agentjax.kv.policy import PagePolicy, TurnEnd
from agentjax.kv.policy_order import PolicyEvictionOrder
from agentjax.progress import ProgressBar, Throttle

logger = logging.getLogger(__name__)

SENTINEL_TOKEN = 0xFFFFFFFF  # a last token that is never cached, so a prompt's every block can hit
TIERS = ("device", "host", "disk")


class VirtualClock:
    """The replay's clock: seconds since the replay started, set by the simulator."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SimTier:
    """A lower tier as a store of `capacity` blocks named by int keys, evicting by a `PagePolicy`
    over its slots (slot 0 unused, like the pool's null page). No bytes move: only membership.

    When full it evicts at least `eviction_batch` blocks at a time (default: capacity / 1024), so a
    policy ranks the whole tier once per batch, not once per turn; the tier then holds between
    99.9% and 100% of its capacity."""

    def __init__(self, name: str, capacity: int, policy: PagePolicy, eviction_batch: int | None = None):
        if capacity < 1:
            raise InvalidRequestError(f"{name} tier capacity must be >= 1 block, got {capacity}")
        self.name = name
        self.capacity = capacity
        self.eviction_batch = max(1, capacity // 1024) if eviction_batch is None else max(1, eviction_batch)
        self.policy = policy
        policy.bind(capacity + 1)
        self._slot_of: dict[int, int] = {}
        self._key_of = np.zeros(capacity + 1, dtype=np.int64)
        self._used = np.zeros(capacity + 1, dtype=bool)
        self._free = list(range(capacity, 0, -1))
        self.writes = 0
        self.evictions = 0

    def run_from(self, keys: list[int], start: int) -> int:
        """The end of the run of consecutive stored keys from `start`."""
        slot_of, end = self._slot_of, start
        while end < len(keys) and keys[end] in slot_of:
            end += 1
        return end

    def store(self, keys: list[int], chosen: np.ndarray, turn: TurnEnd, next_use: np.ndarray | None) -> None:
        """Store the `chosen` blocks of a turn (refreshing those already stored), and tell the policy."""
        if len(chosen) == 0:
            return
        slot_of = self._slot_of
        wanted = [keys[i] for i in chosen.tolist()]
        slots = [slot_of.get(key, 0) for key in wanted]
        missing = [i for i, slot in enumerate(slots) if slot == 0]
        present = np.asarray([slot for slot in slots if slot], dtype=np.int64)
        del missing[self.capacity - len(present):]  # a turn larger than the tier keeps its head
        if len(missing) > len(self._free):
            shortfall = len(missing) - len(self._free)
            self._evict(min(max(shortfall, self.eviction_batch), self.capacity - len(self._free) - len(present)),
                        present)
        for i in missing:
            slot = self._free.pop()
            slot_of[wanted[i]] = slot
            self._key_of[slot] = wanted[i]
            self._used[slot] = True
            slots[i] = slot
        self.writes += len(missing)
        kept = np.asarray([slot for slot in slots if slot], dtype=np.int64)
        self.policy.on_free(kept[::-1])  # tail first, like the pool's release order
        self.policy.on_turn_end(TurnEnd(turn.session_id, kept, turn.now, turn.expected_next_turn_s,
                                        turn.session_end, turn.branch_point, turn.parent_session_id))
        if next_use is not None and isinstance(self.policy, BeladyPolicy):
            present = np.asarray([slot != 0 for slot in slots])
            self.policy.set_next_use(kept, next_use[chosen][present])

    def _evict(self, count: int, busy: np.ndarray) -> None:
        used = self._used.copy()
        used[busy] = False
        victims = self.policy.evict_order(np.flatnonzero(used), count)
        self.policy.on_evict(victims)
        for slot in victims.tolist():
            del self._slot_of[int(self._key_of[slot])]
            self._used[slot] = False
            self._free.append(slot)
        self.evictions += len(victims)


@dataclass
class PolicyResult:
    """Token counts of one policy's replay."""

    policy: str
    input_tokens: int = 0
    hit_tokens: dict = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    device_evictions: int = 0
    duplicate_pages: int = 0  # blocks recomputed past a missing block while an older copy was still cached
    writes: dict = field(default_factory=dict)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        total = sum(self.hit_tokens.values())
        rate = (lambda tokens: tokens / self.input_tokens if self.input_tokens else 0.0)
        out = {"token_hit_rate": rate(total), "tiers": {tier: rate(self.hit_tokens[tier]) for tier in TIERS},
               "input_tokens": self.input_tokens, "hit_tokens": dict(self.hit_tokens, total=total),
               "device_evictions": self.device_evictions, "duplicate_pages": self.duplicate_pages,
               "blocks_written": dict(self.writes), "seconds": round(self.seconds, 2)}
        for tier in TIERS:
            out[f"{tier}_token_hit_rate"] = out["tiers"][tier]
        return out


def _tokens(blocks: int, block_tokens: int, input_tokens: int) -> int:
    return min(blocks * block_tokens, input_tokens)


class PolicyReplay:
    """One policy over the whole replay: the real manager as the device tier, simulated lower tiers."""

    def __init__(self, replay: Replay, policy: str, hbm_blocks: int, host_blocks: int = 0, disk_blocks: int = 0,
                 retention: str = "interval", policy_options: dict | None = None,
                 future: list[np.ndarray] | None = None, states: StatePlan | None = None):
        if hbm_blocks < 1:
            raise InvalidRequestError(f"device capacity must be >= 1 block of {replay.block_tokens} tokens, "
                                      f"got {hbm_blocks}")
        self.replay = replay
        self.clock = VirtualClock()
        options = dict(policy_options or {})
        self.policy = make_policy(policy, self.clock, **options)
        if isinstance(self.policy, BeladyPolicy) and future is None:
            raise InvalidRequestError("the belady policy needs the replay's next uses (future=next_uses(replay))")
        self.future = future if isinstance(self.policy, BeladyPolicy) else None
        self.hbm_blocks = hbm_blocks
        # The cache keeps at most `hbm_blocks` blocks between requests; the pool has room beside them
        # for the largest request (+1: its sentinel token's page, never cached) and the null page.
        # A request is allocated into empty pages, then the policy evicts down to capacity, so it may
        # drop the request's own blocks too, as "make all blocks resident, then evict" does.
        headroom = max((len(request.hash_ids) for request in replay.requests), default=0) + 1
        self.order = PolicyEvictionOrder(self.policy)
        self.manager = KVCacheManager.full_attention(num_blocks=hbm_blocks + headroom + 1, block_size=1,
                                                     cache_on_allocate=False, eviction_order=self.order,
                                                     clock=self.clock)
        self.lower = [SimTier(name, blocks, make_policy(policy, self.clock, **options))
                      for name, blocks in (("host", host_blocks), ("disk", disk_blocks)) if blocks > 0]
        self.retention: RetentionPolicy | None = make_retention(retention) if self.lower else None
        if states is not None and self.lower:
            raise InvalidRequestError("recurrent states are modelled on the device only: drop --host-tokens and "
                                      "--disk-tokens with --state-model")
        self.states = StateStore(states, hbm_blocks * replay.block_tokens, replay.block_tokens) if states else None
        self.result = PolicyResult(policy)
        self.result.writes = {tier.name: 0 for tier in self.lower}
        self._salts = [f"kv-sim:{index}" for index in range(replay.num_sessions)]

    def run(self, progress: Callable[[int, PolicyResult], None] | None = None) -> PolicyResult:
        started = time.perf_counter()
        for index, request in enumerate(self.replay.requests):
            self.step(index, request)
            if progress is not None:
                progress(index + 1, self.result)
        self.result.writes = {tier.name: tier.writes for tier in self.lower}
        self.result.seconds = time.perf_counter() - started
        return self.result

    def step(self, index: int, request: ReplayRequest) -> None:
        """One request: hit per tier, make every block device-resident, report the turn's end."""
        self.clock.now = request.arrival_s
        manager, salt, resident = self.manager, self._salts[request.session_index], len(request.hash_ids)
        tokens = np.empty(resident + 1, dtype=np.uint32)
        tokens[:resident] = request.hash_ids
        tokens[resident] = SENTINEL_TOKEN
        req_id = f"r{index}"
        if not manager.allocate(req_id, tokens, salt):
            raise InvalidRequestError(f"request {index} needs {resident + 1} pages of an idle pool of "
                                      f"{manager.num_pages - 1}")
        hits = [manager.num_cached_tokens(req_id)]
        if self.states is not None:  # a hit lands on a saved state at or before the cached pages' end
            chained = manager.block_hashes(req_id)[:resident]
            attention = hits[0]
            hits[0] = self.states.hit(chained, attention)
        keys = self.replay.block_keys(request).tolist() if self.lower else []
        for tier in self.lower:
            hits.append(tier.run_from(keys, hits[-1]))
        manager.cache_blocks(req_id, resident)
        pages = np.asarray(manager.block_ids(req_id)[0][:resident], dtype=np.int64)
        manager.free(req_id)
        pages = self._resident_copies(pages, tokens, salt)
        turn = TurnEnd(request.session_id, pages, request.arrival_s, request.expected_next_turn_s,
                       request.session_end, request.branch_point, request.parent_session_id)
        self.policy.on_turn_end(turn)
        future = self.future[index] if self.future is not None else None
        if future is not None:
            self.policy.set_next_use(pages, future)
        attention_blocks = self.hbm_blocks
        if self.states is not None:
            self.states.save(chained, hits[0], attention)
            attention_blocks -= int(np.ceil(self.states.used_tokens / self.replay.block_tokens))
        self.result.device_evictions += self.order.evict_cached_beyond(max(attention_blocks, 0))
        if self.lower:
            chosen = self.retention.select(keys, request.branch_point)
            for tier in self.lower:
                tier.store(keys, chosen, turn, future)
        result, block_tokens = self.result, self.replay.block_tokens
        result.input_tokens += request.input_tokens
        served = 0
        for tier, blocks in zip(["device"] + [tier.name for tier in self.lower], hits):
            tokens_served = _tokens(blocks, block_tokens, request.input_tokens)
            result.hit_tokens[tier] += tokens_served - served
            served = tokens_served

    def _resident_copies(self, pages: np.ndarray, tokens: np.ndarray, salt: str) -> np.ndarray:
        """The pages that hold the prompt's blocks now. Past a missing block the manager recomputes
        into new pages even where an older copy is still cached (the new page stays uncached and is
        reused first); the policy is told about the older copy, which serves the next turn."""
        uncached = np.flatnonzero(~self.manager.holds_block(pages))
        if len(uncached) == 0:
            return pages
        self.result.duplicate_pages += len(uncached)
        hashes = block_hashes(tokens[:len(pages)], 1, salt)
        index = self.manager.cached_index(0)
        pages = pages.copy()
        for position in uncached.tolist():
            pages[position] = index.get(hashes[position], pages[position])
        return pages


@dataclass
class KVSimConfig:
    lanes: int
    hbm_tokens: int
    host_tokens: int = 0
    disk_tokens: int = 0
    policies: Sequence[str] = ("lru", "belady", "hints")
    retention: str = "interval"
    policy_options: dict = field(default_factory=dict)  # policy name -> constructor options
    progress_every_s: float = 10.0
    states: StatePlan | None = None  # a recurrent-state model's states (agentjax/bench/kv_sim_states.py)


def simulate(replay: Replay, config: KVSimConfig, report: Callable[[str], None] | None = None,
             show_bar: bool = False) -> dict:
    """Every policy of `config` (LRU and Belady always) over `replay`; the r.json summary. `report` gets
    progress lines (every `config.progress_every_s`), or with `show_bar` a progress bar with an ETA runs
    over every policy's requests and `report` gets each policy's result."""
    block = replay.block_tokens
    for name, tokens in (("hbm", config.hbm_tokens), ("host", config.host_tokens), ("disk", config.disk_tokens)):
        if tokens < 0 or (name == "hbm" and tokens < block):
            raise InvalidRequestError(f"--{name}-tokens={tokens} must be >= {block if name == 'hbm' else 0}")
    names = list(dict.fromkeys(["lru", "belady", *config.policies]))
    future = next_uses(replay) if "belady" in names else None
    infinite = infinite_cache_hits(replay)
    input_tokens = replay.input_tokens
    infinite_tokens = sum(_tokens(int(h), block, r.input_tokens) for h, r in zip(infinite, replay.requests))
    results = {}
    total = len(replay.requests)
    bar = ProgressBar(total * len(names), "kv-sim", unit=" requests") if show_bar else None
    for position, name in enumerate(names):
        simulation = PolicyReplay(replay, name, config.hbm_tokens // block, config.host_tokens // block,
                                  config.disk_tokens // block, config.retention,
                                  config.policy_options.get(name), future, config.states)
        progress = (_bar_progress(name, bar, position * total) if bar is not None
                    else _progress(name, total, config.progress_every_s, report))
        result = simulation.run(progress)
        results[name] = result.as_dict()
        if simulation.states is not None:
            results[name]["states"] = simulation.states.summary(config.hbm_tokens)
        if report:
            report(f"{name}: token hit rate {results[name]['token_hit_rate']:.4f} "
                   f"(device {results[name]['tiers']['device']:.4f}) in {result.seconds:.1f} s")
    if bar is not None:
        bar.close()
    infinite_rate = infinite_tokens / input_tokens if input_tokens else 0.0
    results["infinite"] = {"token_hit_rate": infinite_rate,
                           "tiers": {"device": infinite_rate, "host": 0.0, "disk": 0.0},
                           "input_tokens": input_tokens,
                           "hit_tokens": {"device": infinite_tokens, "total": infinite_tokens}}
    belady_rate = results["belady"]["token_hit_rate"]
    for name in [*names, "infinite"]:
        rate = results[name]["token_hit_rate"]
        results[name]["of_belady"] = rate / belady_rate if belady_rate else 0.0
        results[name]["of_infinite"] = rate / infinite_rate if infinite_rate else 0.0
    online = [name for name in names if name != "belady"]
    best = max(online, key=lambda name: results[name]["token_hit_rate"])
    return {
        "config": {"lanes": config.lanes, "stagger_s": replay.stagger_s, "hbm_tokens": config.hbm_tokens,
                   "host_tokens": config.host_tokens, "disk_tokens": config.disk_tokens, "block_tokens": block,
                   "retention": config.retention, "policies": names, "policy_options": config.policy_options,
                   "states": config.states.describe() if config.states else None},
        "workload": {"sessions": replay.num_sessions, "requests": len(replay.requests), "input_tokens": input_tokens},
        "results": results,
        "best_online": {"policy": best, "token_hit_rate": results[best]["token_hit_rate"],
                        "of_belady": results[best]["of_belady"], "of_infinite": results[best]["of_infinite"]},
    }


def _bar_progress(name: str, bar: ProgressBar, offset: int, every_s: float = 0.25):
    """Moves `bar` along one policy's requests (at most every `every_s`: the replay runs thousands of
    requests a second), and to its end after the last policy's last request."""
    throttle = Throttle(every_s)

    def progress(done: int, result: PolicyResult) -> None:
        if throttle.due() or offset + done == bar.total:
            rate = sum(result.hit_tokens.values()) / result.input_tokens if result.input_tokens else 0.0
            bar.update(offset + done, f"{name}: hit rate so far {rate:.4f}")
    return progress


def _progress(name: str, total: int, every_s: float, report: Callable[[str], None] | None):
    if report is None:
        return None
    state = {"last": time.perf_counter(), "start": time.perf_counter()}

    def progress(done: int, result: PolicyResult) -> None:
        now = time.perf_counter()
        if now - state["last"] < every_s and done != total:
            return
        state["last"] = now
        rate = sum(result.hit_tokens.values()) / result.input_tokens if result.input_tokens else 0.0
        report(f"{name}: {done}/{total} requests ({100 * done / total:.0f}%), hit rate so far {rate:.4f}, "
               f"{now - state['start']:.0f} s")
    return progress
