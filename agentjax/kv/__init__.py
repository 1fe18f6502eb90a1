"""agentjax.kv: the KV data plane on the host (block pool, prefix hashes, hybrid manager, layout).

Host only: never imports jax, so the scheduler, the router and benchmarks can use it without a device.
"""
from agentjax.kv.block_pool import NULL_PAGE, BlockPool
from agentjax.kv.eviction import EvictionOrder, LRUEvictionOrder
from agentjax.kv.pinned_order import PinnedEvictionOrder
from agentjax.kv.events import BlockRemoved, BlockStored, KVEvent
from agentjax.kv.hashing import block_hashes, hash_block_tokens, root_hash
from agentjax.kv.layout import KVMemoryLayout
from agentjax.kv.layout_build import build_layout
from agentjax.kv.manager import KVCacheManager
from agentjax.kv.policies import BeladyPolicy, HintAwarePolicy, LRUPolicy, MarconiPolicy, make_policy
from agentjax.kv.policy import KVPolicy, PagePolicy, TurnEnd
from agentjax.kv.policy_order import PolicyEvictionOrder
from agentjax.kv.specs import (CompressedLatentSpec, FullAttentionSpec, IndexerKeySpec, KVGroup, KVGroupPlan,
                               KVSpec, MLALatentSpec, RecurrentStateSpec, RollingStateSpec, SlidingWindowSpec,
                               plan_groups)

__all__ = [
    "NULL_PAGE", "BlockPool", "EvictionOrder", "LRUEvictionOrder", "PinnedEvictionOrder", "BlockRemoved", "BlockStored", "KVEvent",
    "block_hashes", "hash_block_tokens", "root_hash", "KVCacheManager", "KVMemoryLayout", "build_layout",
    "CompressedLatentSpec",
    "FullAttentionSpec", "IndexerKeySpec", "KVGroup", "KVGroupPlan", "KVSpec", "MLALatentSpec",
    "RecurrentStateSpec", "RollingStateSpec", "SlidingWindowSpec", "plan_groups",
    "KVPolicy", "PagePolicy", "PolicyEvictionOrder", "TurnEnd", "LRUPolicy", "HintAwarePolicy", "MarconiPolicy",
    "BeladyPolicy", "make_policy",
]
