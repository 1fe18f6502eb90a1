"""agentjax.kv.offload: the lower KV tiers (host memory, disk, a Mooncake Store pool) and what they keep.

The connector's scheduler side (`connector`), the tiers' indexes and stores (`host`, `disk`,
`mooncake`), their counters and health (`tiers`), the records both connector sides exchange
(`transfers`), and the retention policies with the recompute cost model (`policies`). The worker side,
which moves page bytes, is `agentjax.runner.offload_worker`. Host only: never imports jax.
"""
from agentjax.kv.offload.connector import OffloadConnector
from agentjax.kv.offload.disk import DiskTier
from agentjax.kv.offload.host import HostPageIndex
from agentjax.kv.offload.policies import (IntervalRetention, MarconiRetention, RecomputeCost, RetentionPolicy,
                                          make_retention)
from agentjax.kv.offload.tiers import OffloadStats, TierHealth
from agentjax.kv.offload.transfers import KVTransfers, LoadJob, PageTransfer, StoreJob

__all__ = ["IntervalRetention", "MarconiRetention", "RecomputeCost", "RetentionPolicy", "make_retention",
           "OffloadConnector", "DiskTier", "HostPageIndex", "OffloadStats", "TierHealth", "KVTransfers", "LoadJob",
           "PageTransfer", "StoreJob"]
