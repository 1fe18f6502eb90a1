"""`agentjax bench report` on a hand-made profile_export.jsonl with known figures, and on real lines."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentjax.bench.report import load_profile_export, report_from_dir
from agentjax.cli import main
from agentjax.errors import InvalidRequestError

S = 1_000_000_000  # ns per second


def _line(start_s, end_s, ttft_ms, isl, cached, osl, phase="profiling", error=None, cancelled=False,
          chunks_ms=None):
    metrics = {
        "time_to_first_token": {"value": ttft_ms, "unit": "ms"},
        "request_latency": {"value": (end_s - start_s) * 1000, "unit": "ms"},
        "input_sequence_length": {"value": isl + 999, "unit": "tokens"},  # client count: ignored
        "usage_prompt_tokens": {"value": isl, "unit": "tokens"},
        "usage_completion_tokens": {"value": osl, "unit": "tokens"},
        "usage_prompt_cache_read_tokens": {"value": cached, "unit": "tokens"},
        "output_sequence_length": {"value": osl, "unit": "tokens"},
    }
    if chunks_ms is not None:
        metrics["inter_chunk_latency"] = {"value": chunks_ms, "unit": "ms"}
    else:
        metrics["inter_token_latency"] = {"value": 10.0, "unit": "ms"}
    if error:
        metrics = {"error_isl": {"value": isl, "unit": "tokens"}}
    return {"metadata": {"session_num": 0, "x_request_id": "r", "x_correlation_id": "sess-1",
                         "conversation_id": "c", "turn_index": 3, "request_start_ns": int(start_s * S),
                         "request_end_ns": int(end_s * S), "benchmark_phase": phase,
                         "was_cancelled": cancelled, "agent_depth": 0},
            "metrics": metrics, "error": error}


@pytest.fixture
def run_dir(tmp_path):
    lines = [
        _line(0.0, 50.0, 1.0, 9999, 0, 1, phase="warmup"),  # left out
        _line(100.0, 102.0, 500.0, 1000, 900, 20, chunks_ms=[50.0] * 19),
        _line(101.0, 104.0, 1000.0, 2000, 1900, 40),
        _line(103.0, 110.0, 200.0, 1000, 600, 40),
        _line(105.0, 105.5, 0.0, 500, 0, 0, error={"code": 500, "type": "ServerError", "message": "x"}),
        _line(109.0, 200.0, 0.0, 7777, 0, 1, cancelled=True),  # left out
    ]
    (tmp_path / "profile_export.jsonl").write_text("\n".join(json.dumps(l) for l in lines) + "\n")
    return tmp_path


def test_report_known_figures(run_dir):
    summary = report_from_dir(run_dir, num_gpus=2)
    # 4 profiled requests from 100 s to 110 s; the failed one counts in no token figure.
    assert summary["requests"] == 4 and summary["errors"] == 1
    assert summary["wall_time_s"] == pytest.approx(10.0)
    assert summary["input_tokens"] == 4000 and summary["cached_tokens"] == 3400
    assert summary["output_tokens"] == 100
    assert summary["tpgs"] == pytest.approx(4100 / 10.0 / 2)
    assert summary["hit_rate"] == pytest.approx(0.85)
    # E2E / output tokens: 0.075, 0.1, 0.175 s -> P90 (linear, rank 1.8) = 0.16 s.
    assert summary["p90_interactivity"] == pytest.approx(1 / 0.16)
    assert summary["ttft_p50_s"] == pytest.approx(0.5)
    # Gaps: 19 x 50 ms, 39 x 10 ms, 39 x 10 ms -> median 10 ms.
    assert summary["itl_p50_s"] == pytest.approx(0.010)
    assert summary["skipped_warmup"] == 1 and summary["skipped_cancelled"] == 1


def test_report_records_carry_ids(run_dir):
    records, skipped = load_profile_export(run_dir / "profile_export.jsonl")
    assert len(records) == 4 and skipped["warmup"] == 1
    assert records[0].session_id == "sess-1" and records[0].turn_index == 3
    assert records[0].ttft_s == pytest.approx(0.5)


def test_report_cli(run_dir, tmp_path, capsys):
    out = tmp_path / "summary.json"
    assert main(["bench", "report", str(run_dir), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["requests"] == 4
    assert "TPGS" in capsys.readouterr().out


def test_report_missing_file(tmp_path):
    with pytest.raises(InvalidRequestError, match="profile_export.jsonl"):
        report_from_dir(tmp_path)


REAL_EXPORT = Path(__file__).parent / "data" / "agentx_profile_export.jsonl"


def test_report_on_real_agentx_client_lines():
    """Three lines of a real profile_export.jsonl (agentx-harness 1.0.12 against `agentjax serve
    --model preset:tiny-long`): one warm-up request, two profiled ones with 172 and 103
    inter-chunk gaps. The figures follow from their raw fields; the hit rate is the client's own
    'Overall Usage Prompt Cache Read %' (94.34)."""
    summary = report_from_dir(REAL_EXPORT)
    assert summary["skipped_warmup"] == 1
    assert summary["requests"] == 2 and summary["errors"] == 0
    assert summary["input_tokens"] == 59_954 + 62_919 and summary["cached_tokens"] == 56_000 + 59_920
    assert summary["output_tokens"] == 174 + 105
    # First start to last end (start + request_latency): 149.9555 s.
    assert summary["wall_time_s"] == pytest.approx(149.9555, abs=1e-3)
    assert summary["tpgs"] == pytest.approx(123_152 / 149.9555, rel=1e-5)
    assert summary["hit_rate"] == pytest.approx(0.9434, abs=1e-4)
    # E2E per output token: 77.0284 s / 174 and 67.8825 s / 105; P90 by linear interpolation.
    assert summary["p90_interactivity"] == pytest.approx(1.59714, rel=1e-4)
    assert summary["ttft_p50_s"] == pytest.approx(18.90542, rel=1e-5)
    records, _ = load_profile_export(REAL_EXPORT)
    assert [len(r.inter_token_latencies_s) for r in records] == [172, 103]
    assert {r.session_id for r in records} == {"3215fed4-c347-4c70-bc34-bbf64f8da6a9"}
    assert [r.turn_index for r in records] == [10, 11]
