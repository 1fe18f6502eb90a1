"""The hybrid KV cache manager: which pages hold a request's tokens, in every KV group, from one pool.

Host only: never imports jax, never touches device memory. The scheduler drives it:

    m = KVCacheManager.from_model_config(cfg, num_blocks, block_size, enable_caching=True)
    hit = m.lookup(prompt)                     # tokens of the longest cached prefix (no side effects)
    if m.can_allocate(prompt): m.allocate(req_id, prompt)   # reserve the whole prompt
    m.num_cached_tokens(req_id)                # tokens the allocation reused (compute from there)
    m.block_ids(req_id)                        # one page list per group (page 0 = null/padding)
    m.reserve_state_saves(req_id, start, end)  # pages for the states inside the next prefill chunk
    m.take_pending_copies()                    # (group, src, dst) state-page copies to run first
    m.cache_blocks(req_id, num_computed)       # after the device wrote KV: full pages become hittable
    m.append(req_id, new_token_ids) -> bool    # decode growth; False (no change) when out of pages
    m.end_turn(req_id, num_computed)           # keep the state the turn ended with hittable
    m.free(req_id)                             # finish or abort; cached pages stay hittable
    m.free(req_id, pin_session=sid, ttl_s=5.0) # end of a turn: keep the session's prefix for the next
    m.pin_prefix(key, fork_prompt); m.unpin(key)   # a subagent fork point, held until released
    m.stats(); m.take_events()

With `cache_on_allocate=True` (the default of the single-group `full_attention` constructor used by
benchmarks) pages are offered to the cache as soon as they are allocated or appended, as if the
device had already written them. `from_model_config` defaults to False: call `cache_blocks`.

Transactional admission: until a request is committed (its first `append`, `block_ids`, ...), `free`
rolls its admission back exactly (agentjax/kv/admission_undo.py).

Session and branch pins live in the pool's eviction order, in its pin table (agentjax/kv/pins.py):
pinned free pages are evicted after every unpinned free page, earliest expiry first; they count as
free. `clock` (default `time.monotonic`) times the pins' `ttl_s`; tests inject their own. The offload
connector and the engine read the manager through its public lookups and capacity reads
(agentjax/kv/manager_lookup.py, manager_reads.py); only the scheduler drives the request lifecycle.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence

import numpy as np

from agentjax.errors import InvalidRequestError
from agentjax.kv.admission_undo import roll_back
from agentjax.kv.block_pool import BlockPool
from agentjax.kv.eviction import EvictionOrder
from agentjax.kv.pinned_order import PinnedEvictionOrder
from agentjax.kv.groups import CheckpointGroup, GroupManager, make_group_manager
from agentjax.kv.hashing import BlockHash, PrefixHashMemo, chain_hashes, tokens_as_uint32
from agentjax.kv.manager_lookup import PrefixLookupMixin
from agentjax.kv.manager_reads import CapacityReadsMixin
from agentjax.kv.manager_states import RecurrentStateMixin
from agentjax.kv.requests import AdmissionUndo, RequestKV, TokenBuffer
from agentjax.kv.slab_pool import SlabPool
from agentjax.kv.cache_layout import specs_from_model_config
from agentjax.kv.specs import FullAttentionSpec, KVGroupPlan, KVSpec, plan_groups
from agentjax.kv.state_saves import cache_saves
from agentjax.kv.turn_ends import TurnEnds, branch_point, save_branch_state, takes_turn_ends


class KVCacheManager(PrefixLookupMixin, CapacityReadsMixin, RecurrentStateMixin):
    """Pages for many requests across KV groups; see the module docstring for the call sequence."""

    def __init__(self, plan: KVGroupPlan, num_blocks: int, enable_caching: bool = True,
                 cache_on_allocate: bool = True, enable_kv_events: bool = False,
                 eviction_order: EvictionOrder | None = None, clock: Callable[[], float] | None = None,
                 slabs: tuple[int, Sequence[int]] | None = None, branch_states: bool = True):
        """`slabs` = (number of slabs, pages per slab of each group): a "pool" KV layout's pool, whose
        groups share memory by slabs (agentjax/kv/slab_pool.py); `num_blocks` is then ignored.
        `branch_states`: save a recurrent state where a prompt's cached prefix ends past every saved
        state (agentjax/kv/turn_ends.py; the scheduler ends a prefill chunk there)."""
        self.plan = plan
        self.block_size = plan.hash_block_size
        self.enable_caching = enable_caching
        self.cache_on_allocate = cache_on_allocate
        if eviction_order is None:
            eviction_order = PinnedEvictionOrder(clock or time.monotonic)
        self.clock = clock or getattr(eviction_order, "clock", time.monotonic)
        if slabs is None:
            self.pool = BlockPool(num_blocks, len(plan.groups), eviction_order, enable_kv_events)
        else:
            bounded = [group.spec.hit_rule != "prefix" for group in plan.groups]
            self.pool = SlabPool(slabs[0], slabs[1], eviction_order, enable_kv_events, bounded)
        self.layout = None  # the KVMemoryLayout this manager was built from (`from_layout`), if any
        managers = [make_group_manager(group, self.pool, self.block_size) for group in plan.groups]
        self.groups: list[GroupManager] = managers
        # Prefix groups first: full attention sets the upper bound, the others only shrink it.
        self._hit_order = sorted(self.groups, key=lambda g: g.group.spec.hit_rule != "prefix")
        self._memo = PrefixHashMemo(self.block_size)
        # End-of-turn states and partial pages, hittable by the next turn (agentjax/kv/turn_ends.py).
        self.turn_ends = TurnEnds(self.block_size, self.pool.num_pages) if (
            enable_caching and takes_turn_ends(managers)) else None
        self._roots: dict[str | None, BlockHash] = {}
        self._requests: dict[str, RequestKV] = {}
        self._last_prepared: tuple | None = None
        self._pending_copies: list[tuple[int, int, int]] = []
        self._pending_copy_sources: list[int] = []
        self._uncommitted_with_copies: set[str] = set()
        self.queries = self.hits = self.lookups = 0
        self.rollbacks = 0
        # Prompt tokens each group alone could serve (the hit is the least: where hits are lost), and the
        # tokens served through a turn end's state.
        self.group_hits = [0] * len(managers)
        self.turn_end_hits = 0
        self.branch_states = branch_states
        self.branch_states_saved = 0

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
                          checkpoint_interval: int | None = None, draft_config=None, **options) -> "KVCacheManager":
        """Groups from an `agentjax.config.ModelConfig`. With the default `scale_tokens_per_page=False`
        every group's pages hold `block_size` tokens, so page ids index `cfg.new_kv_pages` directly.
        Recurrent states are saved every `checkpoint_interval` tokens (whole pages; default: the model's
        `cost_aware_checkpoint_tokens`, as the engine's layout). A `draft_config` (speculative decoding's
        draft model) adds its own groups after the model's."""
        from agentjax.kv.cache_layout import checkpoint_tokens, cost_aware_checkpoint_tokens

        interval = (checkpoint_tokens(block_size, checkpoint_interval) if checkpoint_interval
                    else cost_aware_checkpoint_tokens(cfg, block_size))
        specs = specs_from_model_config(cfg, interval)
        if draft_config is not None:
            specs += specs_from_model_config(draft_config, interval, owner=1)
        return cls.from_specs(specs, num_blocks, block_size, enable_caching,
                              scale_tokens_per_page, cache_on_allocate=cache_on_allocate, **options)

    @classmethod
    def from_layout(cls, layout, enable_caching: bool = True, cache_on_allocate: bool = False,
                    **options) -> "KVCacheManager":
        """The manager of a `agentjax.kv.layout.KVMemoryLayout`: its page groups, over a slab pool
        ("pool") or one page-id space of `layout.num_slabs` pages ("shared")."""
        slabs = None if layout.mode == "shared" else (layout.num_slabs, [g.pages_per_slab for g in layout.groups])
        manager = cls(layout.manager_plan(), layout.num_slabs, enable_caching=enable_caching,
                      cache_on_allocate=cache_on_allocate, slabs=slabs, **options)
        manager.layout = layout
        return manager

    # -- request lifecycle -----------------------------------------------------------------------
    def allocate(self, req_id: str, token_ids: Sequence[int], cache_salt: str | None = None,
                 num_reserved_tokens: int | None = None) -> bool:
        """Reserve pages for all of `token_ids`, reusing cached ones; False (no change) if they do not fit.

        With `num_reserved_tokens`, sliding-window groups reserve pages only for the first that many
        tokens (the first prefill chunk): their later pages come from `reserve` as chunks run, while
        pages behind the window are released, so a window group never holds the whole prompt.
        """
        if req_id in self._requests:
            raise InvalidRequestError(f"request {req_id!r} already holds pages; free it first")
        tokens, hashes, hit, reuse = self.prepare(token_ids, cache_salt)
        pool = self.pool
        reused = self._reused_array(reuse)
        was_free = reused[pool.ref_counts[reused] == 0] if len(reused) else reused  # a hit takes them out
        new = self._new_pages(reuse, len(tokens), num_reserved_tokens)
        if pool.num_groups_share_ids:
            if sum(new) + len(was_free) > pool.num_free:
                return False
        elif not pool.can_take(dict(enumerate(new)), touched=was_free):
            return False
        order = pool.eviction_order
        undo = AdmissionUndo(was_free, order.positions(was_free), num_tokens=len(tokens), num_hit=hit)
        pool.touch(reused)
        group_pages, taken_arrays, positions = pool.take(new, undo.evicted, undo.slab_moves)
        undo.new_pages += taken_arrays
        undo.new_positions += positions
        tables = []
        for group, (pages, start), count, new_pages in zip(self.groups, reuse, new, group_pages):
            taken = 0
            if isinstance(group, CheckpointGroup):
                if pages:  # restore the checkpoint into the running page, then let the source go
                    copy = (group.group_id, pages[0], new_pages[taken])
                    self._pending_copies.append(copy)
                    self._pending_copy_sources.append(pages[0])
                    undo.copies.append(copy)
                    undo.copy_sources.append(pages[0])
                    self._uncommitted_with_copies.add(req_id)
                table = group.build_table(start, [], new_pages)
                table.last_checkpoint = hit // group.tokens_per_page * group.tokens_per_page if pages else 0
            else:
                table = group.build_table(start, pages, new_pages)
            tables.append(table)
        for group_id, source in getattr(reuse, "tails", ()):  # a turn end's partial page: a copy of its own
            copy = (group_id, source, tables[group_id].pages[len(reuse[group_id][0])])
            self._pending_copies.append(copy)
            self._pending_copy_sources.append(source)
            undo.copies.append(copy)
            undo.copy_sources.append(source)
            self._uncommitted_with_copies.add(req_id)
        request = RequestKV(req_id, TokenBuffer(tokens), self._root(cache_salt), list(hashes), tables, hit, undo=undo)
        self._requests[req_id] = request
        self.queries += len(tokens)
        self.hits += hit
        undo.group_hits = self._count_group_hits(hashes, len(tokens), hit)
        request.branch_point = branch_point(self, undo.group_hits, hit)
        undo.turn_end_hit = hit if getattr(reuse, "tails", None) is not None else 0
        self.turn_end_hits += undo.turn_end_hit
        if self.cache_on_allocate:
            self._cache_blocks(request, len(tokens))
        return True

    def append(self, req_id: str, new_token_ids: Sequence[int]) -> bool:
        """Extend a request by generated tokens; False (and no change) when the pool is too small."""
        request = self._request(req_id)
        new_tokens = tokens_as_uint32(new_token_ids)
        total = request.tokens.size + len(new_tokens)
        growth = [g.grow(t, total) for g, t in zip(self.groups, request.tables)]
        if not self._can_grow(growth):
            return False
        request.undo = None  # the first successful append commits the admission
        request.tokens.extend(new_tokens)
        self._grow_tables(request, growth)
        if self.cache_on_allocate:
            self._cache_blocks(request, total)
        return True

    def reserve(self, req_id: str, num_tokens: int, num_lookahead_tokens: int = 0, num_draft_states: int = 0) -> bool:
        """Make every group's table cover the request's first `num_tokens` tokens (the next chunk's
        pages of a window group reserved lazily) and `num_lookahead_tokens` positions after them (draft
        tokens of speculative decoding: the device writes their KV before they are known to stay), and
        give each recurrent-state group `num_draft_states` pages after the running one (the states after
        each draft token); False (and no change) when the pool is too small. Commits the admission."""
        request = self._request(req_id)
        if not 0 < num_tokens <= request.tokens.size:
            raise InvalidRequestError(f"num_tokens={num_tokens} outside [1, {request.tokens.size}] for {req_id!r}")
        if num_lookahead_tokens < 0 or num_draft_states < 0:
            raise InvalidRequestError(f"num_lookahead_tokens and num_draft_states must be >= 0, got "
                                      f"{num_lookahead_tokens} and {num_draft_states}")
        growth = [max(0, 1 + num_draft_states - len(t.pages)) if isinstance(g, CheckpointGroup)
                  else g.grow(t, num_tokens + num_lookahead_tokens) for g, t in zip(self.groups, request.tables)]
        if not self._can_grow(growth):
            return False
        request.undo = None
        self._grow_tables(request, growth)
        return True

    def _can_grow(self, growth: list[int]) -> bool:
        if self.pool.num_groups_share_ids:
            return sum(growth) <= self.pool.num_free
        return self.pool.can_take(dict(enumerate(growth)))

    def _grow_tables(self, request: RequestKV, growth: list[int]) -> None:
        """Append `growth[g]` new pages to the request's table of each group g (room already checked)."""
        if sum(growth):
            group_pages, _, _ = self.pool.take(growth)
            for table, pages in zip(request.tables, group_pages):
                table.own_pages(len(table.pages)).extend(pages)

    def release_lookahead(self, req_id: str, accepted_drafts: int = 0) -> int:
        """Give back each group's trailing pages that hold neither one of the request's tokens nor the
        position right after them (pages reserved for draft tokens that were rejected; never cached, as
        their hashes would come from the request's tokens, which never held the rejected drafts). A
        recurrent-state group keeps the state after the last accepted draft (page `accepted_drafts` of
        its table) as its running page and gives back the others. Returns how many pages went back."""
        request = self._request(req_id)
        released: list[int] = []
        for group, table in zip(self.groups, request.tables):
            if isinstance(group, CheckpointGroup):
                if len(table.pages) > 1 and not table.save_points:  # save pages leave in cache_blocks
                    kept = table.pages[min(accepted_drafts, len(table.pages) - 1)]
                    released += [page for page in table.pages if page != kept]
                    table.pages = [kept]
                continue
            keep = max(group.num_pages_for(request.tokens.size + 1), table.num_cached_pages)
            while len(table.pages) > keep:
                released.append(table.own_pages(len(table.pages) - 1).pop())
        if released:
            request.undo = None
            self.pool.release(np.asarray(released, dtype=np.int64))
        return len(released)

    def cache_blocks(self, req_id: str, num_computed_tokens: int) -> None:
        """The device has written KV for the first `num_computed_tokens` tokens: make full pages
        hittable, save a due state checkpoint, and release sliding-window pages no query reads.
        With `num_computed_tokens > 0` it commits the admission (see the module docstring)."""
        request = self._request(req_id)
        if not 0 <= num_computed_tokens <= request.tokens.size:
            raise InvalidRequestError(
                f"num_computed_tokens={num_computed_tokens} outside [0, {request.tokens.size}] for {req_id!r}")
        if num_computed_tokens > 0:
            request.undo = None
        self._cache_blocks(request, num_computed_tokens)

    def _cache_blocks(self, request: RequestKV, num_computed_tokens: int) -> None:
        request.num_computed = max(request.num_computed, num_computed_tokens)
        if self.enable_caching:
            self._extend_hashes(request, num_computed_tokens)
            for group, table in zip(self.groups, request.tables):
                keys = group.page_keys(request.hashes)
                if isinstance(group, CheckpointGroup):
                    cache_saves(group, table, keys, num_computed_tokens, self.pool)
                    saved = self._save_checkpoint(group, table, keys, num_computed_tokens)
                    if num_computed_tokens == request.branch_point > 0:
                        saved |= save_branch_state(self, request, group, table, keys)
                    if saved:
                        request.undo = None  # a page went through the free set: no exact undo any more
                else:
                    group.cache_full_pages(table, keys, num_computed_tokens, request.tokens_of_page(group))
        released: list[int] = []
        for group, table in zip(self.groups, request.tables):
            released += group.pages_out_of_window(table, request.num_computed)
        if released:
            request.undo = None  # released pages may be taken by others at once: no exact undo any more
            self.pool.release(np.asarray(released, dtype=np.int64))

    def _extend_hashes(self, request: RequestKV, num_tokens: int) -> None:
        have, want = len(request.hashes), num_tokens // self.block_size
        if want > have:
            parent = request.hashes[-1] if have else request.root
            token_bytes = request.tokens.view()[have * self.block_size:want * self.block_size].tobytes()
            request.hashes += chain_hashes(token_bytes, self.block_size, parent, 0, want - have)

    def free(self, req_id: str, pin_session: Hashable | None = None, ttl_s: float | None = None,
             now: float | None = None) -> None:
        """Release a finished or aborted request; its cached pages stay hittable until evicted.

        An uncommitted request is rolled back exactly (see the module docstring). With `pin_session`,
        the request's cached prefix pages are first pinned under that key (replacing its previous
        pin set) for `ttl_s` seconds of `clock` (None: until `unpin`); that commits the request.
        """
        request = self._request(req_id)
        if pin_session is not None:
            self.pin_request(pin_session, req_id, ttl_s=ttl_s, now=now)
            request.undo = None
        del self._requests[req_id]
        if request.undo is not None:
            roll_back(self, request, request.undo)
            return
        order = self.release_order(request)
        self.pool.release(np.asarray(order, dtype=np.int64))
        if self.enable_caching and request.hashes:
            self._memo.remember(request.hashes[0], request.tokens.view(), request.hashes)

    def release_order(self, request: RequestKV) -> list[int]:
        """Every group's pages of the request, each group's tail first (the order they should be evicted)."""
        order: list[int] = []
        for group, table in zip(self.groups, request.tables):
            order += group.release_order(table)
        return order

    # -- what the engine reads -------------------------------------------------------------------
    def _request(self, req_id: str) -> RequestKV:
        request = self._requests.get(req_id)
        if request is None:
            raise InvalidRequestError(f"unknown request {req_id!r}")
        return request

    def block_ids(self, req_id: str) -> list[list[int]]:
        """One page list per group (group order of `plan.groups`); a checkpoint group lists its running page.
        The device may now write these pages, so this commits the admission. The lists are the tables
        themselves, not copies: the manager never edits a list it handed out (`GroupTable.own_pages`), so
        they stay as they are, and a table that did not change since the last step costs nothing."""
        request = self._request(req_id)
        request.undo = None
        for table in request.tables:
            table.handed_out = True
        return [table.pages for table in request.tables]

    def num_cached_tokens(self, req_id: str) -> int:
        return self._request(req_id).num_cached_tokens

    def num_tokens(self, req_id: str) -> int:
        return self._request(req_id).tokens.size

    def take_pending_copies(self) -> list[tuple[int, int, int]]:
        """(group, source page, destination page) copies the device must run before the next step."""
        copies, self._pending_copies = self._pending_copies, []
        for req_id in self._uncommitted_with_copies:  # the device writes their running pages: committed
            request = self._requests.get(req_id)
            if request is not None:
                request.undo = None
        self._uncommitted_with_copies.clear()
        for source in self._pending_copy_sources:  # one at a time: several requests may share a source
            self.pool.release(np.asarray([source], dtype=np.int64))
        self._pending_copy_sources = []
        return copies
