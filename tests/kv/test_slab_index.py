"""Tests of agentjax/kv/slab_index.py: a `SlabPool`'s incremental bookkeeping chooses exactly the pages and
slabs the full scans of a group's page range chose, and no allocation, append or free reads more than a
few pages' worth of the pool's arrays, however large the pool."""
from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from agentjax.errors import OutOfPagesError
from agentjax.kv import KVCacheManager
from agentjax.kv import slab_choice, slab_pool
from agentjax.kv.layout_build import build_layout
from agentjax.kv.policy_order import PolicyEvictionOrder, engine_eviction_order
from agentjax.kv.slab_pool import SlabPool
from agentjax.models import preset_config


# -- the full scans the index replaced (the oracle) ---------------------------------------------------
def scan_densest_free(pool, group: int, count: int) -> np.ndarray:
    start, stop = pool.group_range(group)
    k = int(pool.pages_per_slab[group])
    ids = np.arange(start, stop, dtype=np.int64)
    free = ids[(pool.ref_counts[start:stop] == 0) & (pool.slab_owner[(ids - start) // k] == group)]
    pinned = getattr(pool.eviction_order, "pinned_mask", None)
    cached, density = pool.page_group[free] >= 0, -pool.slab_held[(free - start) // k]
    keys = (pool.free_stamp[free], cached, density) if not pool.num_unowned else \
        (pool.free_stamp[free], density, cached)
    keys += (pinned(free) if pinned is not None else np.zeros(len(free), dtype=bool),)
    return free[np.lexsort(keys)[:count]].astype(np.int32)


def scan_reclaimable(pool, group: int, counts=None, fallback: bool = True) -> int:
    best, best_key = -1, None
    pinned = getattr(pool.eviction_order, "pinned_mask", None)
    for other in range(len(pool.pages_per_slab)):
        if other == group:
            continue
        if counts is not None and pool.group_free[other] - pool.pages_per_slab[other] < counts[other]:
            continue
        slabs = np.flatnonzero((pool.slab_owner == other) & (pool.slab_held == 0))
        if not len(slabs):
            continue
        k = int(pool.pages_per_slab[other])
        ids = int(pool.bases[other]) + slabs[:, None] * k + np.arange(k)[None, :]
        keys = np.stack([pinned(ids).any(axis=1) if pinned is not None else np.zeros(len(slabs), bool),
                         (pool.page_group[ids] >= 0).any(axis=1), pool.free_stamp[ids].max(axis=1)], axis=1)
        first = np.lexsort(keys.T[::-1])[0]
        key = tuple(keys[first].tolist())
        if best_key is None or key < best_key:
            best, best_key = int(slabs[first]), key
    if best < 0:
        if counts is not None and fallback:
            return scan_reclaimable(pool, group)
        raise OutOfPagesError(f"no slab can be given to KV group {group}")
    return best


def scan_spare_slabs(pool, demands: dict, touched=None) -> int:
    held, group_free = pool.slab_held, pool.group_free
    if touched is not None and len(touched):
        touched = np.asarray(touched, dtype=np.int64)
        touched = touched[pool.ref_counts[touched] == 0]
        groups = pool.group_of(touched)
        held = held.copy()
        np.add.at(held, pool.slab_of(touched, groups), 1)
        group_free = group_free - np.bincount(groups, minlength=len(group_free))
    owned = (pool.slab_owner >= 0) & (held == 0)
    whole = np.bincount(pool.slab_owner[owned], minlength=len(pool.pages_per_slab))
    needed = 0
    for group, count in demands.items():
        if count > 0:
            k = int(pool.pages_per_slab[group])
            needed += max(0, -(-(count - (int(group_free[group]) - int(whole[group]) * k)) // k))
    return pool.num_unowned + int(whole.sum()) - needed


def scan_policy_victims(order, count: int, allowed) -> np.ndarray:
    free = allowed[0] + np.flatnonzero(order._ref_counts[allowed[0]:allowed[1]] == 0)
    empty = order._page_group[free] < 0
    victims = free[empty][:count]
    if len(victims) < count:
        victims = np.concatenate([victims, order.policy.evict_order(free[~empty], count - len(victims))])
    return victims.astype(np.int32)


@pytest.fixture
def oracle(monkeypatch):
    """Every choice the pool makes is checked against the full scan, made just before on the same state."""
    checks: Counter = Counter()
    real_dense, real_reclaimable = slab_choice.densest_free, slab_choice.reclaimable
    real_spare, real_pop = SlabPool.spare_slabs, PolicyEvictionOrder._pop_indexed

    def densest_free(pool, group, count):
        expected = scan_densest_free(pool, group, count)
        chosen = real_dense(pool, group, count)
        assert chosen.tolist() == expected.tolist()
        checks["densest_free"] += 1
        return chosen

    def reclaimable(pool, group, counts=None, fallback=True):
        try:
            expected = scan_reclaimable(pool, group, counts, fallback)
        except OutOfPagesError:
            expected = None
        try:
            chosen = real_reclaimable(pool, group, counts, fallback)
        except OutOfPagesError:
            chosen = None
        assert chosen == expected
        checks["reclaimable"] += 1
        if chosen is None:
            raise OutOfPagesError("no slab")
        return chosen

    def spare_slabs(pool, demands, touched=None):
        spare = real_spare(pool, demands, touched)
        assert spare == scan_spare_slabs(pool, demands, touched)
        checks["spare_slabs"] += 1
        return spare

    def pop_indexed(order, index, count, allowed):
        expected = scan_policy_victims(order, count, allowed)
        chosen = real_pop(order, index, count, allowed)
        assert chosen.tolist() == expected.tolist()
        checks["policy_victims"] += 1
        return chosen

    monkeypatch.setattr(slab_pool, "densest_free", densest_free)
    monkeypatch.setattr(slab_pool, "reclaimable", reclaimable)
    monkeypatch.setattr(slab_choice, "reclaimable", reclaimable)
    monkeypatch.setattr(SlabPool, "spare_slabs", spare_slabs)
    monkeypatch.setattr(PolicyEvictionOrder, "_pop_indexed", pop_indexed)
    return checks


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("order", ["pinned", "hints"])
@pytest.mark.parametrize("name, memory", [("tiny-kimi-k3", 512 << 10), ("tiny-dsv4", 2 << 20),
                                          ("tiny-sliding", 256 << 10), ("tiny-minimax-m3", 2 << 20)])
def test_random_traffic_with_pins_chooses_what_the_full_scans_chose(oracle, name, memory, order):
    clock = Clock()
    options = {"clock": clock} if order == "pinned" else {"eviction_order": engine_eviction_order("hints", clock)}
    layout = build_layout(preset_config(name), 16, memory_bytes=memory, checkpoint_interval=64)
    manager = KVCacheManager.from_layout(layout, **options)
    rng = random.Random(11)
    prefixes = [[rng.randrange(1, 100) for _ in range(rng.randrange(20, 500))] for _ in range(5)]
    live: list[str] = []
    for step in range(260):
        clock.now += rng.random()
        op = rng.random()
        if op < 0.35 or not live:
            tokens = list(rng.choice(prefixes)) + [rng.randrange(1, 100) for _ in range(rng.randrange(1, 250))]
            if manager.allocate(f"r{step}", tokens):
                if rng.random() < 0.15:  # uncommitted: rolled back, slab conversions undone
                    manager.free(f"r{step}")
                    continue
                for done in [*range(64, len(tokens), 64), len(tokens)]:  # prefill chunks: states saved
                    manager.cache_blocks(f"r{step}", done)
                    manager.take_pending_copies()
                live.append(f"r{step}")
        elif op < 0.65:
            req = rng.choice(live)
            if manager.append(req, [rng.randrange(1, 100) for _ in range(rng.randrange(1, 24))]):
                manager.cache_blocks(req, manager.num_tokens(req))
        elif op < 0.93:
            req = live.pop(rng.randrange(len(live)))
            pin = f"s{rng.randrange(4)}" if rng.random() < 0.5 else None  # pinned sessions between turns
            manager.free(req, pin_session=pin, ttl_s=rng.choice([None, 5.0]))
        elif op < 0.97:
            manager.unpin(f"s{rng.randrange(4)}")
        else:  # free cached pages become empty without being taken (an operator's cache reset)
            manager.evict_free_pages()
        manager.take_pending_copies()
        manager.check_invariants()  # the index against a full recomputation
    pool = manager.pool
    several = len(pool.pages_per_slab) > 1
    assert pool.num_unowned == 0 and (pool.slab_trades or not several)  # slabs changed hands under pressure
    needed = ["spare_slabs"] + (["reclaimable"] if several else []) + (["densest_free"] if any(pool.bounded) else []) \
        + (["policy_victims"] if order == "hints" else [])
    assert all(oracle[check] > 0 for check in needed), dict(oracle)


class Watched(np.ndarray):
    """A pool array that records the most entries one operation on it read."""

    largest = 0

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if method == "at":  # a scatter (np.add.at): it reads and writes the entries it is given
            Watched.largest = max(Watched.largest, np.size(inputs[1]))
        else:
            for value in inputs:
                if isinstance(value, Watched):
                    Watched.largest = max(Watched.largest, value.size)
        inputs = tuple(value.view(np.ndarray) if isinstance(value, Watched) else value for value in inputs)
        if "out" in kwargs:
            kwargs["out"] = tuple(value.view(np.ndarray) if isinstance(value, Watched) else value
                                  for value in kwargs["out"])
        return getattr(ufunc, method)(*inputs, **kwargs)

    def __getitem__(self, key):
        result = self.view(np.ndarray)[key]
        if isinstance(result, np.ndarray):
            Watched.largest = max(Watched.largest, result.size)
        return result


@pytest.mark.parametrize("order", ["pinned", "hints"])
@pytest.mark.parametrize("name", ["tiny-kimi-k3", "tiny-dense"])
def test_a_request_reads_a_few_pages_worth_of_the_pool_whatever_its_size(name, order):
    """Allocate 64 tokens, 8 appends, free: no operation of the pool (or of the policy order on it) reads
    more than a few thousand entries of its per-page and per-slab arrays, in a pool of 130K-810K ids."""
    options = {} if order == "pinned" else {"eviction_order": engine_eviction_order("hints")}
    manager = KVCacheManager.from_layout(build_layout(preset_config(name), 16, memory_bytes=1 << 30), **options)
    pool = manager.pool
    assert pool.num_pages >= 130_000
    for field in ("ref_counts", "page_group", "free_stamp", "slab_owner", "slab_held"):
        setattr(pool, field, getattr(pool, field).view(Watched))
    order_object = pool.eviction_order
    if isinstance(order_object, PolicyEvictionOrder):
        order_object._ref_counts, order_object._page_group = pool.ref_counts, pool.page_group
    rng = random.Random(2)
    Watched.largest = 0
    for i in range(40):
        tokens = [rng.randrange(1, 30_000) for _ in range(64)]
        assert manager.allocate(f"r{i}", tokens)
        manager.cache_blocks(f"r{i}", 64)
        for j in range(8):
            assert manager.append(f"r{i}", [rng.randrange(1, 30_000)])
            manager.cache_blocks(f"r{i}", 65 + j)
        manager.take_pending_copies()
        manager.free(f"r{i}")
    assert 0 < Watched.largest <= 2_000, Watched.largest
