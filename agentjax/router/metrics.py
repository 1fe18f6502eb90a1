"""The router's Prometheus metrics (`GET /metrics` on the router), named `agentjax:router_*`.

Counters: requests forwarded per replica, routing decisions by policy and reason, retries by
reason, session migrations by reason, replies broken mid-stream, 503s for want of a healthy
replica; P/D prefill steps by outcome and fallbacks by reason; KV migrations in a tool gap by
reason and outcome, and the prompt tokens their targets loaded or computed. Histograms: P/D
prefill and migration prefetch seconds. Gauges, read at scrape time: each replica's health,
draining flag, load and indexed cached blocks, and the sessions the router remembers. Never
imports jax.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from agentjax.router.replicas import Replica


LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _ReplicaCollector:
    def __init__(self, replicas: Sequence[Replica], num_sessions: Callable[[], int]):
        self.replicas = replicas
        self.num_sessions = num_sessions

    def describe(self):
        return []

    def collect(self):
        gauges = (
            ("agentjax:router_replica_healthy", "1 while the replica passes its health checks.",
             lambda r: float(r.healthy)),
            ("agentjax:router_replica_in_flight", "Requests the router is forwarding to the replica now.",
             lambda r: float(r.in_flight)),
            ("agentjax:router_replica_reported_requests", "Requests the replica last reported holding.",
             lambda r: float(r.reported_in_server)),
            ("agentjax:router_replica_indexed_blocks", "Cached KV blocks the router's prefix index holds for it.",
             lambda r: float(len(r.prefix.cached))),
            ("agentjax:router_replica_draining", "1 while the replica is drained (its sessions move off).",
             lambda r: float(r.draining)),
        )
        for name, help_text, value_of in gauges:
            family = GaugeMetricFamily(name, help_text, labels=["replica", "role"])
            for replica in self.replicas:
                family.add_metric([replica.url, replica.role], value_of(replica))
            yield family
        yield GaugeMetricFamily("agentjax:router_sessions", "Sessions the router remembers a replica for.",
                                value=float(self.num_sessions()))


class RouterMetrics:
    """The registry behind the router's `/metrics`."""

    def __init__(self, replicas: Sequence[Replica], num_sessions: Callable[[], int]):
        self.registry = CollectorRegistry()
        self.registry.register(_ReplicaCollector(replicas, num_sessions))
        self.requests = Counter("agentjax:router_requests", "Requests forwarded, by replica (retries included).",
                                ["replica"], registry=self.registry)
        self.decisions = Counter("agentjax:router_routing_decisions", "Routing decisions, by policy and reason.",
                                 ["policy", "reason"], registry=self.registry)
        self.retries = Counter("agentjax:router_retries", "Requests sent to a second replica after the first "
                               "failed before any output, by what failed.", ["reason"], registry=self.registry)
        self.migrations = Counter("agentjax:router_session_migrations", "Sessions moved to another replica than "
                                  "their previous turn's, by reason (at a turn, or in the tool gap before it with "
                                  "a KV migration).", ["reason"], registry=self.registry)
        self.broken_streams = Counter("agentjax:router_broken_streams", "Replies whose replica failed after "
                                      "output had reached the client (ended with an error event).",
                                      ["replica"], registry=self.registry)
        self.unavailable = Counter("agentjax:router_no_healthy_replica", "Requests answered 503: no healthy "
                                   "replica was left to try.", registry=self.registry)

        self.pd_prefills = Counter("agentjax:router_pd_prefills", "P/D prefill steps on a prefill replica, by "
                                   "outcome (stored: the prompt's pages are in Mooncake; failed).", ["outcome"],
                                   registry=self.registry)
        self.pd_fallbacks = Counter("agentjax:router_pd_fallbacks", "P/D requests served whole by one replica, "
                                    "by why the prefill step was not used.", ["reason"], registry=self.registry)
        self.pd_prefill_seconds = Histogram("agentjax:router_pd_prefill_seconds", "Time of a P/D prefill step, "
                                            "until its pages were in Mooncake.", registry=self.registry,
                                            buckets=LATENCY_BUCKETS_S)
        self.kv_migrations = Counter("agentjax:router_kv_migrations", "Session KV migrations in the tool gap after "
                                     "a turn, by reason and outcome (prefetched, failed, gap_too_short).",
                                     ["reason", "outcome"], registry=self.registry)
        self.kv_migration_tokens = Counter("agentjax:router_kv_migration_tokens", "Prompt tokens a migration's "
                                           "target made resident, by source (cached: loaded from its tiers or "
                                           "already there; computed).", ["source"], registry=self.registry)
        self.kv_migration_seconds = Histogram("agentjax:router_kv_migration_seconds", "Time of a migration's "
                                              "flush on the source and prefetch on the target.",
                                              registry=self.registry, buckets=LATENCY_BUCKETS_S)

    def render(self) -> bytes:
        return generate_latest(self.registry)
