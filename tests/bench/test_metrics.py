"""AgentX metrics on hand-made request records, with answers worked out by hand."""
from __future__ import annotations

import json

import pytest

from agentjax.bench.metrics import RequestRecord, format_table, summarize, write_summary
from agentjax.errors import InvalidRequestError


def hand_made_records() -> list[RequestRecord]:
    return [
        # E2E 2.5 s over 5 tokens: 0.5 s/token. TTFT 0.5.
        RequestRecord(0.0, 0.5, 2.5, input_tokens=1000, cached_tokens=800, output_tokens=5,
                      inter_token_latencies_s=(0.5, 0.5, 0.5, 0.5), session_id="a", turn_index=0),
        # E2E 1.2 s over 11 tokens: 0.10909 s/token. TTFT 0.2.
        RequestRecord(1.0, 1.2, 2.2, input_tokens=2000, cached_tokens=1900, output_tokens=11,
                      inter_token_latencies_s=(0.1,) * 10, session_id="a", turn_index=1),
        # E2E 2.1 s over 4 tokens: 0.525 s/token. TTFT 0.1.
        RequestRecord(2.0, 2.1, 4.1, input_tokens=3000, cached_tokens=2900, output_tokens=4,
                      inter_token_latencies_s=(0.2, 0.2, 1.6), session_id="b", turn_index=0),
        RequestRecord(3.0, None, 3.5, input_tokens=500, cached_tokens=0, output_tokens=0,
                      error="HTTP 500: engine overloaded", session_id="b", turn_index=1),
    ]


@pytest.fixture
def summary() -> dict:
    return summarize(hand_made_records(), wall_time_s=10.0, num_gpus=2)


def test_tpgs_counts_cached_input_and_output_per_gpu_second(summary):
    # (1000 + 2000 + 3000 input + 5 + 11 + 4 output) / (10 s * 2 GPUs) = 6020 / 20; the failed
    # request's 500 tokens do not count.
    assert summary["tpgs"] == pytest.approx(301.0)


def test_p90_interactivity_inverts_the_p90_of_e2e_latency_per_output_token(summary):
    # Seconds per token sorted: 0.10909, 0.5, 0.525. Linear P90 sits at rank 0.9 * 2 = 1.8:
    # 0.5 + 0.8 * (0.525 - 0.5) = 0.52 s/token, so 1 / 0.52 = 1.923 tokens/s.
    assert summary["p90_interactivity"] == pytest.approx(1 / 0.52)


def test_itl_interactivity_inverts_pooled_inter_token_latency_percentiles(summary):
    # 17 gaps sorted: ten 0.1, two 0.2, four 0.5, one 1.6. P50 at rank 8 is 0.1; P90 at rank
    # 14.4 lies between two 0.5s, so 0.5.
    assert summary["itl_p50_s"] == pytest.approx(0.1)
    assert summary["itl_p90_s"] == pytest.approx(0.5)
    assert summary["p50_itl_interactivity"] == pytest.approx(10.0)
    assert summary["p90_itl_interactivity"] == pytest.approx(2.0)


def test_hit_rate_errors_and_latency_percentiles(summary):
    # Cached 800 + 1900 + 2900 = 5600 of 6000 successful input tokens.
    assert summary["hit_rate"] == pytest.approx(5600 / 6000)
    assert (summary["requests"], summary["errors"]) == (4, 1)
    assert summary["error_rate"] == pytest.approx(0.25)
    assert summary["ttft_p50_s"] == pytest.approx(0.2)  # TTFTs 0.5, 0.2, 0.1
    assert summary["e2e_p50_s"] == pytest.approx(2.1)  # E2Es 2.5, 1.2, 2.1
    # E2E P90: rank 1.8 between 2.1 and 2.5: 2.1 + 0.8 * 0.4 = 2.42.
    assert summary["e2e_p90_s"] == pytest.approx(2.42)


def test_summary_json_carries_the_agentx_top_level_keys(summary, tmp_path):
    path = tmp_path / "result.json"
    write_summary(summary, path)
    loaded = json.loads(path.read_text())
    for key in ("tpgs", "p90_interactivity", "hit_rate", "requests", "errors", "ttft_p50_s"):
        assert loaded[key] == summary[key]


def test_table_prints_every_headline_figure(summary):
    table = format_table(summary)
    assert "301.0" in table and "1.92" in table and "93.33%" in table
    assert len(table.splitlines()) >= 10


def test_record_from_token_times_derives_ttft_output_count_and_gaps():
    record = RequestRecord.from_token_times(10.0, [10.4, 10.5, 10.75], 10.8, input_tokens=64,
                                            cached_tokens=32, session_id="s", turn_index=3)
    assert record.ttft_s == pytest.approx(0.4)
    assert record.output_tokens == 3
    assert record.inter_token_latencies_s == pytest.approx((0.1, 0.25))
    assert record.e2e_latency_s == pytest.approx(0.8)


def test_a_run_of_only_failures_has_no_latency_figures():
    failed = [RequestRecord(0.0, None, 1.0, 100, 0, 0, error="timeout")]
    summary = summarize(failed, wall_time_s=1.0, num_gpus=1)
    assert summary["tpgs"] == 0.0 and summary["error_rate"] == 1.0
    assert summary["p90_interactivity"] is None and summary["hit_rate"] is None
    assert "-" in format_table(summary)


def test_summarize_refuses_a_zero_wall_time_or_no_gpus():
    with pytest.raises(InvalidRequestError, match="wall_time_s"):
        summarize(hand_made_records(), wall_time_s=0.0, num_gpus=1)
    with pytest.raises(InvalidRequestError, match="num_gpus"):
        summarize(hand_made_records(), wall_time_s=1.0, num_gpus=0)


def test_hit_rate_by_kind_splits_the_succeeded_requests_by_their_replay_label():
    from dataclasses import replace

    records = hand_made_records()
    labelled = [replace(records[0], kind="first"), replace(records[1], kind="retry"),
                replace(records[2], kind="retry"), replace(records[3], kind="retry")]
    by_kind = summarize(labelled, wall_time_s=10.0, num_gpus=1)["hit_rate_by_kind"]
    assert by_kind["first"] == {"requests": 1, "input_tokens": 1000, "cached_tokens": 800, "hit_rate": 0.8}
    # the failed retry counts nowhere: (1900 + 2900) / (2000 + 3000)
    assert by_kind["retry"] == {"requests": 2, "input_tokens": 5000, "cached_tokens": 4800, "hit_rate": 0.96}
    assert "hit_rate_by_kind" not in summarize(records, wall_time_s=10.0, num_gpus=1)
