"""The KV policy simulator (agentjax/bench/kv_replay.py, kv_sim.py, kv_sim_cli.py): the replay model,
hand-computed hit rates per policy and tier on a tiny synthetic trace set, and the CLI's r.json."""
import json
import math

import pytest

from agentjax.bench.kv_replay import build_replay, infinite_cache_hits, next_uses
from agentjax.bench.kv_sim import KVSimConfig, PolicyReplay, simulate
from agentjax.bench.kv_sim_cli import parse_tokens, trace_paths
from agentjax.bench.traces import load_weka_trace_file
from agentjax.cli import main
from agentjax.errors import InvalidRequestError


def _request(t, hash_ids, api_time=1.0):
    return {"t": t, "type": "n", "model": "m", "in": 64 * len(hash_ids), "out": 10, "hash_ids": hash_ids,
            "api_time": api_time, "think_time": 0.0}


# Session A: three turns growing 2 -> 3 -> 4 blocks; session B: two turns, 2 -> 3 blocks.
TRACE_A = {"id": "trace_a", "block_size": 64, "requests": [
    _request(0.0, [1, 2]), _request(10.0, [1, 2, 3]), _request(30.0, [1, 2, 3, 4])]}
TRACE_B = {"id": "trace_b", "block_size": 64, "requests": [_request(0.0, [1, 2]), _request(5.0, [1, 2, 3])]}
INPUT_TOKENS = 64 * (2 + 3 + 4 + 2 + 3)


@pytest.fixture
def trace_dir(tmp_path):
    for name, trace in (("trace_b.json", TRACE_B), ("trace_a.json", TRACE_A)):
        (tmp_path / name).write_text(json.dumps(trace))
    return tmp_path


@pytest.fixture
def replay(trace_dir):
    sessions = [load_weka_trace_file(path) for path in trace_paths(str(trace_dir / "*.json"))]
    return build_replay(sessions, lanes=2, stagger_s=10.0, hint_sigma=0.0)


def test_replay_lays_sessions_on_lanes_in_file_name_order(replay):
    # A (first by name) on lane 0 from 0 s, B on lane 1 from 10 s; ties go by session order.
    arrivals = [(r.session_id, r.arrival_s) for r in replay.requests]
    assert arrivals == [("0:trace_a", 0.0), ("0:trace_a", 10.0), ("1:trace_b", 10.0), ("1:trace_b", 15.0),
                        ("0:trace_a", 30.0)]
    # Exact hints with sigma 0: the recorded gap to the session's next request; the last one ends it.
    assert [r.expected_next_turn_s for r in replay.requests] == [10.0, 20.0, 5.0, None, None]
    assert [r.session_end for r in replay.requests] == [False, False, False, True, True]
    assert replay.input_tokens == INPUT_TOKENS


def test_a_lane_runs_its_sessions_back_to_back_and_subagents_beside_their_parent(tmp_path):
    parent = {"id": "p", "block_size": 64, "requests": [
        _request(0.0, [1]), _request(4.0, [1, 2], api_time=2.0),
        {"t": 5.0, "type": "subagent", "agent_id": "sub", "requests": [
            _request(0.0, [1, 7]), _request(3.0, [1, 7, 8], api_time=4.0)]},
        _request(9.0, [1, 2, 3])]}
    follower = {"id": "q", "block_size": 64, "requests": [_request(0.0, [5])]}
    sessions = [load_weka_trace_file(_write(tmp_path, name, trace)) for name, trace in (("a.json", parent),
                                                                                      ("b.json", follower))]
    replay = build_replay(sessions, lanes=1, stagger_s=10.0, hint_sigma=0.0)
    assert [r.session_id for r in replay.requests] == ["0:p", "0:p", "0:p/sub", "0:p/sub", "0:p", "1:q"]
    assert [r.expected_next_turn_s for r in replay.requests] == [4.0, 5.0, 3.0, None, None, None]
    assert [r.arrival_s for r in replay.requests] == [0.0, 4.0, 5.0, 8.0, 9.0, 12.0]
    by_time = {r.arrival_s: r for r in replay.requests}
    assert by_time[5.0].parent_session_id == "0:p" and by_time[8.0].session_end  # the subagent's last
    assert by_time[4.0].branch_point and not by_time[0.0].branch_point  # the fork turn
    # The lane's next session starts when the last request (the subagent's, 8 + 4 s) has finished.
    assert by_time[12.0].session_id == "1:q"
    with pytest.raises(InvalidRequestError, match="lanes"):
        build_replay(sessions, lanes=0)


def _write(directory, name, trace):
    path = directory / name
    path.write_text(json.dumps(trace))
    return path


def test_next_uses_and_the_infinite_cache_on_the_tiny_replay(replay):
    future = next_uses(replay)
    assert future[0].tolist() == [1.0, 1.0]  # A's first turn: both blocks read again by request 1
    assert future[1].tolist() == [4.0, 4.0, 4.0]
    assert future[3].tolist() == [math.inf] * 3  # B's last turn
    assert infinite_cache_hits(replay).tolist() == [0, 2, 0, 2, 3]


