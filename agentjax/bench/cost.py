"""What a benchmark run costs on GPUs, and what the same tokens would cost from an API.

Cost per million tokens from a GPU price per hour and TPGS; the API bill of the run's tokens at list
prices (input, cached reads, cache writes, output); and the ratio of the two, the cost advantage of
the mission's table. Host only: never imports jax.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agentjax.errors import InvalidRequestError

SECONDS_PER_HOUR = 3600.0
TOKENS_PER_MILLION = 1_000_000.0


@dataclass(frozen=True)
class ApiPrices:
    """API list prices in dollars per million tokens (defaults: Opus-class list prices).
    `cache_write_share` of the uncached input tokens is billed as cache writes (an agent harness
    writes each new prefix to the cache), the rest as plain input."""

    input_per_million: float = 5.00
    cached_read_per_million: float = 0.50
    cache_write_per_million: float = 6.25
    output_per_million: float = 25.00
    cache_write_share: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_write_share <= 1.0:
            raise InvalidRequestError(
                f"cache_write_share={self.cache_write_share} must lie in [0, 1]")
        prices = (self.input_per_million, self.cached_read_per_million,
                  self.cache_write_per_million, self.output_per_million)
        if min(prices) < 0:
            raise InvalidRequestError(f"API prices {prices} must be >= 0")


def gpu_cost_per_million_tokens(gpu_price_per_hour: float, tpgs: float) -> float:
    """Dollars per million tokens when one GPU costs `gpu_price_per_hour` and serves `tpgs`
    tokens per second: price / (tpgs * 3600 / 1e6)."""
    if not (tpgs > 0 and gpu_price_per_hour >= 0):
        raise InvalidRequestError(
            f"tpgs={tpgs} must be > 0 and gpu_price_per_hour={gpu_price_per_hour} >= 0")
    return gpu_price_per_hour / (tpgs * SECONDS_PER_HOUR / TOKENS_PER_MILLION)


def api_cost(input_tokens: int, cached_tokens: int, output_tokens: int,
             prices: ApiPrices = ApiPrices()) -> float:
    """Dollars an API bills for these tokens. `input_tokens` includes the cached ones."""
    if not 0 <= cached_tokens <= input_tokens or output_tokens < 0:
        raise InvalidRequestError(
            f"need 0 <= cached_tokens ({cached_tokens}) <= input_tokens ({input_tokens}) "
            f"and output_tokens ({output_tokens}) >= 0")
    uncached = input_tokens - cached_tokens
    written = uncached * prices.cache_write_share
    dollars = (cached_tokens * prices.cached_read_per_million
               + written * prices.cache_write_per_million
               + (uncached - written) * prices.input_per_million
               + output_tokens * prices.output_per_million)
    return dollars / TOKENS_PER_MILLION


@dataclass(frozen=True)
class CostComparison:
    """One deployment's hourly cost on GPUs against the API bill of the same token rate."""

    gpu_cost_per_hour: float
    api_cost_per_hour: float
    gpu_cost_per_million_tokens: float
    api_cost_per_million_tokens: float

    @property
    def advantage(self) -> float:
        """How many times cheaper the GPUs are than the API (the mission table's "106x")."""
        return self.api_cost_per_hour / self.gpu_cost_per_hour


def compare_costs(summary: Mapping[str, Any], gpu_price_per_hour: float,
                  prices: ApiPrices = ApiPrices()) -> CostComparison:
    """From a `metrics.summarize` result: its token totals, wall time and GPU count."""
    wall_time_s = float(summary["wall_time_s"])
    num_gpus = int(summary["num_gpus"])
    input_tokens = int(summary["input_tokens"])
    output_tokens = int(summary["output_tokens"])
    total_tokens = input_tokens + output_tokens
    if total_tokens == 0:
        raise InvalidRequestError("the run served no tokens; no cost per token to compare")
    run_api_cost = api_cost(input_tokens, int(summary["cached_tokens"]), output_tokens, prices)
    runs_per_hour = SECONDS_PER_HOUR / wall_time_s
    gpu_cost_per_hour = gpu_price_per_hour * num_gpus
    tpgs = total_tokens / (wall_time_s * num_gpus)
    return CostComparison(
        gpu_cost_per_hour=gpu_cost_per_hour,
        api_cost_per_hour=run_api_cost * runs_per_hour,
        gpu_cost_per_million_tokens=gpu_cost_per_million_tokens(gpu_price_per_hour, tpgs),
        api_cost_per_million_tokens=run_api_cost / total_tokens * TOKENS_PER_MILLION)
