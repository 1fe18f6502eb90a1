"""KV events: what the cache stored and removed, for a router's prefix index or an offload tier.

Plain frozen records; the block pool appends them when events are enabled and a consumer drains
them with `KVCacheManager.take_events()`. Host only: never imports jax.
"""
from __future__ import annotations

from dataclasses import dataclass

from agentjax.kv.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A page of `group` became hittable under `block_hash`; `parent` is the previous block's hash
    (None for a sequence's first block) and `tokens` the block's token ids."""

    block_hash: BlockHash
    parent: BlockHash | None
    tokens: tuple[int, ...]
    group: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """The page that held `block_hash` in `group` was evicted and is no longer hittable."""

    block_hash: BlockHash
    group: int


KVEvent = BlockStored | BlockRemoved