def _rate(replay, policy, hbm_blocks, host_blocks=0):
    simulation = PolicyReplay(replay, policy, hbm_blocks, host_blocks, future=next_uses(replay))
    result = simulation.run().as_dict()
    simulation.manager.check_invariants()
    return result


def test_hit_rates_per_policy_match_the_hand_computed_replay(replay):
    # Capacity 3 blocks. LRU: A1 hits 2 blocks, B0 evicts A's tail (A3, A2), B1 hits 2 and evicts
    # A1, so A2 misses: 4 blocks. Belady and the hints both evict A's tail at B0 (A comes back at
    # 30 s, B at 15 s), then B's new tail (never read again): A2 hits A1, 5 blocks.
    assert _rate(replay, "lru", 3)["token_hit_rate"] == pytest.approx(4 * 64 / INPUT_TOKENS)
    assert _rate(replay, "belady", 3)["token_hit_rate"] == pytest.approx(5 * 64 / INPUT_TOKENS)
    assert _rate(replay, "hints", 3)["token_hit_rate"] == pytest.approx(5 * 64 / INPUT_TOKENS)


def test_a_host_tier_serves_what_the_device_evicted(replay):
    # A host of 6 blocks stores every turn: A2 finds A1..A3 there (LRU) or A2..A3 after A1 on the device.
    lru = _rate(replay, "lru", 3, host_blocks=6)
    assert lru["tiers"] == {"device": pytest.approx(256 / INPUT_TOKENS), "host": pytest.approx(192 / INPUT_TOKENS),
                            "disk": 0.0}
    hints = _rate(replay, "hints", 3, host_blocks=6)
    assert hints["tiers"]["device"] == pytest.approx(320 / INPUT_TOKENS)
    assert hints["token_hit_rate"] == pytest.approx(448 / INPUT_TOKENS)  # the infinite cache's rate
    assert lru["blocks_written"] == {"host": 7}


def test_a_disk_tier_below_a_tiny_host_serves_the_rest(replay):
    simulation = PolicyReplay(replay, "lru", 3, host_blocks=1, disk_blocks=6)
    result = simulation.run().as_dict()
    assert result["tiers"]["device"] == pytest.approx(256 / INPUT_TOKENS)
    assert result["tiers"]["host"] + result["tiers"]["disk"] == pytest.approx(192 / INPUT_TOKENS)
    assert result["tiers"]["disk"] > 0
    assert result["token_hit_rate"] == pytest.approx(0.5)


def test_simulate_runs_lru_and_belady_always_and_names_the_best_online_policy(replay):
    summary = simulate(replay, KVSimConfig(lanes=2, hbm_tokens=192, policies=["hints", "marconi"]))
    results = summary["results"]
    assert list(results) == ["lru", "belady", "hints", "marconi", "infinite"]
    assert results["infinite"]["token_hit_rate"] == pytest.approx(0.5)
    assert results["belady"]["of_belady"] == 1.0
    assert summary["best_online"]["policy"] == "hints"
    with pytest.raises(InvalidRequestError, match="hbm-tokens"):
        simulate(replay, KVSimConfig(lanes=2, hbm_tokens=10))


def test_cli_writes_r_json_with_the_documented_keys(trace_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    code = main(["bench", "kv-sim", "--traces", str(trace_dir / "*.json"), "--lanes", "2", "--hbm-tokens", "192",
                 "--host-tokens", "384", "--policies", "lru,hints,marconi", "--hint-sigma", "0", "--out", str(out)])
    assert code == 0
    summary = json.loads(out.read_text())
    for policy in ("lru", "belady", "hints", "marconi", "infinite"):
        result = summary["results"][policy]
        assert 0.0 <= result["token_hit_rate"] <= 1.0
        assert set(result["tiers"]) == {"device", "host", "disk"}
    assert summary["results"]["lru"]["host_token_hit_rate"] == pytest.approx(192 / INPUT_TOKENS)
    assert summary["config"]["hbm_tokens"] == 192 and summary["config"]["num_trace_files"] == 2
    assert summary["workload"] == {"sessions": 2, "requests": 5, "input_tokens": INPUT_TOKENS}
    printed = capsys.readouterr()
    # the progress bar runs over four policies' five requests each and ends full
    assert "best online" in printed.out and "[kv-sim] [" in printed.err and "20/20 requests 100%" in printed.err


def test_token_counts_parse_with_decimal_suffixes():
    assert [parse_tokens(text) for text in ("1M", "4m", "64k", "12345", "1.5M")] == [
        1_000_000, 4_000_000, 64_000, 12_345, 1_500_000]
    with pytest.raises(Exception, match="token count"):
        parse_tokens("lots")
    with pytest.raises(InvalidRequestError, match="matches no trace files"):
        trace_paths("/nonexistent/*.json.gz")
    assert parse_tokens("0") == 0
