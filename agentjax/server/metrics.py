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
    ("agentjax:prompt_tokens", "Prompt tokens processed.", "prompt_tokens_total"),
    ("agentjax:generation_tokens", "Tokens generated.", "generation_tokens_total"),
    ("agentjax:num_preemptions", "Requests preempted by the scheduler.", "num_preemptions"),
)
ENGINE_GAUGES = (
    ("agentjax:num_requests_running", "Requests in the running batch.", "num_running"),
    ("agentjax:num_requests_waiting", "Requests waiting for admission.", "num_waiting"),
    ("agentjax:kv_cache_usage_perc", "Fraction of KV pages in use (0 to 1).", "kv_usage"),
    ("agentjax:kv_used_blocks", "KV pages in use (held by requests or pinned).", "kv_used_blocks"),
    ("agentjax:kv_total_blocks", "KV pages in the pool.", "kv_total_blocks"),
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
