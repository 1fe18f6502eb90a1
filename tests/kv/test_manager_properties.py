"""Property tests of agentjax/kv/manager.py: random lookup / allocate / append / cache / free / abort
over many requests that share random prefixes, checked after every operation against the pool's
invariants and a brute-force model of what is cached (built from the KV event stream).

Operation budget: each of the three state machines runs max_examples (50) x up to stateful_step_count
(120) steps; the test asserts that together they executed at least 10,000 manager operations.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from agentjax.kv import (BlockRemoved, BlockStored, FullAttentionSpec, KVCacheManager, RecurrentStateSpec,
                         SlidingWindowSpec, block_hashes)
from agentjax.kv.groups import PrefixGroup

BLOCK = 4
WINDOW = 8
CHECKPOINT = 8
OPERATIONS = {"count": 0}
DOCUMENTS = [tuple(np.random.default_rng(seed).integers(1, 6, 48).tolist()) for seed in range(3)]

prompts = st.builds(
    lambda doc, cut, tail: DOCUMENTS[doc][:cut] + tuple(tail),
    st.integers(0, len(DOCUMENTS) - 1), st.integers(0, 48), st.lists(st.integers(1, 3), max_size=12),
).filter(lambda p: len(p) > 0)


class ManagerMachine(RuleBasedStateMachine):
    """Drives one manager; `kinds` lists the hit rule of each group in group order."""

    kinds: tuple[str, ...] = ()

    def make_manager(self) -> KVCacheManager:
        raise NotImplementedError

    @initialize()
    def start(self):
        self.m = self.make_manager()
        self.tokens: dict[str, list[int]] = {}
        self.next_id = 0
        self.prefix_of_hash: dict[bytes, tuple[int, ...]] = {}
        self.cached = [set() for _ in self.kinds]  # per group: token prefixes the events say are cached

    # -- the brute-force model ------------------------------------------------------------------
    def learn(self, tokens):
        for i, h in enumerate(block_hashes(list(tokens), BLOCK)):
            self.prefix_of_hash[h] = tuple(tokens[:(i + 1) * BLOCK])

    def apply_events(self):
        for event in self.m.take_events():
            prefix = self.prefix_of_hash[event.block_hash]
            if isinstance(event, BlockStored):
                assert prefix not in self.cached[event.group]
                self.cached[event.group].add(prefix)
            else:
                assert isinstance(event, BlockRemoved)
                self.cached[event.group].remove(prefix)

    def group_serves(self, group, tokens, hit, cap):
        size = self.m.plan.groups[group].tokens_per_page
        kind = self.kinds[group]
        if kind == "checkpoint":
            return hit % size == 0 and (hit == 0 or tuple(tokens[:hit]) in self.cached[group])
        if hit % size and hit != cap:
            return False
        first = max(0, hit - WINDOW + 1) // size if kind == "window" else 0
        pages = range(first, -(-hit // size))
        return all(len(tokens) >= (j + 1) * size and tuple(tokens[:(j + 1) * size]) in self.cached[group]
                   for j in pages)

    def expected_hit(self, tokens):
        cap = len(tokens) - 1
        return next(h for h in range(cap, -1, -1)
                    if all(self.group_serves(g, tokens, h, cap) for g in range(len(self.kinds))))

    # -- rules --------------------------------------------------------------------------------
    @rule(prompt=prompts)
    def lookup(self, prompt):
        OPERATIONS["count"] += 1
        self.learn(prompt)
        assert self.m.lookup(list(prompt)) == self.expected_hit(prompt)
        self.check_runs(prompt)

    def check_runs(self, prompt):
        """A prefix group's leading run (remembered runs, then index reads) is what the index says now."""
        for group in self.m.groups:
            if isinstance(group, PrefixGroup):
                keys = group.page_keys(block_hashes(list(prompt), BLOCK))
                fresh = []
                for key in keys:
                    if group.index.get(key) is None:
                        break
                    fresh.append(group.index[key])
                assert group.cached_run(keys, len(keys)) == fresh

    @rule(prompt=prompts)
    def allocate(self, prompt):
        OPERATIONS["count"] += 1
        self.learn(prompt)
        req_id = f"r{self.next_id}"
        self.next_id += 1
        expected = self.expected_hit(prompt)
        fits = self.m.can_allocate(list(prompt))
        ok = self.m.allocate(req_id, list(prompt))
        assert ok == fits
        if ok:
            self.tokens[req_id] = list(prompt)
            assert self.m.num_cached_tokens(req_id) == expected

    def snapshot(self):
        m, pool = self.m, self.m.pool
        stats = m.stats()
        return (pool.eviction_order.live_pages_in_order().tolist(), [dict(index) for index in pool.cached],
                pool.ref_counts.tolist(), pool.num_free, pool.num_cached, list(m._pending_copies),
                list(m._pending_copy_sources), [stats[k] for k in ("queries", "hits", "evictions")])

    @rule(prompt=prompts)
    def failed_admission(self, prompt):
        """allocate, an append that cannot fit, free: the rollback leaves the state as before."""
        OPERATIONS["count"] += 3
        self.learn(prompt)
        before = self.snapshot()
        req_id = f"r{self.next_id}"
        self.next_id += 1
        if self.m.allocate(req_id, list(prompt)):
            assert self.m.append(req_id, [7] * (self.m.pool.num_pages * 64)) is False
            self.m.check_invariants()
            self.m.free(req_id)
        assert self.snapshot() == before

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), count=st.integers(1, 6))
    def append(self, data, count):
        OPERATIONS["count"] += 1
        req_id = data.draw(st.sampled_from(sorted(self.tokens)))
        new = [7] * count
        if self.m.append(req_id, new):
            self.tokens[req_id] += new
            self.learn(self.tokens[req_id])
        assert self.m.num_tokens(req_id) == len(self.tokens[req_id])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def cache_blocks(self, data):
        OPERATIONS["count"] += 1
        req_id = data.draw(st.sampled_from(sorted(self.tokens)))
        n = len(self.tokens[req_id])
        computed = data.draw(st.sampled_from(sorted({n, n // 2, 0, *range(0, n + 1, CHECKPOINT)})))
        self.m.cache_blocks(req_id, computed)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), abort=st.booleans())
    def free(self, data, abort):
        """Finish, or abort (free without ever caching: the same call, the engine's abort path)."""
        OPERATIONS["count"] += 1
        req_id = data.draw(st.sampled_from(sorted(self.tokens)))
        if not abort:  # a prefill in checkpoint-aligned chunks, then the tail
            for computed in [*range(CHECKPOINT, len(self.tokens[req_id]), CHECKPOINT), len(self.tokens[req_id])]:
                self.m.cache_blocks(req_id, computed)
        self.m.free(req_id)
        del self.tokens[req_id]

    @rule(key=st.integers(0, 2), prompt=prompts)
    def pin_prefix(self, key, prompt):
        """A branch pin (no expiry) on a prompt's cached prefix; a later pin of the key replaces it."""
        OPERATIONS["count"] += 1
        self.learn(prompt)
        self.m.pin_prefix(key, list(prompt))

    @rule(key=st.integers(0, 2))
    def unpin(self, key):
        OPERATIONS["count"] += 1
        self.m.unpin(key)

    @rule()
    def take_copies(self):
        OPERATIONS["count"] += 1
        for group, src, dst in self.m.take_pending_copies():
            assert self.kinds[group] == "checkpoint" and src != dst and 0 not in (src, dst)

    @invariant()
    def pool_and_model_agree(self):
        if not hasattr(self, "m"):
            return
        self.m.check_invariants()
        self.apply_events()
        pool = self.m.pool
        for group, prefixes in enumerate(self.cached):
            assert {self.prefix_of_hash[h] for h in pool.cached[group]} == prefixes
        stats = self.m.stats()
        assert stats["free_blocks"] + stats["used_blocks"] == pool.num_pages - 1
        order = pool.eviction_order.live_pages_in_order()  # every free page exactly once, pinned last
        assert sorted(order.tolist()) == np.flatnonzero(pool.ref_counts == 0).tolist()
        pinned = pool.eviction_order.pins.count[order] > 0
        assert not (pinned[:-1] & ~pinned[1:]).any()
        for req_id, tokens in self.tokens.items():
            assert self.m.num_tokens(req_id) == len(tokens)


class HybridMachine(ManagerMachine):
    """Full + sliding window + recurrent state, deferred caching (the engine's mode), a tight pool."""

    kinds = ("prefix", "window", "checkpoint")

    def make_manager(self):
        specs = [FullAttentionSpec(num_kv_heads=1, head_dim=8, dtype_bytes=2),
                 SlidingWindowSpec(num_kv_heads=1, head_dim=8, dtype_bytes=2, sliding_window=WINDOW),
                 RecurrentStateSpec(bytes_per_state=100, checkpoint_interval=CHECKPOINT)]
        return KVCacheManager.from_specs(specs, 64, BLOCK, cache_on_allocate=False, enable_kv_events=True)


class FullAndSlidingMachine(ManagerMachine):
    """Full attention (8 tokens per page) + a two-layer sliding window (4 per page), one page size."""

    kinds = ("prefix", "window")

    def make_manager(self):
        sliding = SlidingWindowSpec(num_kv_heads=1, head_dim=8, dtype_bytes=2, sliding_window=WINDOW)
        specs = [FullAttentionSpec(num_kv_heads=1, head_dim=8, dtype_bytes=2), sliding, sliding]
        m = KVCacheManager.from_specs(specs, 40, BLOCK, cache_on_allocate=False, enable_kv_events=True)
        assert [g.tokens_per_page for g in m.plan.groups] == [8, 4]
        return m


class SingleGroupMachine(ManagerMachine):
    """The DESIGN.md section 3 manager: one full-attention group, pages cached on allocation."""

    kinds = ("prefix",)

    def make_manager(self):
        return KVCacheManager.full_attention(num_blocks=24, block_size=BLOCK, enable_kv_events=True)


SETTINGS = settings(max_examples=50, stateful_step_count=120, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.mark.slow
def test_random_operations_keep_invariants_and_match_the_brute_force_model():
    before = OPERATIONS["count"]
    run_state_machine_as_test(HybridMachine, settings=SETTINGS)
    run_state_machine_as_test(FullAndSlidingMachine, settings=SETTINGS)
    run_state_machine_as_test(SingleGroupMachine, settings=SETTINGS)
    assert OPERATIONS["count"] - before >= 10_000, OPERATIONS["count"] - before
