"""scripts/sched_adapter.py: agentjax's scheduler behind the vLLM baseline's sched-mode interface."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from sched_adapter import AgentjaxSchedulerAdapter  # noqa: E402

HARNESS = Path(__file__).resolve().parents[3] / "shared" / "bench" / "vllm_baseline"


def drain(ad, limit=10_000):
    steps, finished = 0, []
    while ad.has_unfinished():
        r = ad.step()
        steps += 1
        finished += r.finished
        assert steps < limit
    return steps, finished


def test_one_turn_decodes_output_len_tokens():
    ad = AgentjaxSchedulerAdapter(num_blocks=64, max_model_len=256)
    ad.add_turn("a", list(range(100, 140)), 3)
    r = ad.step()
    assert (r.num_scheduled_tokens, r.num_scheduled_reqs, r.num_preempted, r.finished) == (40, 1, 0, [])
    assert r.schedule_ns > 0 and r.update_ns > 0
    steps, finished = drain(ad)
    assert steps == 2 and finished == ["a"]


def test_chunked_prefill_gets_no_token_until_done_and_hits_count_like_vllm():
    ad = AgentjaxSchedulerAdapter(num_blocks=256, block_size=16, max_num_batched_tokens=64, max_model_len=1024)
    prompt = list(range(100, 300))  # 200 tokens: 4 prefill steps of at most 64
    ad.add_turn("a", prompt, 2)
    steps, finished = drain(ad)
    assert steps == 4 + 1 and finished == ["a"]
    ad.add_turn("b", prompt + [5, 6, 7], 1)  # 12 full pages of the 200 tokens are cached
    steps, finished = drain(ad)
    s = ad.stats()
    assert finished == ["b"] and s["prefix_requests"] == 2
    assert s["prefix_hit_tokens"] == 192 and s["prefix_query_tokens"] == 200 + 203


def test_preemption_and_recovery_under_a_small_pool():
    ad = AgentjaxSchedulerAdapter(num_blocks=24, block_size=16, max_num_batched_tokens=512, max_model_len=512,
                                  watermark=0.0)
    for i in range(4):
        ad.add_turn(f"r{i}", [1000 * i + k for k in range(80)], 40)  # 5 pages each, grows to 8
    steps, finished = drain(ad)
    s = ad.stats()
    assert sorted(finished) == [f"r{i}" for i in range(4)]
    assert s["preemptions"] > 0 and s["preemptions"] == s["scheduler_num_preemptions"]
    assert s["preempted_resumes"] > 0
    ad.kv.check_invariants()


@dataclass
class _Turn:
    request_key: str
    output_len: int
    tokens: list = field(default_factory=list)


@dataclass
class _Session:
    turns: list


class _Workload:
    """What run_sched_closed_loop reads: sessions of turns, and prompt_token_ids(turn)."""

    def __init__(self, sessions):
        self.sessions = sessions

    def prompt_token_ids(self, t):
        return list(t.tokens)


@pytest.mark.skipif(not (HARNESS / "bench.py").exists(), reason="vLLM baseline harness not present")
def test_harness_closed_loop_runs_every_turn():
    sys.path.insert(0, str(HARNESS))
    from bench import run_sched_closed_loop

    sessions = []
    for s in range(6):  # each turn extends the previous prompt: later turns hit the prefix cache
        base = [10_000 * (s + 1) + k for k in range(64)]
        turns = [_Turn(f"s{s}t{k}", 3 + k, base + list(range(100, 100 + 40 * k))) for k in range(4)]
        sessions.append(_Session(turns))
    ad = AgentjaxSchedulerAdapter(num_blocks=512, block_size=16, max_num_batched_tokens=128, max_model_len=1024)
    res = run_sched_closed_loop(ad, _Workload(sessions), 4)
    assert res["stop_reason"] == "done" and res["completed_turns"] == 24
    assert res["output_tokens_completed"] == sum(t.output_len for s in sessions for t in s.turns)
    assert 0.5 < res["prefix_hit_rate"] < 1 and res["preemptions"] == 0
    assert res["max_running"] <= 4 and not ad.has_unfinished()
