"""agentjax/server/launcher.py: `agentjax serve` flags reach the engine settings (no server started)."""
from __future__ import annotations

from agentjax.cli import _engine_args, build_parser
from agentjax.server.launcher import engine_config_from_args


def test_parallel_and_process_flags_reach_the_engine_config():
    args = build_parser().parse_args([
        "serve", "--model", "preset:tiny-dense", "--tensor-parallel-size", "4", "--decode-context-parallel-size", "2",
        "--data-parallel-size", "2", "--enable-expert-parallel", "--prefill-context-parallel-size", "1",
        "--coordinator-address", "127.0.0.1:4321", "--num-processes", "2", "--process-id", "1",
    ])
    cfg = engine_config_from_args(args, _engine_args(args))
    assert (cfg.tensor_parallel_size, cfg.decode_context_parallel_size, cfg.data_parallel_size) == (4, 2, 2)
    assert cfg.enable_expert_parallel and cfg.prefill_context_parallel_size == 1
    assert (cfg.coordinator_address, cfg.num_processes, cfg.process_id) == ("127.0.0.1:4321", 2, 1)
    assert cfg.extra == {}


def test_vllm_short_flags_are_accepted():
    args = build_parser().parse_args(["serve", "-tp", "2", "-dp", "4", "-dcp", "2", "-pcp", "1"])
    cfg = engine_config_from_args(args, _engine_args(args))
    assert cfg.parallel.name == "dp4-tp2-dcp2"


def test_prefill_trimming_is_on_unless_the_flag_turns_it_off():
    on = build_parser().parse_args(["serve"])
    off = build_parser().parse_args(["serve", "--no-trim-prefill-to-buckets"])
    assert engine_config_from_args(on, _engine_args(on)).trim_prefill_to_buckets
    assert not engine_config_from_args(off, _engine_args(off)).trim_prefill_to_buckets


def test_key_flags_build_the_key_ring_and_the_environment_stands_in_for_missing_flags(monkeypatch, tmp_path):
    import json

    from agentjax.server.launcher import key_ring_from_args

    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps({"keys": [{"key": "f1", "namespace": "team"}]}))
    monkeypatch.setenv("AGENTJAX_API_KEY", "from-env")
    monkeypatch.setenv("AGENTJAX_OPERATOR_KEY", "ops-env")
    args = build_parser().parse_args(["serve", "--api-key", "k1", "--api-key", "k2", "--api-keys-file",
                                      str(keys_file), "--metrics-without-key"])
    ring = key_ring_from_args(args)
    assert args.metrics_without_key and len(ring) == 4  # k1, k2, f1 and the operator key from the environment
    assert ring.tenant_for("from-env") is None  # --api-key given: the environment's key is not added
    assert ring.tenant_for("ops-env").operator and ring.tenant_for("f1").namespace == "name:team"
    assert key_ring_from_args(build_parser().parse_args(["serve"])).tenant_for("from-env") is not None
    monkeypatch.delenv("AGENTJAX_API_KEY")
    monkeypatch.delenv("AGENTJAX_OPERATOR_KEY")
    assert not key_ring_from_args(build_parser().parse_args(["serve"])).enabled
