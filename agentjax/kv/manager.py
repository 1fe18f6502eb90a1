"""The hybrid KV cache manager: which pages hold a request's tokens, in every KV group, from one pool.

Host only: never imports jax, never touches device memory. The engine drives it:

    m = KVCacheManager.from_model_config(cfg, num_blocks, block_size, enable_caching=True)
    hit = m.lookup(prompt)                     # tokens of the longest cached prefix (no side effects)
    if m.can_allocate(prompt): m.allocate(req_id, prompt)   # reserve the whole prompt
    m.num_cached_tokens(req_id)                # tokens the allocation reused (compute from there)
    m.block_ids(req_id)                        # one page list per group (page 0 = null/padding)
    m.take_pending_copies()                    # (group, src, dst) state-page copies to run first
    m.cache_blocks(req_id, num_computed)       # after the device wrote KV: full pages become hittable
    m.append(req_id, new_token_ids) -> bool    # decode growth; False (no change) when out of pages
    m.free(req_id)                             # finish or abort; cached pages stay hittable
    m.stats(); m.take_events()

With `cache_on_allocate=True` (the default of the single-group `full_attention` constructor used by
benchmarks) pages are offered to the cache as soon as they are allocated or appended, as if the
device had already written them. `from_model_config` defaults to False: call `cache_blocks`.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from agentjax.errors import InvalidRequestError, OutOfPagesError
from agentjax.kv.block_pool import BlockPool, EvictionOrder
from agentjax.kv.groups import CheckpointGroup, GroupManager, GroupTable, make_group_manager
from agentjax.kv.hashing import BlockHash, PrefixHashMemo, chain_hashes, root_hash, tokens_as_uint32
from agentjax.kv.requests import RequestKV, TokenBuffer
from agentjax.kv.specs import FullAttentionSpec, KVGroupPlan, KVSpec, plan_groups, specs_from_model_config

logger = logging.getLogger(__name__)


class KVCacheManager:
    """Pages for many requests across KV groups; see the module docstring for the call sequence."""

    def __init__(self, plan: KVGroupPlan, num_blocks: int, enable_caching: bool = True,
                 cache_on_allocate: bool = True, enable_kv_events: bool = False,
                 eviction_order: EvictionOrder | None = None):
        self.plan = plan
        self.block_size = plan.hash_block_size
        self.enable_caching = enable_caching
        self.cache_on_allocate = cache_on_allocate
        self.pool = BlockPool(num_blocks, len(plan.groups), eviction_order, enable_kv_events)
        managers = [make_group_manager(group, self.pool, self.block_size) for group in plan.groups]
        self.groups: list[GroupManager] = managers
        # Prefix groups first: full attention sets the upper bound, the others only shrink it.
        self._hit_order = sorted(self.groups, key=lambda g: g.group.spec.hit_rule != "prefix")
        self._memo = PrefixHashMemo(self.block_size)
        self._roots: dict[str | None, BlockHash] = {}
        self._requests: dict[str, RequestKV] = {}
        self._last_prepared: tuple | None = None
        self._pending_copies: list[tuple[int, int, int]] = []
        self._pending_copy_sources: list[int] = []
        self.queries = self.hits = self.lookups = 0

    # -- constructors ----------------------------------------------------------------------------
    @classmethod
    def full_attention(cls, num_blocks: int, block_size: int = 16, enable_caching: bool = True,
                       **options) -> "KVCacheManager":
        """One full-attention group (DESIGN.md section 3); pages are cached as they are allocated."""
        plan = plan_groups([FullAttentionSpec()], block_size)
        return cls(plan, num_blocks, enable_caching=enable_caching, **options)

    @classmethod
    def from_specs(cls, layer_specs: Sequence[KVSpec], num_blocks: int, block_size: int,
                   enable_caching: bool = True, scale_tokens_per_page: bool = True, **options) -> "KVCacheManager":
        return cls(plan_groups(layer_specs, block_size, scale_tokens_per_page), num_blocks,
                   enable_caching=enable_caching, **options)

    @classmethod
    def from_model_config(cls, cfg, num_blocks: int, block_size: int, enable_caching: bool = True,
                          cache_on_allocate: bool = False, scale_tokens_per_page: bool = False,
                          **options) -> "KVCacheManager":
        """Groups from an `agentjax.config.ModelConfig`. With the default `scale_tokens_per_page=False`
        every group's pages hold `block_size` tokens, so page ids index `cfg.new_kv_pages` directly."""
        return cls.from_specs(specs_from_model_config(cfg), num_blocks, block_size, enable_caching,
                              scale_tokens_per_page, cache_on_allocate=cache_on_allocate, **options)

    # -- prefix lookup ---------------------------------------------------------------------------
    def _root(self, cache_salt: str | None) -> BlockHash:
        root = self._roots.get(cache_salt)
        if root is None:
            root = self._roots[cache_salt] = root_hash(cache_salt)
        return root

    def _prepare(self, token_ids, cache_salt: str | None):
        """(tokens, hashes, hit, per-group (reused pages, table start)) for a prompt, memoised for
        the same token list object until the pool changes (lookup then allocate costs one pass)."""
        last = self._last_prepared
        if (last is not None and last[0] is token_ids and last[1] == len(token_ids) and last[2] == cache_salt
                and last[3] == self.pool.version):
            return last[4]
        tokens = tokens_as_uint32(token_ids)
        if len(tokens) == 0:
            raise InvalidRequestError("token_ids is empty; a request needs at least one token")
        if self.enable_caching:
            hashes = self._memo.hashes(tokens, self._root(cache_salt))
            hit, reuse = self._find_hit(hashes, len(tokens))
        else:
            hashes, hit, reuse = [], 0, [([], 0)] * len(self.groups)
        prepared = (tokens, hashes, hit, reuse)
        self._last_prepared = (token_ids, len(token_ids), cache_salt, self.pool.version, prepared)
        return prepared

    def _find_hit(self, hashes: list[BlockHash], num_tokens: int) -> tuple[int, list]:
        """The fixed point: each group may only shrink the hit until all of them accept it."""
        keys = {g.group_id: g.page_keys(hashes) for g in self.groups}
        cap = hit = num_tokens - 1
        accepted: dict[int, int] = {}
        while hit > 0 and len(accepted) < len(self.groups):
            for group in self._hit_order:
                if accepted.get(group.group_id) == hit:
                    continue
                found = group.find_hit(keys[group.group_id], hit, cap)
                if found != hit:
                    accepted.clear()
                    hit = found
                    if hit == 0:
                        break
                accepted[group.group_id] = hit
        hit = max(hit, 0)
        return hit, [g.reused_pages(keys[g.group_id], hit) for g in self.groups]

    def lookup(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Tokens of the longest cached prefix that every group can serve; never the last token."""
        self.lookups += 1
        return self._prepare(token_ids, cache_salt)[2]

    def _pages_needed(self, reuse: list, num_tokens: int) -> tuple[int, int]:
        new = sum(g.num_new_pages(start, len(pages), num_tokens) for g, (pages, start) in zip(self.groups, reuse))
        reused = [page for pages, _ in reuse for page in pages]
        return new, self.pool.count_free_among(np.asarray(reused, dtype=np.int64))

    def can_allocate(self, token_ids: Sequence[int], cache_salt: str | None = None) -> bool:
        """Whether `allocate` would succeed now (no side effects)."""
        _, _, _, reuse = self._prepare(token_ids, cache_salt)
        new, reused_free = self._pages_needed(reuse, len(token_ids))
        return new + reused_free <= self.pool.num_free

    # -- request lifecycle -----------------------------------------------------------------------
    def allocate(self, req_id: str, token_ids: Sequence[int], cache_salt: str | None = None) -> bool:
        """Reserve pages for all of `token_ids`, reusing cached ones; False (no change) if they do not fit."""
        if req_id in self._requests:
            raise InvalidRequestError(f"request {req_id!r} already holds pages; free it first")
        tokens, hashes, hit, reuse = self._prepare(token_ids, cache_salt)
        new, reused_free = self._pages_needed(reuse, len(tokens))
        if new + reused_free > self.pool.num_free:
            return False
        pool = self.pool
        pool.touch(np.asarray([p for pages, _ in reuse for p in pages], dtype=np.int64))
        new_pages = pool.allocate(new).tolist()
        tables, taken = [], 0
        for group, (pages, start) in zip(self.groups, reuse):
            count = group.num_new_pages(start, len(pages), len(tokens))
            if isinstance(group, CheckpointGroup):
                if pages:  # restore the checkpoint into the running page, then let the source go
                    self._pending_copies.append((group.group_id, pages[0], new_pages[taken]))
                    self._pending_copy_sources.append(pages[0])
                table = group.build_table(start, [], new_pages[taken:taken + count])
                table.last_checkpoint = hit // group.tokens_per_page * group.tokens_per_page if pages else 0
            else:
                table = group.build_table(start, pages, new_pages[taken:taken + count])
            tables.append(table)
            taken += count
        request = RequestKV(req_id, TokenBuffer(tokens), self._root(cache_salt), list(hashes), tables, hit)
        self._requests[req_id] = request
        self._last_prepared = None
        self.queries += len(tokens)
        self.hits += hit
        if self.cache_on_allocate:
            self.cache_blocks(req_id, len(tokens))
        return True

    def append(self, req_id: str, new_token_ids: Sequence[int]) -> bool:
        """Extend a request by generated tokens; False (and no change) when the pool is too small."""
        request = self._request(req_id)
        new_tokens = tokens_as_uint32(new_token_ids)
        total = request.tokens.size + len(new_tokens)
        growth = [g.grow(t, total) for g, t in zip(self.groups, request.tables)]
        if sum(growth) > self.pool.num_free:
            return False
        request.tokens.extend(new_tokens)
        if sum(growth):
            new_pages = self.pool.allocate(sum(growth)).tolist()
            taken = 0
            for table, count in zip(request.tables, growth):
                table.pages.extend(new_pages[taken:taken + count])
                taken += count
        if self.cache_on_allocate:
            self.cache_blocks(req_id, total)
        return True

    def cache_blocks(self, req_id: str, num_computed_tokens: int) -> None:
        """The device has written KV for the first `num_computed_tokens` tokens: make full pages
        hittable, save a due state checkpoint, and release sliding-window pages no query reads."""
        request = self._request(req_id)
        if not 0 <= num_computed_tokens <= request.tokens.size:
            raise InvalidRequestError(
                f"num_computed_tokens={num_computed_tokens} outside [0, {request.tokens.size}] for {req_id!r}")
        request.num_computed = max(request.num_computed, num_computed_tokens)
        if self.enable_caching:
            self._extend_hashes(request, num_computed_tokens)
            for group, table in zip(self.groups, request.tables):
                keys = group.page_keys(request.hashes)
                if isinstance(group, CheckpointGroup):
                    self._save_checkpoint(group, table, keys, num_computed_tokens)
                else:
                    group.cache_full_pages(table, keys, num_computed_tokens, request.tokens_of_page(group))
        released: list[int] = []
        for group, table in zip(self.groups, request.tables):
            released += group.pages_out_of_window(table, request.num_computed)
        if released:
            self.pool.release(np.asarray(released, dtype=np.int64))

    def _save_checkpoint(self, group: CheckpointGroup, table: GroupTable, keys: list[BlockHash],
                         num_computed: int) -> None:
        key = group.checkpoint_key(keys, num_computed)
        if key is None or num_computed <= table.last_checkpoint:
            return
        table.last_checkpoint = num_computed
        if self.pool.num_free == 0:
            logger.debug("no free page for a checkpoint at %d tokens; skipped", num_computed)
            return
        page = int(self.pool.allocate(1)[0])
        self._pending_copies.append((group.group_id, table.pages[0], page))
        index = num_computed // group.tokens_per_page - 1
        self.pool.cache_page(page, group.group_id, key, keys[index - 1] if index else None)
        self.pool.release(np.asarray([page]))

    def _extend_hashes(self, request: RequestKV, num_tokens: int) -> None:
        have, want = len(request.hashes), num_tokens // self.block_size
        if want > have:
            parent = request.hashes[-1] if have else request.root
            token_bytes = request.tokens.view()[:want * self.block_size].tobytes()
            request.hashes += chain_hashes(token_bytes, self.block_size, parent, have, want)

    def free(self, req_id: str) -> None:
        """Release a finished or aborted request; its cached pages stay hittable until evicted."""
        request = self._requests.pop(req_id, None)
        if request is None:
            raise InvalidRequestError(f"unknown request {req_id!r}")
        order = [page for group, table in zip(self.groups, request.tables) for page in group.release_order(table)]
        self.pool.release(np.asarray(order, dtype=np.int64))
        if self.enable_caching and request.hashes:
            self._memo.remember(request.hashes[0], request.tokens.view(), request.hashes)
        self._last_prepared = None

    # -- what the engine reads -------------------------------------------------------------------
    def _request(self, req_id: str) -> RequestKV:
        request = self._requests.get(req_id)
        if request is None:
            raise InvalidRequestError(f"unknown request {req_id!r}")
        return request

    def block_ids(self, req_id: str) -> list[list[int]]:
        """One page list per group (group order of `plan.groups`); a checkpoint group lists its running page."""
        return [list(table.pages) for table in self._request(req_id).tables]

    def num_cached_tokens(self, req_id: str) -> int:
        return self._request(req_id).num_cached_tokens

    def num_tokens(self, req_id: str) -> int:
        return self._request(req_id).tokens.size

    def take_pending_copies(self) -> list[tuple[int, int, int]]:
        """(group, source page, destination page) copies the device must run before the next step."""
        copies, self._pending_copies = self._pending_copies, []
        for source in self._pending_copy_sources:  # one at a time: several requests may share a source
            self.pool.release(np.asarray([source], dtype=np.int64))
        self._pending_copy_sources = []
        return copies

    def take_events(self):
        return self.pool.take_events()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def stats(self) -> dict:
        pool = self.pool
        return {
            "num_blocks": pool.num_pages, "free_blocks": pool.num_free, "cached_blocks": pool.num_cached,
            "used_blocks": pool.num_pages - 1 - pool.num_free, "queries": self.queries, "hits": self.hits,
            "hit_rate": self.hits / self.queries if self.queries else 0.0, "lookups": self.lookups,
            "evictions": pool.evictions, "running_requests": len(self._requests),
            "blocks_hashed": self._memo.blocks_hashed, "blocks_hash_reused": self._memo.blocks_reused,
        }

    def check_invariants(self) -> None:
        """Raise AssertionError if page ownership and reference counts disagree (tests call this)."""
        self.pool.check_invariants()
        owners = np.zeros(self.pool.num_pages, dtype=np.int64)
        for request in self._requests.values():
            for table in request.tables:
                held = [p for p in table.pages if p != 0]
                assert len(held) == len(set(held)), f"{request.req_id} holds a page twice"
                np.add.at(owners, np.asarray(held, dtype=np.int64), 1)
        np.add.at(owners, np.asarray(self._pending_copy_sources, dtype=np.int64), 1)
        owners[0] = self.pool.ref_counts[0]
        mismatch = np.flatnonzero(owners != self.pool.ref_counts)
        assert mismatch.size == 0, f"ref counts differ from owners at pages {mismatch[:8].tolist()}"
