"""The KV manager's recurrent-state side: interval states inside a chunk, turn ends, branch states and
hits by group (mixed into `agentjax.kv.manager.KVCacheManager`, whose state it reads and writes).

The page logic lives in `agentjax/kv/state_saves.py` and `agentjax/kv/turn_ends.py`; this mixin is the
manager's API to them. Host only: never imports jax.
"""
from __future__ import annotations

import logging

import numpy as np

from agentjax.kv.groups import CheckpointGroup, GroupTable
from agentjax.kv.hashing import BlockHash
from agentjax.kv.state_saves import pool_has_room, reserve_saves
from agentjax.kv.turn_ends import save_turn_end, tail_hit

logger = logging.getLogger(__name__)


class HitPages(list):
    """Per group (cached pages, table start) of a hit, and `tails`: (group, partial page) copies a
    turn-end hit makes into the group's first new page."""

    tails: list[tuple[int, int]] = []


class RecurrentStateMixin:
    """`KVCacheManager` methods for recurrent states (see the module docstring)."""

    def _hit(self, tokens: np.ndarray, hashes: list[BlockHash], cache_salt: str | None) -> tuple[int, list]:
        """The hit and its pages per group, through a turn end where that hits more (the returned list
        then carries `tails`: the partial pages to copy, see agentjax/kv/turn_ends.py)."""
        hit, reuse = self._find_hit_or_none(hashes, len(tokens))
        if self.turn_ends is not None:
            longer, tail_reuse, tails = tail_hit(self, tokens, hashes, self._root(cache_salt), hit, reuse)
            if longer > hit:
                reuse = HitPages(tail_reuse)
                reuse.tails = tails
                return longer, reuse
        return hit, reuse

    def reserve_state_saves(self, req_id: str, start: int, end: int) -> int:
        """Pages for the recurrent states at the checkpoints strictly inside the chunk of tokens
        [start, end) the device runs next (`agentjax/kv/state_saves.py`); `cache_blocks` caches them
        once it ran. Best effort: a checkpoint no page is free for is skipped. Returns pages taken."""
        request = self._request(req_id)
        if not self.enable_caching or end - start < 2:
            return 0
        self._extend_hashes(request, end)
        taken = 0
        for group, table in zip(self.groups, request.tables):
            if isinstance(group, CheckpointGroup):
                taken += reserve_saves(group, table, group.page_keys(request.hashes), start, end, self.pool)
        if taken:
            request.undo = None  # pages taken outside the admission: no exact undo any more
        return taken

    def _count_group_hits(self, hashes: list[BlockHash], num_tokens: int, hit: int) -> list[int]:
        """Add to `group_hits` what each group alone could serve of a prompt (at least the hit)."""
        if not self.enable_caching or not hashes:
            return [0] * len(self.groups)
        alone = [max(hit, g.find_hit(g.page_keys(hashes), num_tokens - 1, num_tokens - 1)) for g in self.groups]
        self.group_hits = [total + mine for total, mine in zip(self.group_hits, alone)]
        return alone

    def branch_point(self, req_id: str) -> int:
        """Tokens at which the request saves a branch state as its prefill passes (0: none); the
        scheduler ends a chunk there."""
        return self._request(req_id).branch_point

    def end_turn(self, req_id: str, num_computed_tokens: int) -> bool:
        """The request's turn is over after `num_computed_tokens` tokens went through the model: keep its
        state there hittable for the next turn (agentjax/kv/turn_ends.py). Call before `free`."""
        request = self._request(req_id)
        if request.undo is not None or not self.enable_caching:
            return False
        return save_turn_end(self, request, num_computed_tokens)

    def _save_checkpoint(self, group: CheckpointGroup, table: GroupTable, keys: list[BlockHash],
                         num_computed: int) -> bool:
        key = group.checkpoint_key(keys, num_computed)
        if key is None or num_computed <= table.last_checkpoint:
            return False
        table.last_checkpoint = num_computed
        if not pool_has_room(self.pool, group.group_id):
            logger.debug("no free page for a checkpoint at %d tokens; skipped", num_computed)
            return False
        page = int(self.pool.allocate(1, group=group.group_id)[0])
        self._pending_copies.append((group.group_id, table.pages[0], page))
        index = num_computed // group.tokens_per_page - 1
        self.pool.cache_page(page, group.group_id, key, keys[index - 1] if index else None)
        self.pool.release(np.asarray([page]))
        return True
