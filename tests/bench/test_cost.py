"""GPU cost per million tokens, the API bill of the same tokens, and their ratio."""
from __future__ import annotations

import pytest

from agentjax.bench.cost import (
    ApiPrices,
    api_cost,
    compare_costs,
    gpu_cost_per_million_tokens,
)
from agentjax.errors import InvalidRequestError


def test_gpu_cost_per_million_tokens_from_price_and_tpgs():
    # The mission's DeepSeek-V4-Pro row: $27.72/h for 12 GPUs is $2.31 per GPU-hour; at 83K
    # TPGS one GPU serves 83,000 * 3,600 = 298.8M tokens an hour: 2.31 / 298.8 = $0.007731/M.
    assert gpu_cost_per_million_tokens(27.72 / 12, 83_000) == pytest.approx(2.31 / 298.8)


def test_api_cost_bills_cached_reads_cache_writes_and_output_at_list_prices():
    # 960K cached reads * $0.50/M = $0.48; 40K uncached written at $6.25/M = $0.25;
    # 10K output * $25/M = $0.25. Total $0.98.
    assert api_cost(1_000_000, 960_000, 10_000) == pytest.approx(0.98)
    # Billing the uncached 40K as plain input instead: 40K * $5/M = $0.20, total $0.93.
    assert api_cost(1_000_000, 960_000, 10_000, ApiPrices(cache_write_share=0.0)) == (
        pytest.approx(0.93))


def test_compare_costs_gives_the_cost_advantage_of_a_run():
    # The totals `metrics.summarize` reports for a 10 s run on 2 GPUs.
    summary = {"input_tokens": 6000, "cached_tokens": 5600, "output_tokens": 20,
               "wall_time_s": 10.0, "num_gpus": 2}
    comparison = compare_costs(summary, gpu_price_per_hour=3.0)
    # GPUs: 2 * $3 = $6/h. API per 10 s run: 5600 cached * 0.5 + 400 written * 6.25
    # + 20 output * 25 = 2800 + 2500 + 500 = 5800 $/M-token units = $0.0058; 360 runs an hour
    # make $2.088/h, so the advantage is 2.088 / 6 = 0.348.
    assert comparison.gpu_cost_per_hour == pytest.approx(6.0)
    assert comparison.api_cost_per_hour == pytest.approx(2.088)
    assert comparison.advantage == pytest.approx(0.348)
    # Per million tokens: GPU 3 / (6020 / 20 = 301 TPGS * 3600 / 1e6); API 0.0058 / 6020 tokens * 1e6.
    assert comparison.gpu_cost_per_million_tokens == pytest.approx(3 / (301 * 3600 / 1e6))
    assert comparison.api_cost_per_million_tokens == pytest.approx(0.0058 / 6020 * 1e6)


def test_out_of_range_prices_and_counts_are_refused():
    with pytest.raises(InvalidRequestError, match="tpgs"):
        gpu_cost_per_million_tokens(2.0, 0.0)
    with pytest.raises(InvalidRequestError, match="cached_tokens"):
        api_cost(100, 200, 0)
    with pytest.raises(InvalidRequestError, match="cache_write_share"):
        ApiPrices(cache_write_share=2.0)
