"""Recurrent states in kv-sim (agentjax/bench/kv_sim_states.py): hand-computed hits of a session that
continues a prompt, then branches twice from its first two blocks, under each state retention."""
import json

import pytest

from agentjax.bench.kv_replay import build_replay
from agentjax.bench.kv_sim import PolicyReplay
from agentjax.bench.kv_sim_states import StatePlan, model_state_tokens
from agentjax.bench.traces import load_weka_trace_file
from agentjax.cli import main
from agentjax.errors import InvalidRequestError


def _request(t, hash_ids):
    return {"t": t, "type": "n", "model": "m", "in": 64 * len(hash_ids), "out": 10, "hash_ids": hash_ids,
            "api_time": 1.0, "think_time": 0.0}


# A prompt of 4 blocks, its continuation to 6, then two branches after its first 2 blocks.
TRACE = {"id": "t", "block_size": 64, "requests": [
    _request(0.0, [1, 2, 3, 4]), _request(10.0, [1, 2, 3, 4, 5, 6]), _request(20.0, [1, 2, 9, 10]),
    _request(30.0, [1, 2, 11, 12])]}
INPUT_TOKENS = 64 * (4 + 6 + 4 + 4)


@pytest.fixture
def trace_path(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(TRACE))
    return path


def _hit_blocks(trace_path, states, hbm_blocks=100):
    replay = build_replay([load_weka_trace_file(trace_path)], lanes=1, hint_sigma=0.0)
    simulation = PolicyReplay(replay, "lru", hbm_blocks, states=states)
    result = simulation.run().as_dict()
    simulation.manager.check_invariants()
    assert result["input_tokens"] == INPUT_TOKENS
    return result["hit_tokens"]["device"] // 64, simulation.states


@pytest.mark.parametrize("retention, interval, blocks", [
    ("end", 0, 4),  # the continuation resumes at 4; the branches find no state at 2
    ("interval", 128, 8),  # the first prompt left a state at 2: both branches resume there
    ("marconi", 0, 6),  # the first branch saves a state where its cached prefix ended (2): the second hits it
])
def test_each_retention_hits_what_its_states_allow(trace_path, retention, interval, blocks):
    assert _hit_blocks(trace_path, None)[0] == 4 + 2 + 2  # the attention pages alone
    hit, states = _hit_blocks(trace_path, StatePlan(64.0, retention, interval))
    assert hit == blocks and states.peak * 64 / 6400 == states.summary(6400)["peak_state_share"]


def test_states_beyond_their_share_of_memory_are_evicted_least_recent_first(trace_path):
    hit, states = _hit_blocks(trace_path, StatePlan(64.0, "interval", 128, max_share=0.01))  # one state fits
    assert states.capacity == 1 and hit == 4  # the state at 2 left when the one at 4 was saved
    assert states.evictions > 0 and states.summary(6400)["peak_state_share"] == 0.01


def test_full_size_kimi_k3_state_is_16_8k_tokens_of_its_latent():
    state_tokens, interval = model_state_tokens("kimi-k3")
    assert round(state_tokens) == 16805 and interval == 16816
    with pytest.raises(InvalidRequestError, match="no recurrent state"):
        model_state_tokens("tiny-minimax-m3")


def test_the_cli_reports_the_states_and_refuses_them_with_lower_tiers(trace_path, tmp_path, capsys):
    out = tmp_path / "r.json"
    args = ["bench", "kv-sim", "--traces", str(trace_path), "--lanes", "1", "--hbm-tokens", "6400", "--policies",
            "lru", "--state-tokens", "64", "--state-interval", "128", "--hint-sigma", "0", "--out", str(out)]
    assert main(args) == 0
    summary = json.loads(out.read_text())
    assert summary["results"]["lru"]["token_hit_rate"] == pytest.approx(8 * 64 / INPUT_TOKENS)
    assert summary["results"]["lru"]["states"]["interval_tokens"] == 128
    assert "states: interval (interval 128)" in capsys.readouterr().out
    assert main(args + ["--host-tokens", "640"]) != 0
    assert "modelled on the device only" in capsys.readouterr().err
