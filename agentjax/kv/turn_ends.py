"""End-of-turn and branch states: the state after the last token a turn's model consumed, hittable by
the next turn, and the state where a prompt's cached prefix ended (a branch: the Marconi rule).

A turn ends with its running recurrent state after `n` tokens, usually not on a checkpoint boundary.
At the turn's end that page, and the turn's partial last attention page (tokens `P = n // B * B` to `n`),
are cached under a *tail key*: the hash of the block before `P` and the tokens after it. A later prompt
whose tokens start with the same `n` tokens resumes at `n`: it reuses the full attention pages, copies
the partial page into a page of its own (it will write after `n`) and copies the state into its running
page. A prompt whose cached attention pages reach further than any saved state (`branch_point`: the
prefix was seen before, as subagents that share a parent's system prompt and tools see it) saves the
state there as it passes it, under the tail key of no tokens, so the next branch resumes there.
Only models whose groups are all prefix groups of `B`-token pages and state groups take part.
Host only: never imports jax; the manager owns the pages, this module only names and finds them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from agentjax.kv.hashing import BlockHash, hash_block_tokens

TAIL_TAG = (b"turn-end",)  # keeps tail keys apart from full-block hashes of the same tokens


def tail_key(parent: BlockHash, tokens: np.ndarray) -> BlockHash:
    """The key of the state after the tokens of a block that `tokens` (fewer than a block) start."""
    return hash_block_tokens(parent, tokens, TAIL_TAG)


@dataclass
class TailHit:
    """A hit at `num_tokens` through a turn end: the tail key, its block-aligned start `start`."""

    num_tokens: int
    start: int
    key: BlockHash


class TurnEnds:
    """Which tail lengths were saved after each block hash (a prompt probes only those), bounded."""

    def __init__(self, block_size: int, max_entries: int):
        self.block_size = block_size
        self.max_entries = max(1, max_entries)
        self._lengths: dict[BlockHash, set[int]] = {}
        self.saved = 0

    def __len__(self) -> int:
        return len(self._lengths)

    def remember(self, parent: BlockHash, length: int) -> None:
        lengths = self._lengths.pop(parent, set())  # re-inserted: the newest last
        lengths.add(length)
        self._lengths[parent] = lengths
        while len(self._lengths) > self.max_entries:
            del self._lengths[next(iter(self._lengths))]

    def find(self, tokens: np.ndarray, hashes: list[BlockHash], root: BlockHash, low: int, high: int,
             cached) -> TailHit | None:
        """The longest turn end at a token count in (low, high] whose tail key `cached(key, length)` accepts;
        `hashes` are the prompt's block hashes (enough to cover `high`)."""
        if not self._lengths:
            return None
        size = self.block_size
        for start in range(high // size * size, max(low, 0) // size * size - 1, -size):
            parent = hashes[start // size - 1] if start else root
            lengths = self._lengths.get(parent)
            if not lengths:
                continue
            for length in sorted(lengths, reverse=True):
                end = start + length
                if not low < end <= high:
                    continue
                key = tail_key(parent, tokens[start:end])
                if cached(key, length):
                    return TailHit(end, start, key)
        return None


def takes_turn_ends(groups) -> bool:
    """Whether a manager's groups can serve tail hits: some state group, every other group a prefix group
    of one hash block per page."""
    from agentjax.kv.groups import CheckpointGroup, PrefixGroup

    states = [g for g in groups if isinstance(g, CheckpointGroup)]
    others = [g for g in groups if not isinstance(g, CheckpointGroup)]
    return bool(states) and all(type(g) is PrefixGroup and g.hashes_per_page == 1 for g in others)


def save_turn_end(manager, request, num_computed: int) -> bool:
    """Cache `request`'s running states and partial last attention page under the tail key of its first
    `num_computed` tokens (the tokens its state has consumed); they stay hittable once it is freed.
    False when nothing new was cached (a checkpoint already holds that state, or a page is missing)."""
    from agentjax.kv.groups import CheckpointGroup

    turn_ends, pool, size = manager.turn_ends, manager.pool, manager.block_size
    if turn_ends is None or not 0 < num_computed <= request.tokens.size:
        return False
    start = num_computed // size * size
    states = [(g, t) for g, t in zip(manager.groups, request.tables) if isinstance(g, CheckpointGroup)]
    if any(num_computed % g.tokens_per_page == 0 and t.last_checkpoint >= num_computed for g, t in states):
        return False  # an interval checkpoint already holds this state
    manager._extend_hashes(request, start)
    parent = request.hashes[start // size - 1] if start else request.root
    key = tail_key(parent, request.tokens.view()[start:num_computed])
    pages = []
    for group, table in zip(manager.groups, request.tables):
        if isinstance(group, CheckpointGroup):
            page = table.pages[0]
        elif num_computed == start:
            continue
        else:
            page = table.pages[start // size] if start // size < len(table.pages) else 0
        if page == 0 or key in group.index or pool.page_hash[page] is not None:
            return False
        pages.append((group.group_id, page))
    for group_id, page in pages:
        pool.cache_page(page, group_id, key, parent)
    turn_ends.remember(parent, num_computed - start)
    turn_ends.saved += 1
    return True


def tail_hit(manager, tokens: np.ndarray, hashes: list[BlockHash], root: BlockHash, hit: int, reuse: list):
    """A longer hit than `hit` through a turn end: `(hit, reuse, tails)`, where `tails` lists
    `(group, partial page)` to copy into the first new page of each attention group; else the inputs
    and no tails."""
    from agentjax.kv.groups import CheckpointGroup

    turn_ends = manager.turn_ends
    if turn_ends is None or not len(turn_ends):
        return hit, reuse, []
    cap = len(tokens) - 1
    prefix = [g for g in manager.groups if not isinstance(g, CheckpointGroup)]
    extent = min(len(g.cached_run(g.page_keys(hashes), cap // g.tokens_per_page)) * g.tokens_per_page
                 for g in prefix) if prefix else cap // manager.block_size * manager.block_size

    def cached(key: BlockHash, length: int) -> bool:
        return all(key in g.index for g in manager.groups if isinstance(g, CheckpointGroup) or length)

    found = turn_ends.find(tokens, hashes, root, hit, min(cap, extent + manager.block_size - 1), cached)
    if found is None or found.start > extent:
        return hit, reuse, []
    new_reuse, tails = [], []
    for group in manager.groups:
        if isinstance(group, CheckpointGroup):
            new_reuse.append(([group.index[found.key]], 0))
        else:
            new_reuse.append((group.cached_run(group.page_keys(hashes), found.start // group.tokens_per_page), 0))
            if found.num_tokens > found.start:
                tails.append((group.group_id, group.index[found.key]))
    return found.num_tokens, new_reuse, tails


def branch_point(manager, group_hits: list[int], hit: int) -> int:
    """Where a new request's cached attention pages end (whole blocks), if no saved state reaches it: the
    state there is worth saving (0: none, or the model takes no tail states)."""
    from agentjax.kv.groups import CheckpointGroup

    if manager.turn_ends is None or not manager.branch_states:
        return 0
    reach = [h for g, h in zip(manager.groups, group_hits) if not isinstance(g, CheckpointGroup)]
    if not reach:
        return 0
    point = min(reach) // manager.block_size * manager.block_size
    return point if point > hit else 0


def save_branch_state(manager, request, group, table, keys: list[BlockHash]) -> bool:
    """The request's running state sits at its branch point: copy it into a cached page of its own under
    the tail key of no tokens there (unless an interval checkpoint holds it already)."""
    from agentjax.kv.state_saves import pool_has_room

    point, size = request.branch_point, manager.block_size
    if point % group.tokens_per_page == 0 and point // group.tokens_per_page <= len(keys):
        return False  # an interval checkpoint: saved as one
    manager._extend_hashes(request, point)
    parent = request.hashes[point // size - 1]
    key = tail_key(parent, request.tokens.view()[point:point])
    if key in group.index or not pool_has_room(manager.pool, group.group_id):
        return False
    page = int(manager.pool.allocate(1, group=group.group_id)[0])
    manager._pending_copies.append((group.group_id, table.pages[0], page))
    manager.pool.cache_page(page, group.group_id, key, parent)
    manager.pool.release(np.asarray([page]))
    manager.turn_ends.remember(parent, 0)
    manager.branch_states_saved += 1
    return True
