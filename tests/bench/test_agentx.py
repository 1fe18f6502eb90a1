"""The AgentX replay in process: closed-loop lanes on a tiny preset engine."""
from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from agentjax.bench.agentx import AgentxConfig, AgentxRun, load_sessions
from agentjax.cli import main
from tests.bench.recording_client import RecordingClient

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "agentx-dev"
pytestmark = pytest.mark.skipif(not TRACES.is_dir(), reason=f"no dev traces at {TRACES}")


@pytest.fixture(scope="module")
def few_traces(tmp_path_factory) -> Path:
    """Six dev traces: loading all 180 takes seconds the test does not need."""
    directory = tmp_path_factory.mktemp("traces")
    for path in sorted(TRACES.glob("*.json.gz"))[:6]:
        shutil.copy(path, directory / path.name)
    return directory


@pytest.mark.slow
def test_agentx_in_process(few_traces, tmp_path):
    out = tmp_path / "r.json"
    code = main(["bench", "agentx", "--model", "preset:tiny-dense", "--traces", str(few_traces),
                 "--lanes", "2", "--context-scale", "0.005", "--duration", "15", "--out", str(out)])
    summary = json.loads(out.read_text())
    assert code == 0
    assert summary["errors"] == 0 and summary["requests"] > 0
    assert summary["hit_rate"] > 0.5
    for key in ("tpgs", "p90_interactivity", "hit_rate", "requests", "errors", "ttft_p50_s"):
        assert key in summary
    assert summary["config"]["lanes"] == 2 and summary["warmup_requests"] >= 2


def test_lanes_start_part_way_and_truncate(few_traces):
    """Seeded start turns in the middle half of the session; prompts capped by --max-context."""
    client = RecordingClient()
    config = AgentxConfig(traces=str(few_traces), lanes=3, context_scale=0.01, duration_s=0.2,
                          max_context=100, seed=7)
    sessions = load_sessions(config)
    asyncio.run(AgentxRun(config, sessions, client).run())
    sent = client.sent
    assert sent and all(len(r.prompt) <= 100 for r in sent)
    firsts = {}
    for request in sent:
        firsts.setdefault(request.session_id.split(":")[1], request)
    by_id = {s.session_id: s for s in sessions}
    for lane, request in firsts.items():
        trace = request.session_id.split(":", 3)[3].split("/")[0]
        turns = len(by_id[trace].turns)
        if turns > 1:
            assert int(0.25 * turns) <= request.turn_index <= int(0.75 * turns)
    assert all(r.hints["session_id"] == r.session_id for r in sent)


def _serve_long_prompt(num_tokens: int, batched: int) -> tuple[list, object]:
    import numpy as np

    from agentjax import LLM, SamplingParams

    llm = LLM("preset:tiny-long", max_num_batched_tokens=batched, num_kv_blocks=num_tokens // 16 + 64)
    prompt = np.random.default_rng(0).integers(256, 49_152, num_tokens).tolist()
    out = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))[0]
    return list(llm.engine.step_log), out


def test_tiny_long_preset_chunked_prefill():
    """preset:tiny-long: 1M positions, SmolLM2's vocabulary; a prompt longer than the step budget
    runs in chunks that never exceed it."""
    from agentjax.models.presets import SMOLLM2_VOCAB, preset_config

    cfg = preset_config("tiny-long")
    assert cfg.max_position_embeddings >= 1 << 20 and cfg.vocab_size == SMOLLM2_VOCAB
    steps, out = _serve_long_prompt(1100, batched=512)
    assert out.finish_reason == "length" and len(out.token_ids) == 2
    assert max(sum(row[1] for row in step.rows) for step in steps) <= 512
    assert len(steps) >= 4  # 512 + 512 + 76 prompt tokens, then one decode


@pytest.mark.slow
def test_tiny_long_preset_serves_a_long_prompt_with_bounded_memory():
    # 8K tokens keeps CI time in bounds: the jnp reference attention gathers KV per query token,
    # so prefill time grows with the square of the prompt (a 30K prompt took over 14 minutes).
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    steps, out = _serve_long_prompt(8_192, batched=2048)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert len(out.token_ids) == 2
    assert max(sum(row[1] for row in step.rows) for step in steps) <= 2048
    assert grown_mb < 2048, f"peak memory grew by {grown_mb:.0f} MB"


def test_agentx_with_added_traffic_reports_hits_by_kind_and_kv_group(few_traces, tmp_path):
    """A fixed stream (one session per lane) with retries and compactions added, on a real engine:
    every retry is served from the cache but for its last page, and the summary says where hits came from."""
    out = tmp_path / "r.json"
    code = main(["bench", "agentx", "--model", "preset:tiny-dense", "--traces", str(few_traces), "--lanes", "2",
                 "--context-scale", "0.01", "--duration", "600", "--sessions-per-lane", "1",
                 "--max-output-tokens", "2", "--retry-rate", "0.3", "--compaction", "--out", str(out)])
    summary = json.loads(out.read_text())
    assert code == 0 and summary["errors"] == 0
    by_kind = summary["hit_rate_by_kind"]
    assert {"turn", "retry"} <= set(by_kind)
    retry = by_kind["retry"]
    assert retry["input_tokens"] - retry["cached_tokens"] <= 16 * retry["requests"]  # tiny-dense: 16-token pages
    kv = summary["kv"]
    assert set(kv["group_hits"]) == {"kv"} and kv["hit_tokens"] >= summary["cached_tokens"] > 0
    assert summary["config"]["sessions_per_lane"] == 1 and summary["config"]["compaction"] is True
