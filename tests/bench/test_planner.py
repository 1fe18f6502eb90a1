"""Saturation profiling and the P/D sweep: the combination rule by hand, and both commands on a
tiny preset writing their JSON and PNG."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from agentjax.bench.cost_terms import Layout
from agentjax.bench.model_shapes import FULL_SIZE_SHAPES, get_shape
from agentjax.bench.planner import _level_figures, candidate_layouts, merge_saturation, pd_sweep
from agentjax.errors import InvalidRequestError
from agentjax.cli import main

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "agentx-dev"


def level(lanes, rps, inter, ttft=0.5, inputs=1000, outputs=100, requests=10):
    return {"lanes": lanes, "rps": rps, "tpgs": 0.0, "p90_interactivity": inter, "ttft_p90_s": ttft,
            "requests": requests, "errors": 0, "input_tokens": inputs * requests, "cached_tokens": 900 * requests,
            "output_tokens": outputs * requests, "wall_time_s": requests / rps}


DOCUMENT = {
    "model": "toy", "device": "B300", "gpu_price_per_hour": 2.0, "min_interactivity": 50.0,
    "kv_bytes_per_token": 1000.0, "scaleout_bw": 1e9, "network_efficiency": 1.0, "assumptions": ["toy"],
    "configs": [
        {"role": "prefill", "layout": "tp1", "gpus": 1, "max_rps": 10.0,
         "levels": [level(1, 5.0, None, ttft=0.2), level(2, 10.0, None, ttft=0.4)]},
        {"role": "decode", "layout": "tp1", "gpus": 1, "max_rps": 8.0,
         "levels": [level(2, 4.0, 100.0), level(4, 8.0, 60.0)]},
        {"role": "mixed", "layout": "tp2", "gpus": 2, "max_rps": 3.0, "levels": [level(4, 3.0, 80.0)]},
    ],
}


def test_pd_combines_prefill_capacity_decode_curves_and_transfer_by_hand():
    result = pd_sweep(DOCUMENT, total_gpus=2)
    pd = [p for p in result["points"] if p["kind"] == "pd"]
    assert [(p["prefill"], p["decode"], p["decode_lanes"]) for p in pd] == [("1 x tp1", "1 x tp1", 2), ("1 x tp1", "1 x tp1", 4)]
    light, heavy = pd
    # decode level C=2: 4 req/s; prefill carries it at its 5 req/s level (P90 TTFT 0.2 s); the
    # 1000-token prompt's KV (1 MB) crosses 1 GB/s in 1 ms; 100 output tokens per request
    assert light["rps"] == 4.0 and light["bottleneck"] == "decode"
    assert light["tpgs"] == pytest.approx(4.0 * 1100 / 2)
    assert light["p90_interactivity"] == pytest.approx(1 / (1 / 100 + (0.2 + 0.001) / 100))
    assert heavy["rps"] == 8.0 and heavy["p90_interactivity"] == pytest.approx(1 / (1 / 60 + (0.4 + 0.001) / 100))
    colocated = [p for p in result["points"] if p["kind"] == "colocated"]
    assert colocated[0]["tpgs"] == pytest.approx(3.0 * 1100 / 2) and colocated[0]["instances"] == "1 x tp2"
    # the heavy split's 48.4 tok/s misses the 50 tok/s target: the light one is the best
    assert heavy["p90_interactivity"] < 50 < light["p90_interactivity"]
    assert result["best"] == light
    assert light["gpu_cost_per_hour"] == 4.0 and light["cost_advantage"] > 1
    assert result["label"].startswith("projection")


def test_pd_reports_no_best_when_nothing_meets_the_target():
    assert pd_sweep(DOCUMENT, total_gpus=2, min_interactivity=500.0)["best"] is None


def test_saturation_runs_of_one_model_merge():
    prefill = {**DOCUMENT, "configs": DOCUMENT["configs"][:1]}
    rest = {**DOCUMENT, "configs": DOCUMENT["configs"][1:]}
    assert merge_saturation([prefill, rest])["configs"] == DOCUMENT["configs"]
    with pytest.raises(InvalidRequestError, match="cannot merge"):
        merge_saturation([prefill, {**rest, "device": "H200"}])


def test_candidate_layouts_fit_the_architecture():
    kimi, m3 = FULL_SIZE_SHAPES["kimi-k3"](), FULL_SIZE_SHAPES["minimax-m3"]()
    assert Layout(tp=8, dcp=8) in candidate_layouts(kimi, 8, "decode")
    assert Layout(tp=8, dcp=8) not in candidate_layouts(m3, 8, "decode")  # no MLA latent
    assert Layout(dp=8, ep=8) in candidate_layouts(m3, 8, "mixed")
    assert Layout(tp=4, pcp=2) in candidate_layouts(m3, 8, "prefill")
    assert candidate_layouts(get_shape("preset:tiny-dense"), 1, "mixed") == [Layout(tp=1)]


@pytest.mark.slow
@pytest.mark.skipif(not TRACES.is_dir(), reason=f"no dev traces at {TRACES}")
def test_saturation_then_pd_write_json_and_png(tmp_path):
    traces = tmp_path / "traces"
    traces.mkdir()
    for path in sorted(TRACES.glob("*.json.gz"))[:4]:
        shutil.copy(path, traces / path.name)
    out = tmp_path / "plan"
    efficiency = tmp_path / "cpu.json"  # 50 ms per step: few steps to simulate
    efficiency.write_text(json.dumps({"efficiency": {"step_overhead_s": 0.05, "overlap": False}}))
    code = main(["sweep", "saturation", "--model", "preset:tiny-dense", "--gpu", "H200", "--efficiency",
                 str(efficiency), "--gpus", "1,2", "--levels", "1,2", "--traces", str(traces),
                 "--context-scale", "0.005", "--duration", "10", "--max-num-seqs", "16",
                 "--min-interactivity", "0.01", "--out-dir", str(out)])
    assert code == 0
    assert (out / "saturation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    document = json.loads((out / "saturation.json").read_text())
    assert document["label"].startswith("projection") and document["assumptions"]
    roles = {(c["role"], c["layout"]) for c in document["configs"]}
    assert {("prefill", "tp1"), ("decode", "tp1"), ("mixed", "tp1"), ("mixed", "tp2")} <= roles
    assert all(c["levels"] for c in document["configs"])
    code = main(["sweep", "pd", "--saturation", str(out / "saturation.json"), "--gpus-total", "2",
                 "--out-dir", str(out)])
    assert code == 0
    assert (out / "pd.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads((out / "pd.json").read_text())
    assert result["gpus"] == 2 and result["pareto"]
    assert {p["kind"] for p in result["points"]} == {"pd", "colocated"}


def test_a_level_counts_requests_and_tokens_over_at_least_the_run():
    # one request that took 0.2 s of a 20 s run: 5 req/s and 5,000 TPGS over its own span
    summary = {"requests": 1, "wall_time_s": 0.2, "tpgs": 5000.0, "p90_interactivity": 10.0, "errors": 0}
    figures = _level_figures(summary, lanes=1, duration_s=20.0)
    assert figures["rps"] == pytest.approx(1 / 20.0)
    assert figures["tpgs"] == pytest.approx(5000.0 * 0.2 / 20.0)
    longer = _level_figures({**summary, "wall_time_s": 30.0, "tpgs": 40.0}, lanes=1, duration_s=20.0)
    assert longer["rps"] == pytest.approx(1 / 30.0) and longer["tpgs"] == pytest.approx(40.0)


def test_pd_takes_the_prefill_ttft_of_the_fewest_lanes_that_carry_the_load():
    # the prefill instance collapses at 32 lanes (fewer req/s, a long TTFT): a load of 4 req/s is
    # carried at 8 lanes with a 3.5 s TTFT, not by the collapsed level's 21.6 s
    prefill = {"role": "prefill", "layout": "tp1", "gpus": 1, "max_rps": 5.5,
               "levels": [level(8, 5.5, None, ttft=3.5), level(32, 4.5, None, ttft=21.6)]}
    document = {**DOCUMENT, "configs": [prefill, DOCUMENT["configs"][1]]}
    light = next(p for p in pd_sweep(document, total_gpus=2)["points"] if p["decode_lanes"] == 2)
    assert light["rps"] == 4.0
    assert light["p90_interactivity"] == pytest.approx(1 / (1 / 100 + (3.5 + 0.001) / 100))
    # a load no level carries takes the level with the most req/s
    heavy = next(p for p in pd_sweep(document, total_gpus=2)["points"] if p["decode_lanes"] == 4)
    assert heavy["rps"] == 5.5 and heavy["p90_interactivity"] == pytest.approx(1 / (1 / 60 + (3.5 + 0.001) / 100))
