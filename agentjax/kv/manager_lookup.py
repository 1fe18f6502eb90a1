"""The KV manager's lookups: prefix hits, the pages that serve a prefix, pins, and what the offload
connector reads (mixed into `agentjax.kv.manager.KVCacheManager`, whose state it reads).

Every call here leaves the pages of running requests as they are: a lookup only reads the pool's
indexes, and a pin only orders evictions (the pool's pin table, agentjax/kv/pins.py). The offload
connector, store planner and prefetcher use this face, never the manager's private members.
Host only: never imports jax.
"""
from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import numpy as np

from agentjax.errors import InvalidRequestError
from agentjax.kv.groups import GroupManager
from agentjax.kv.hashing import BlockHash, block_hashes, root_hash, tokens_as_uint32
from agentjax.kv.requests import RequestKV

__all__ = ["PrefixLookupMixin", "flat_pages"]


class PrefixLookupMixin:
    """`KVCacheManager` methods that look up prefixes and pin pages (see the module docstring)."""

    def _root(self, cache_salt: str | None) -> BlockHash:
        root = self._roots.get(cache_salt)
        if root is None:
            root = self._roots[cache_salt] = root_hash(cache_salt)
        return root

    def prepare(self, token_ids, cache_salt: str | None = None) -> tuple:
        """(tokens, hashes, hit, per-group (reused pages, table start)) for a prompt, memoised for
        the same token list (the same object, or an equal list: the offload connector's check and the
        admission each build theirs): until the pool changes all four (lookup then allocate costs one
        pass), after that the tokens and hashes, which depend on the tokens alone (an admission tried
        again once pages are free only finds its hit again). A list is taken as unchanged while it is the
        same object of the same length: edit a copy, not a list already passed in."""
        last = self._last_prepared
        if last is not None and last[1] == len(token_ids) and last[2] == cache_salt and (
                last[0] is token_ids or type(token_ids) is list and type(last[0]) is list and last[0] == token_ids):
            if last[3] == self.pool.version:
                prepared = last[4]
            else:
                tokens, hashes = last[4][:2]
                prepared = (tokens, hashes, *self._hit(tokens, hashes, cache_salt))
            self._last_prepared = (token_ids, len(token_ids), cache_salt, self.pool.version, prepared)
            return prepared
        tokens = tokens_as_uint32(token_ids)
        if len(tokens) == 0:
            raise InvalidRequestError("token_ids is empty; a request needs at least one token")
        hashes = self._memo.hashes(tokens, self._root(cache_salt)) if self.enable_caching else []
        prepared = (tokens, hashes, *self._hit(tokens, hashes, cache_salt))
        self._last_prepared = (token_ids, len(token_ids), cache_salt, self.pool.version, prepared)
        return prepared

    def _find_hit_or_none(self, hashes: list[BlockHash], num_tokens: int) -> tuple[int, list]:
        """`find_hit`, or no hit at all when prefix caching is off."""
        if not self.enable_caching:
            return 0, [([], 0)] * len(self.groups)
        return self.find_hit(hashes, num_tokens)

    def find_hit(self, hashes: list[BlockHash], num_tokens: int,
                 groups: Sequence[GroupManager] | None = None) -> tuple[int, list]:
        """The fixed point: each group may only shrink the hit until all of them accept it. `groups`
        (default: this manager's) may read another index, e.g. the offload tiers' union with the pool's."""
        if groups is None:
            groups, hit_order = self.groups, self._hit_order
        else:
            hit_order = sorted(groups, key=lambda g: g.group.spec.hit_rule != "prefix")
        keys = {g.group_id: g.page_keys(hashes) for g in groups}
        cap = hit = num_tokens - 1
        accepted: dict[int, int] = {}
        while hit > 0 and len(accepted) < len(groups):
            for group in hit_order:
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
        return hit, [g.reused_pages(keys[g.group_id], hit) for g in groups]

    def lookup(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Tokens of the longest cached prefix that every group can serve; never the last token."""
        self.lookups += 1
        return self.prepare(token_ids, cache_salt)[2]

    def _reserved_tokens(self, group: GroupManager, num_tokens: int, num_reserved_tokens: int | None) -> int:
        """Tokens a group's table covers at admission: window groups only up to `num_reserved_tokens`
        (the first chunk; `reserve` grows them step by step), every other group the whole prompt."""
        if num_reserved_tokens is None or group.group.spec.hit_rule != "window":
            return num_tokens
        return min(num_tokens, num_reserved_tokens)

    def _new_pages(self, reuse: list, num_tokens: int, num_reserved_tokens: int | None = None) -> list[int]:
        """Pages an admission takes from the free set beyond the hit's (`reuse`), per group."""
        return [g.num_new_pages(start, len(pages), self._reserved_tokens(g, num_tokens, num_reserved_tokens))
                for g, (pages, start) in zip(self.groups, reuse)]

    def can_allocate(self, token_ids: Sequence[int], cache_salt: str | None = None,
                     num_reserved_tokens: int | None = None) -> bool:
        """Whether `allocate` would succeed now (no side effects)."""
        _, _, _, reuse = self.prepare(token_ids, cache_salt)
        new = self._new_pages(reuse, len(token_ids), num_reserved_tokens)
        if self.pool.num_groups_share_ids:
            return sum(new) + self.pool.count_free_among(self._reused_array(reuse)) <= self.pool.num_free
        return self.pool.can_take(dict(enumerate(new)), touched=self._reused_array(reuse))

    def _reused_array(self, reuse: list) -> np.ndarray:
        """`flat_pages(reuse)`; one group's run comes from the array its group keeps (converting a list of
        a thousand pages costs more than the rest of an admission that does not fit)."""
        if len(reuse) == 1 and not getattr(reuse, "tails", ()):
            return self.groups[0].page_array(reuse[0][0])
        return flat_pages(reuse)

    # -- session and branch pins -----------------------------------------------------------------
    def _pins(self):
        order = self.pool.eviction_order
        if not hasattr(order, "pin"):
            raise InvalidRequestError(
                f"the eviction order {type(order).__name__} has no pins; use PinnedEvictionOrder (the default)")
        return order

    def _expiry(self, ttl_s: float | None, expires_at: float | None, now: float | None) -> float | None:
        if ttl_s is not None and expires_at is not None:
            raise InvalidRequestError("pass ttl_s or expires_at, not both")
        if ttl_s is None:
            return expires_at
        if not ttl_s >= 0:
            raise InvalidRequestError(f"ttl_s must be >= 0 seconds, got {ttl_s}")
        return (self.clock() if now is None else now) + ttl_s

    def _serving_pages(self, hashes: list[BlockHash], num_tokens: int) -> list[int]:
        """Cached pages, in every group, that a later prompt extending these tokens would reuse."""
        return self._serving_pages_at(hashes, num_tokens)[0]

    def _serving_pages_at(self, hashes: list[BlockHash], num_tokens: int) -> tuple[list[int], list[int]]:
        """`_serving_pages` and each page's index in its group's page table."""
        if not self.enable_caching or not hashes:
            return [], []
        _, reuse = self.find_hit(hashes, num_tokens + 1)
        pages = [page for group_pages, _ in reuse for page in group_pages]
        positions = [start + i for group_pages, start in reuse for i in range(len(group_pages))]
        return pages, positions

    def serving_pages(self, req_id: str) -> tuple[list[int], list[int]]:
        """The cached pages that serve `req_id`'s computed prefix, in every group (what a session's next
        turn would reuse), and each page's index in its group's table (a KV policy's turn end)."""
        request = self._request(req_id)
        return self._serving_pages_at(request.hashes, len(request.hashes) * self.block_size)

    def block_hashes(self, req_id: str) -> list[BlockHash]:
        """The chained hashes of `req_id`'s full blocks so far (the keys the offload tiers store under)."""
        return self._request(req_id).hashes

    def pin(self, key: Hashable, pages: Sequence[int], expires_at: float | None = None) -> int:
        """Pin page ids under `key` until `expires_at` on `clock` (None: until `unpin(key)`),
        replacing `key`'s previous set; returns how many pages it pins."""
        return self._pins().pin(key, np.asarray(pages, dtype=np.int64), expires_at)

    def pin_request(self, key: Hashable, req_id: str, ttl_s: float | None = None,
                    expires_at: float | None = None, now: float | None = None) -> int:
        """Pin the cached pages that serve `req_id`'s computed prefix (a session between turns)."""
        request = self._request(req_id)
        expiry = self._expiry(ttl_s, expires_at, now)
        pages = self._serving_pages(request.hashes, len(request.hashes) * self.block_size)
        return self._pins().pin(key, np.asarray(pages, dtype=np.int64), expiry)

    def pin_prefix(self, key: Hashable, token_ids: Sequence[int], ttl_s: float | None = None,
                   expires_at: float | None = None, now: float | None = None, cache_salt: str | None = None) -> int:
        """Pin the cached pages of the longest cached prefix of `token_ids` (a subagent fork point)."""
        expiry = self._expiry(ttl_s, expires_at, now)
        tokens = tokens_as_uint32(token_ids)
        if len(tokens) == 0:
            raise InvalidRequestError("token_ids is empty; nothing to pin")
        hashes = self._memo.hashes(tokens, self._root(cache_salt), remember=False) if self.enable_caching else []
        pages = self._serving_pages(hashes, len(tokens))
        return self._pins().pin(key, np.asarray(pages, dtype=np.int64), expiry)

    def unpin(self, key: Hashable) -> int:
        """Release `key`'s pin now (a session_end hint, or the children of a fork are done)."""
        return self._pins().unpin(key)

    unpin_session = unpin

    # -- what the offload connector reads ----------------------------------------------------------
    def running(self, req_id: str) -> RequestKV | None:
        """The pages, tokens and block hashes of a running request (None if it holds no pages); read only."""
        return self._requests.get(req_id)

    def running_requests(self) -> list[RequestKV]:
        """Every running request's `RequestKV`, in admission order; read only."""
        return list(self._requests.values())

    def pages_being_written(self) -> set[int]:
        """Pages a pending copy (a checkpoint or turn-end state not yet copied on the device) writes."""
        return {dst for _, _, dst in self._pending_copies}

    def cached_index(self, group_id: int) -> Mapping:
        """The pool's index of `group_id`: block hash -> the cached page that holds it; read only."""
        return self.pool.cached[group_id]

    def page_keys(self, group_id: int, token_ids: Sequence[int], cache_salt: str | None = None) -> list[BlockHash]:
        """The keys the full pages of `token_ids` in group `group_id` are cached under (`cached_index`'s keys)."""
        return self.groups[group_id].page_keys(block_hashes(token_ids, self.block_size, cache_salt))

    @property
    def kv_policy(self):
        """The KV policy that orders evictions (`agentjax.kv.policy.KVPolicy`), or None for the plain
        pinned LRU order."""
        return getattr(self.pool.eviction_order, "policy", None)


def flat_pages(reuse: list) -> np.ndarray:
    """The pages of every group's (pages, start) in one int64 array (converted in C, not page by page),
    and the partial pages a turn-end hit copies."""
    tails = [page for _, page in getattr(reuse, "tails", ())]
    if len(reuse) == 1 and not tails:
        return np.asarray(reuse[0][0], dtype=np.int64)
    return np.concatenate([np.asarray(pages, dtype=np.int64) for pages, _ in reuse] + [np.asarray(tails, np.int64)])
