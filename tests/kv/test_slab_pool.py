"""Tests of agentjax/kv/slab_pool.py: page ids per group over slabs that change hands, and the hybrid
manager over it (admissions, rollbacks, groups trading memory under pressure)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from agentjax.errors import OutOfPagesError
from agentjax.kv import KVCacheManager
from agentjax.kv.layout_build import build_layout
from agentjax.kv.policy_order import engine_eviction_order
from agentjax.kv.slab_pool import SlabPool
from agentjax.models import preset_config


def test_a_new_pool_holds_no_page_until_a_group_takes_a_slab():
    pool = SlabPool(num_slabs=5, pages_per_slab=[4, 1])
    assert pool.num_free == 0 and pool.free_units() == 16 and pool.capacity_units() == 16
    pages = pool.allocate(3, group=0)
    assert ((pages >= 0) & (pages < 20)).all() and 0 not in pages.tolist()  # group 0's ids, never the null page
    assert pool.slab_owner.tolist().count(0) == 1 and pool.group_free.tolist() == [1, 0]
    state = pool.allocate(1, group=1)
    assert 20 <= int(state[0]) < 25 and pool.free_units() == 16 - 3 - 4  # a state page is a whole slab
    pool.check_invariants()


def test_a_group_takes_the_whole_free_slabs_of_another_group_evicting_their_blocks():
    pool = SlabPool(num_slabs=3, pages_per_slab=[2, 1])
    pages = pool.allocate(4, group=0)  # both usable slabs
    for page, key in zip(pages.tolist(), "abcd"):
        pool.cache_page(page, 0, key, None)
    with pytest.raises(OutOfPagesError):
        pool.allocate(1, group=1)
    pool.release(pages[:1])
    assert not pool.can_take({1: 1})  # its slab still holds a page in use
    pool.release(pages[1:2])
    assert pool.can_take({1: 1}) and not pool.can_take({1: 2})
    evictions = pool.evictions
    (state,) = pool.allocate(1, group=1).tolist()
    assert pool.evictions == evictions + 2 and pool.num_cached == 2  # the slab's two blocks went with it
    assert pool.slab_of(np.asarray([state])).tolist() == pool.slab_of(pages[:1]).tolist()
    pool.check_invariants()


def test_free_slabs_are_taken_before_a_group_evicts_its_own_cached_pages():
    pool = SlabPool(num_slabs=4, pages_per_slab=[2, 1])
    pages = pool.allocate(2, group=0)
    for page, key in zip(pages.tolist(), "ab"):
        pool.cache_page(page, 0, key, None)
    pool.release(pages)
    again = pool.allocate(2, group=0)
    assert pool.num_cached == 2 and not set(again.tolist()) & set(pages.tolist())


def test_demands_of_several_groups_are_counted_in_whole_slabs():
    pool = SlabPool(num_slabs=4, pages_per_slab=[3, 1])  # 3 usable slabs
    assert pool.can_take({0: 4, 1: 1}) and not pool.can_take({0: 4, 1: 2}) and pool.can_take({0: 9})
    out, _, _ = pool.take([4, 1])
    assert [len(pages) for pages in out] == [4, 1] and pool.num_unowned == 0
    assert pool.can_take({0: 2}) and not pool.can_take({0: 3})


def _tokens(rng: random.Random, prefixes: list, length: int) -> list[int]:
    return list(rng.choice(prefixes)) + [rng.randrange(1, 100) for _ in range(length)]


def _snapshot(manager: KVCacheManager) -> tuple:
    pool = manager.pool
    live = pool.eviction_order.live_pages_in_order() if hasattr(pool.eviction_order, "live_pages_in_order") else ()
    return (pool.ref_counts.tolist(), pool.slab_owner.tolist(), [dict(index) for index in pool.cached],
            list(live), pool.evictions, manager.stats()["hits"])


@pytest.mark.parametrize("name", ["tiny-sliding", "tiny-kimi-k3", "tiny-dsv4"])
def test_an_admission_rolled_back_leaves_the_pool_as_it_was_even_after_slab_conversions(name):
    manager = KVCacheManager.from_layout(build_layout(preset_config(name), 16, memory_bytes=1 << 20),
                                         cache_on_allocate=False)
    rng = random.Random(7)
    prefixes = [[rng.randrange(1, 100) for _ in range(300)] for _ in range(3)]
    moved = 0
    for turn in range(40):
        tokens = _tokens(rng, prefixes, rng.randrange(1, 400))
        before = _snapshot(manager)
        moves_before = manager.pool.slab_moves
        if not manager.allocate(f"probe{turn}", tokens):
            continue
        moved += manager.pool.slab_moves > moves_before
        manager.free(f"probe{turn}")  # uncommitted: rolled back
        assert _snapshot(manager) == before
        if manager.allocate(f"r{turn}", tokens):  # then a real turn that stays cached
            manager.cache_blocks(f"r{turn}", len(tokens))
            manager.take_pending_copies()
            manager.free(f"r{turn}")
        manager.check_invariants()
    assert moved  # the admissions did convert slabs


@pytest.mark.parametrize("order", ["pinned", "hints"])
@pytest.mark.parametrize("name", ["tiny-sliding", "tiny-kimi-k3", "tiny-dsv4", "tiny-minimax-m3"])
def test_groups_trade_memory_under_pressure_and_can_allocate_never_lies(name, order):
    options = {} if order == "pinned" else {"eviction_order": engine_eviction_order(order)}
    memory = {"tiny-sliding": 256 << 10, "tiny-kimi-k3": 384 << 10}.get(name, 2 << 20)  # under pressure
    manager = KVCacheManager.from_layout(build_layout(preset_config(name), 16, memory_bytes=memory), **options)
    rng = random.Random(0)
    prefixes = [[rng.randrange(1, 100) for _ in range(rng.randrange(20, 600))] for _ in range(6)]
    live: list[str] = []
    refused = 0
    for step in range(300):
        op = rng.random()
        if op < 0.4 or not live:
            tokens = _tokens(rng, prefixes, rng.randrange(1, 300))
            fits = manager.can_allocate(tokens)
            assert manager.allocate(f"r{step}", tokens) == fits
            refused += not fits
            if fits:
                manager.cache_blocks(f"r{step}", len(tokens))
                live.append(f"r{step}")
        elif op < 0.7:
            req = rng.choice(live)
            if manager.append(req, [rng.randrange(1, 100) for _ in range(rng.randrange(1, 20))]):
                manager.cache_blocks(req, manager.num_tokens(req))
        else:
            req = live.pop(rng.randrange(len(live)))
            manager.free(req)
        manager.take_pending_copies()
        manager.check_invariants()
    assert manager.pool.num_unowned == 0 and refused  # the pool was full and refused admissions


def test_a_long_prompt_takes_the_slabs_that_finished_requests_states_left():
    """Kimi-style: short requests leave cached states (checkpoints) in many slabs; a long prompt's
    latent pages then reclaim those slabs (evicting the states), so it fits memory states held."""
    layout = build_layout(preset_config("tiny-kimi-k3"), 16, memory_bytes=512 << 10, checkpoint_interval=64)
    manager = KVCacheManager.from_layout(layout)
    state_group, latent_group = (g.group_id for g in manager.groups)
    rng = random.Random(3)
    for i in range(60):  # short turns: a state saved every 64 tokens, freed at the end (cached, free)
        tokens = [rng.randrange(1, 100) for _ in range(200)]
        assert manager.allocate(f"short{i}", tokens)
        for done in (64, 128, 192, 200):
            manager.cache_blocks(f"short{i}", done)
            manager.take_pending_copies()
        manager.free(f"short{i}")
    owned_by_states = int((manager.pool.slab_owner == state_group).sum())
    assert owned_by_states >= layout.num_slabs // 3 and manager.pool.num_unowned == 0
    capacity = layout.groups[latent_group].pages_per_slab * (layout.num_slabs - 2) * 16
    long_prompt = [rng.randrange(1, 100) for _ in range(capacity - 64)]
    assert manager.allocate("long", long_prompt)
    assert int((manager.pool.slab_owner == state_group).sum()) == 1  # only the long request's running state
    assert manager.pool.slab_trades >= owned_by_states - 1
    manager.check_invariants()


def test_window_pages_of_a_long_conversation_give_their_slabs_to_its_full_attention_pages():
    """Gemma-style: a session's sliding-window pages leave the window as it grows (cached, free); the
    full-attention pages of the next turn take their slabs when the pool is full."""
    layout = build_layout(preset_config("tiny-sliding"), 16, memory_bytes=128 << 10)
    manager = KVCacheManager.from_layout(layout)
    window_group = next(g.group_id for g in manager.groups if g.group.spec.hit_rule == "window")
    tokens: list[int] = []
    rng = random.Random(5)
    turn = 0
    while True:
        tokens = tokens + [rng.randrange(1, 100) for _ in range(200)]
        request = f"turn{turn}"
        hit = manager.lookup(tokens)
        if not manager.allocate(request, tokens, num_reserved_tokens=hit + 64):
            break
        done = manager.num_cached_tokens(request)
        while done < len(tokens):  # prefill in 64-token chunks, as the scheduler runs them
            done = min(len(tokens), done + 64)
            assert manager.reserve(request, done)
            manager.cache_blocks(request, done)
        manager.free(request)
        turn += 1
    assert manager.pool.slab_trades > 0 and turn > 3
    held_by_window = int((manager.pool.slab_owner == window_group).sum())
    assert held_by_window < layout.num_slabs // 4  # the full-attention pages hold most of the memory
    manager.check_invariants()
