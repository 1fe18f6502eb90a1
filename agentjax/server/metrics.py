"""Prometheus metrics for `GET /metrics`, named `agentjax:*` after vLLM's `vllm:*`.

Gauges and engine counters are read at scrape time from the engine thread's latest stats snapshot;
latency histograms are observed as outputs reach the event loop. Each app has its own registry,
so several servers can live in one process (tests). Never imports jax.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# (metric name, help, engine stats key); the server's own count stands in while a key is absent.
ENGINE_COUNTERS = (
    ("agentjax:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_query_tokens"),
    ("agentjax:prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_hit_tokens"),
    ("agentjax:prefix_cache_turn_end_hits", "Prompt tokens found in the prefix cache through the recurrent "
     "state a previous turn ended with.", "prefix_turn_end_hit_tokens"),
    ("agentjax:prompt_tokens", "Prompt tokens processed (once for a request's n samples).",
     "prompt_tokens_total"),
    ("agentjax:prompt_tokens_computed", "Prompt tokens run through the model (not read from the prefix cache).",
     "prompt_tokens_computed_total"),
    ("agentjax:generation_tokens", "Tokens generated.", "generation_tokens_total"),
    ("agentjax:num_preemptions", "Requests preempted by the scheduler.", "num_preemptions"),
    ("agentjax:compiled_executables", "XLA executables the engine built (compiled or loaded from the persistent "
     "cache) in its steps and warm-up; after a full warm-up, a rise means a step shape was missed.",
     "compiled_executables"),
)
ENGINE_GAUGES = (
    ("agentjax:num_requests_running", "Requests in the running batch.", "num_running"),
    ("agentjax:num_requests_waiting", "Requests waiting for admission.", "num_waiting"),
    ("agentjax:kv_cache_usage_perc", "Fraction of the KV memory in use (0 to 1; held by requests or pinned).",
     "kv_usage"),
    ("agentjax:kv_used_blocks", "KV memory in use, in pages (a pool layout: in pages of its smallest page group).",
     "kv_used_blocks"),
    ("agentjax:kv_total_blocks", "KV memory, in pages (a pool layout: in pages of its smallest page group).",
     "kv_total_blocks"),
)


class _EngineCollector:
    """Reads the latest stats snapshot at scrape time."""

    def __init__(self, get_stats: Callable[[], dict], server_counts: dict[str, float],
                 get_in_flight: Callable[[], int]):
        self.get_stats = get_stats
        self.server_counts = server_counts
        self.get_in_flight = get_in_flight

    def describe(self):
        return []

    def collect(self):
        stats = self.get_stats()
        for name, help_text, key in ENGINE_GAUGES:
            yield GaugeMetricFamily(name, help_text, value=float(stats.get(key, 0)))
        yield GaugeMetricFamily("agentjax:num_requests_in_server",
                                "Requests the HTTP server holds (queued or running).",
                                value=float(self.get_in_flight()))
        for name, help_text, key in ENGINE_COUNTERS:
            value = stats.get(key, self.server_counts.get(key, 0))
            yield CounterMetricFamily(name, help_text, value=float(value))
        yield from kv_group_metrics(stats)
        yield cached_blocks_by_group(stats)
        if "kv_offload" in stats:
            yield from offload_metrics(stats["kv_offload"])
        if "spec_decode" in stats:
            yield from spec_decode_metrics(stats["spec_decode"])


def kv_group_metrics(stats: dict):
    """`agentjax:kv_group_*_bytes` gauges and `agentjax:prefix_cache_group_hits` counters from
    `Engine.stats()["kv_groups"]`, labelled by page group (a data-parallel engine's ranks summed)."""
    for key, help_text in (("used_bytes", "KV bytes a page group holds: running requests' pages and cached pages."),
                           ("reserved_bytes", "KV bytes the memory layout sets aside for a page group.")):
        family = GaugeMetricFamily(f"agentjax:kv_group_{key}", help_text, labels=["group"])
        totals: dict[str, float] = {}
        for rank in stats.get("ranks", [stats]):
            for group in rank.get("kv_groups", ()):
                totals[group["group"]] = totals.get(group["group"], 0.0) + group[key]
        for group, value in totals.items():
            family.add_metric([group], value)
        yield family
    hits = CounterMetricFamily("agentjax:prefix_cache_group_hits",
                               "Prompt tokens a page group alone could serve from the prefix cache (a hit is "
                               "the least over the groups: a group below the others is where hits are lost).",
                               labels=["group"])
    hit_totals: dict[str, float] = {}
    for rank in stats.get("ranks", [stats]):
        for group in rank.get("kv_groups", ()):
            hit_totals[group["group"]] = hit_totals.get(group["group"], 0.0) + group.get("hit_tokens", 0)
    for group, value in hit_totals.items():
        hits.add_metric([group], value)
    yield hits


def cached_blocks_by_group(stats: dict) -> GaugeMetricFamily:
    """`agentjax:kv_cached_blocks{group,kind}` (a data-parallel engine's ranks summed)."""
    family = GaugeMetricFamily("agentjax:kv_cached_blocks", "Cached KV pages a prefix hit can reuse, per KV group "
                               "(the groups share one pool).", labels=["group", "kind"])
    totals: dict[tuple[str, str], float] = {}
    for rank in stats.get("ranks", [stats]):
        for group, kind, count in rank.get("kv_cached_blocks_by_group", ()):
            totals[(str(group), kind)] = totals.get((str(group), kind), 0.0) + count
    for labels, value in totals.items():
        family.add_metric(list(labels), value)
    return family


# (metric name, help, key in Engine.stats()["spec_decode"]): vLLM's spec_decode_* counters
SPEC_DECODE_COUNTERS = (
    ("agentjax:spec_decode_num_drafts", "Decode rows that carried draft tokens (speculative decoding).", "num_drafts"),
    ("agentjax:spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", "num_draft_tokens"),
    ("agentjax:spec_decode_num_accepted_tokens", "Draft tokens the target model accepted.", "num_accepted_tokens"),
)


def spec_decode_metrics(spec: dict):
    """`agentjax:spec_decode_*` families from `Engine.stats()["spec_decode"]`."""
    for name, help_text, key in SPEC_DECODE_COUNTERS:
        yield CounterMetricFamily(name, help_text, value=float(spec[key]))
    per_position = CounterMetricFamily("agentjax:spec_decode_num_accepted_tokens_per_pos",
                                       "Accepted draft tokens by position in the draft (0 = first).",
                                       labels=["position"])
    for position, value in enumerate(spec["accepted_per_position"]):
        per_position.add_metric([str(position)], float(value))
    yield per_position


# (metric name, help, counter name in the offload stats, labelled by reason too)
OFFLOAD_COUNTERS = (
    ("agentjax:kv_offload_pages_stored", "KV pages stored into an offload tier.", "pages_stored", False),
    ("agentjax:kv_offload_pages_loaded", "KV pages loaded back from an offload tier instead of recomputed.",
     "pages_loaded", False),
    ("agentjax:kv_offload_load_failures", "KV pages an offload tier could not give back (recomputed), by reason.",
     "load_failures", True),
    ("agentjax:kv_offload_store_failures", "KV pages an offload tier could not store, by reason.",
     "store_failures", True),
    ("agentjax:kv_offload_degradations", "Times an offload tier was taken out of use, by reason.",
     "degradations", True),
)


def offload_metrics(offload: dict):
    """`agentjax:kv_offload_*` families from `Engine.stats()["kv_offload"]`."""
    counters = offload["counters"]
    for name, help_text, counter, by_reason in OFFLOAD_COUNTERS:
        labels = ["tier", "reason"] if by_reason else ["tier"]
        family = CounterMetricFamily(name, help_text, labels=labels)
        for tier in offload["tiers"]:
            reasons = sorted({r for (n, t, r) in counters if n == counter and t == tier}) if by_reason else [""]
            for reason in reasons:
                value = float(counters.get((counter, tier, reason), 0))
                family.add_metric([tier, reason] if by_reason else [tier], value)
        yield family
    degraded = GaugeMetricFamily("agentjax:kv_offload_tier_degraded",
                                 "1 while an offload tier is out of use (or takes no stores) after a fault.",
                                 labels=["tier"])
    for tier, value in offload["degraded"].items():
        degraded.add_metric([tier], float(value))
    yield degraded
    yield GaugeMetricFamily("agentjax:kv_offload_requests_loading",
                            "Requests waiting while their prefix is loaded from an offload tier.",
                            value=float(offload["requests_waiting_for_load"]))
    yield CounterMetricFamily("agentjax:kv_offload_prefetched_pages",
                              "KV pages loaded back for a paused session before its next turn (the KV policy's "
                              "prefetch).", value=float(offload.get("pages_prefetched", 0)))
    pages = GaugeMetricFamily("agentjax:kv_offload_tier_pages", "KV pages an offload tier holds.", labels=["tier"])
    for tier in offload["tiers"]:
        if tier in ("host", "disk"):
            pages.add_metric([tier], float(offload[f"{tier}_pages"]))
    yield pages


class ServerMetrics:
    """The registry behind `/metrics` and the observers the server calls."""

    def __init__(self, get_stats: Callable[[], dict], get_in_flight: Callable[[], int]):
        self.registry = CollectorRegistry()
        self.server_counts: dict[str, float] = {key: 0 for _, _, key in ENGINE_COUNTERS}
        self.registry.register(_EngineCollector(get_stats, self.server_counts, get_in_flight))
        self.time_to_first_token = Histogram(
            "agentjax:time_to_first_token_seconds", "Time to first token.", buckets=TTFT_BUCKETS,
            registry=self.registry)
        self.inter_token_latency = Histogram(
            "agentjax:inter_token_latency_seconds", "Time between successive tokens of a request.",
            buckets=ITL_BUCKETS, registry=self.registry)
        self.e2e_request_latency = Histogram(
            "agentjax:e2e_request_latency_seconds", "Time from arrival to the last token.",
            buckets=E2E_BUCKETS, registry=self.registry)
        self.request_success = Counter(
            "agentjax:request_success", "Finished requests, by finish reason.", ["finished_reason"],
            registry=self.registry)
        self.request_errors = Counter(
            "agentjax:request_errors", "Requests answered with an error, by HTTP status.", ["status"],
            registry=self.registry)

    def observe_output(self, stream: Any, output: Any, now: float) -> None:
        """Called on the event loop for each engine output, before the stream sees it."""
        if stream.first_token_time is None:
            self.time_to_first_token.observe(now - stream.arrival_time)
            self.server_counts["prompt_tokens_total"] += output.num_prompt_tokens
            self.server_counts["prefix_query_tokens"] += output.num_prompt_tokens
            self.server_counts["prefix_hit_tokens"] += max(0, output.num_cached_tokens)
        else:
            self.inter_token_latency.observe(now - stream.last_token_time)
        self.server_counts["generation_tokens_total"] += len(output.new_token_ids)
        if output.finished:
            self.e2e_request_latency.observe(now - stream.arrival_time)
            self.request_success.labels(finished_reason=output.finish_reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
