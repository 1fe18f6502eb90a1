"""Loaders for weka traces and Mooncake JSONL, prompt token ids, and the trace statistics."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from agentjax.bench.trace_stats import describe_sessions, infinite_cache_hit_rate
from agentjax.bench.traces import (
    Session,
    TokenIdRange,
    Turn,
    load_mooncake_jsonl,
    load_weka_traces,
    prompt_token_ids,
    scale_turn_lengths,
    scaled_block_size,
)
from agentjax.errors import InvalidRequestError

REPO_ROOT = Path(__file__).resolve().parents[2]
TRACES_DIR = Path(os.environ.get("AGENTJAX_TRACES", REPO_ROOT.parent / "shared" / "traces"))
AGENTX_DEV = TRACES_DIR / "agentx-dev"


@pytest.fixture(scope="module")
def dev_statistics():
    if not AGENTX_DEV.is_dir():
        pytest.skip(f"dev traces not found at {AGENTX_DEV} (set AGENTJAX_TRACES to shared/traces)")
    return describe_sessions(load_weka_traces(AGENTX_DEV))


def test_dev_traces_hold_the_readme_request_count(dev_statistics):
    assert dev_statistics.num_sessions == 180
    assert dev_statistics.num_requests == 11_564


# README figure, and how far the loaded stream may be from it. 1% holds for every figure whose
# rounding error is below 1%; "9 s" and "36" are whole numbers, so the median must equal them.
README_MEDIANS = [
    ("main_turns_median", 36, 0.0),
    ("input_tokens_median", 102_000, 0.01),
    ("output_tokens_median", 207, 0.01),
    ("first_turn_input_median", 29_000, 0.01),  # "29K": rounding to 1K is 1.7% here, yet holds
    ("last_turn_input_median", 130_000, 0.01),
    ("think_time_median_s", 9, 0.0),
    ("infinite_cache_hit_rate", 0.963, 0.01),
]


@pytest.mark.parametrize("name,readme_value,tolerance", README_MEDIANS,
                         ids=[name for name, _, _ in README_MEDIANS])
def test_dev_trace_medians_match_the_readme(dev_statistics, name, readme_value, tolerance):
    measured = getattr(dev_statistics, name)
    assert abs(measured - readme_value) <= tolerance * readme_value, (name, measured)


def test_dev_trace_tails_match_the_readme(dev_statistics):
    # Rounded in the README to 1K (mean, p90) or given exactly (max, p90 of turns).
    assert dev_statistics.main_turns_p90 == 152
    assert abs(dev_statistics.input_tokens_mean - 127_000) <= 500
    assert abs(dev_statistics.input_tokens_p90 - 257_000) <= 500
    assert round(dev_statistics.input_tokens_max, -3) == 894_000
    assert round(dev_statistics.output_tokens_mean) == 431


def _write_mooncake(path: Path) -> Path:
    lines = [  # 512-token blocks: ids cover ceil(input / 512) blocks, the last one partial
        {"timestamp": 0, "input_length": 1200, "output_length": 10, "hash_ids": [1, 2, 3]},
        {"timestamp": 250, "input_length": 1700, "output_length": 20, "hash_ids": [1, 2, 4, 5]},
        {"timestamp": 500, "input_length": 512, "output_length": 1, "hash_ids": [1]},
        {"timestamp": 1500, "input_length": 2048, "output_length": 7, "hash_ids": [6, 7, 8, 9]},
        {"timestamp": 2000, "input_length": 1300, "output_length": 3, "hash_ids": [1, 2, 3]},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def test_mooncake_jsonl_loads_lengths_and_arrival_times(tmp_path):
    sessions = load_mooncake_jsonl(_write_mooncake(tmp_path / "trace.jsonl"))
    assert [s.turns[0].input_tokens for s in sessions] == [1200, 1700, 512, 2048, 1300]
    assert [s.turns[0].output_tokens for s in sessions] == [10, 20, 1, 7, 3]
    assert [s.start_offset_s for s in sessions] == [0.0, 0.25, 0.5, 1.5, 2.0]
    assert {s.block_size for s in sessions} == {512}
    prompts = [prompt_token_ids(s, s.turns[0]) for s in sessions]
    assert [len(p) for p in prompts] == [1200, 1700, 512, 2048, 1300]


def test_mooncake_requests_share_exactly_their_common_hash_prefix(tmp_path):
    sessions = load_mooncake_jsonl(_write_mooncake(tmp_path / "trace.jsonl"))
    p = [prompt_token_ids(s, s.turns[0]) for s in sessions]
    assert np.array_equal(p[0][:1024], p[1][:1024])  # ids [1, 2] shared
    assert not np.array_equal(p[0][1024:1200], p[1][1024:1200])  # id 3 against id 4
    assert np.array_equal(p[2], p[0][:512])  # id [1]
    assert np.array_equal(p[4][:1200], p[0])  # same ids [1, 2, 3], a longer partial block
    assert np.mean(p[3][:512] == p[0][:512]) < 0.01  # unrelated ids


def test_mooncake_infinite_cache_counts_global_prefix_hits(tmp_path):
    sessions = load_mooncake_jsonl(_write_mooncake(tmp_path / "trace.jsonl"))
    # hits: 0; 2 blocks of request 2 (1024); 1 block (512, its whole prompt); 0; 3 blocks cut
    # to the 1300-token prompt (1300). Inputs sum to 1200+1700+512+2048+1300 = 6760.
    assert infinite_cache_hit_rate(sessions) == pytest.approx((1024 + 512 + 1300) / 6760)


def _session(session_id: str, scope: str, hash_ids: list[int], input_tokens: int) -> Session:
    turn = Turn(0, np.asarray(hash_ids, dtype=np.int64), input_tokens, 5, 0.0, 0.0)
    return Session(session_id, [turn], 64, scope)


def test_prompt_blocks_depend_on_scope_hash_and_lane_but_tails_on_session_and_turn():
    a = _session("a", "weka:t1", [7, 8], 140)
    b = _session("b", "weka:t1", [7, 9], 140)
    other_trace = _session("c", "weka:t2", [7, 8], 140)
    pa, pb = prompt_token_ids(a, a.turns[0]), prompt_token_ids(b, b.turns[0])
    assert np.array_equal(pa[:64], pb[:64])
    assert np.mean(pa[64:128] == pb[64:128]) < 0.05
    assert np.mean(pa[128:] == pb[128:]) < 0.5  # fresh 12-token tails
    assert np.mean(pa[:64] == prompt_token_ids(other_trace, other_trace.turns[0])[:64]) < 0.05
    other_lane = prompt_token_ids(a, a.turns[0], lane_salt=1)
    assert np.mean(pa[:128] == other_lane[:128]) < 0.05
    assert np.array_equal(pa, prompt_token_ids(a, a.turns[0]))  # deterministic


def test_prompt_token_ids_stay_inside_the_configured_range():
    session = _session("a", "s", list(range(50)), 3_250)
    prompt = prompt_token_ids(session, session.turns[0], token_range=TokenIdRange(100, 300))
    assert prompt.dtype == np.int32 and len(prompt) == 3_250
    assert prompt.min() >= 100 and prompt.max() < 300
    assert len(np.unique(prompt)) == 200  # 3,250 draws cover all 200 ids


def test_prompt_token_ids_are_stable_across_processes():
    code = ("import numpy as np; from agentjax.bench.traces import *; "
            "s = Session('a', [Turn(0, np.array([3, 4]), 150, 1, 0.0, 0.0)], 64, 'x'); "
            "print(prompt_token_ids(s, s.turns[0], 'lane').tolist())")
    outputs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout
               for seed in ("1", "2")}
    assert len(outputs) == 1


def test_context_scale_shrinks_blocks_and_lengths_by_one_ratio():
    assert scaled_block_size(64, 1 / 16) == 4
    assert scaled_block_size(64, 0.001) == 1
    # 100,010 = 1,562 blocks of 64 + 42; at 4/64: 1,562 * 4 + round(42 / 16) = 6,251
    assert scale_turn_lengths(100_010, 444, 64, 1 / 16) == (6_251, 28)  # 444 / 16 = 27.75
    assert scale_turn_lengths(10, 3, 64, 1 / 16) == (1, 1)  # never below 1


def test_scaled_weka_trace_keeps_its_prefix_structure(tmp_path):
    import gzip
    trace = {"id": "t", "block_size": 64, "requests": [
        {"t": 0.0, "type": "n", "in": 202, "out": 64, "hash_ids": [1, 2, 3], "think_time": 0},
        {"t": 9.0, "type": "n", "in": 330, "out": 32, "hash_ids": [1, 2, 3, 4, 5],
         "think_time": 4.0},
        {"t": 5.0, "type": "subagent", "agent_id": "agent_001", "requests": [
            {"t": 0.0, "type": "n", "in": 140, "out": 10, "hash_ids": [1, 9]}]}]}
    with gzip.open(tmp_path / "trace_0001.json.gz", "wt") as file:
        json.dump(trace, file)
    (session,) = load_weka_traces(tmp_path, context_scale=1 / 16)
    assert session.block_size == 4
    assert [t.input_tokens for t in session.turns] == [12 + 1, 20 + 1]  # blocks + tails of 10 -> 10/16 -> 1
    assert [t.output_tokens for t in session.turns] == [4, 2]
    (subagent,) = session.subagents
    assert (subagent.parent_id, subagent.fork_turn, subagent.start_offset_s) == ("t", 0, 5.0)
    first, second = (prompt_token_ids(session, t) for t in session.turns)
    assert np.array_equal(first[:12], second[:12])
    assert np.array_equal(prompt_token_ids(subagent, subagent.turns[0])[:4], first[:4])


def test_a_malformed_mooncake_line_is_refused_with_its_line_number(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}\n'
                    '{"timestamp": 5, "input_length": 2048, "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(InvalidRequestError, match=r"bad.jsonl:2: 1 hash ids cannot cover"):
        load_mooncake_jsonl(path)
