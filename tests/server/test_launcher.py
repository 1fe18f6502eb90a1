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


def test_the_ready_line_names_the_url_model_and_kv_capacity_in_tokens_and_memory():
    from types import SimpleNamespace

    import numpy as np

    from agentjax.config import EngineConfig
    from agentjax.server.launcher import ready_line

    def kv(*groups):  # the KV manager's face the ready line reads (agentjax/kv/manager_reads.py)
        prefix = next((g for g in groups if g.spec.hit_rule == "prefix"), None)
        return SimpleNamespace(num_pages=1001, prefix_group=lambda: prefix)

    def group(group_id: int, kind: str, tokens: int, rule: str):
        return SimpleNamespace(group_id=group_id, tokens_per_page=tokens, spec=SimpleNamespace(kind=kind, hit_rule=rule))

    # a MiniMax-M3-like pool: 128-token pages of full attention and indexer keys; 2 GiB of buffers
    engine = SimpleNamespace(kv=kv(group(0, "full_attention", 128, "prefix"), group(1, "indexer_keys", 128, "prefix")),
                             config=EngineConfig(block_size=128),
                             runner=SimpleNamespace(kv_pages=(np.zeros(2**30, np.uint8), np.zeros(2**30, np.uint8))))
    line = ready_line(engine, "minimax", "MiniMax-M3", "127.0.0.1", 8000, 12.34)
    assert line == ("ready on http://127.0.0.1:8000/v1 serving 'minimax' (MiniMax-M3); KV cache: 128,000 tokens "
                    "(1,000 pages of 128) in 2.00 GiB; started in 12.3 s")
    # a recurrent-state group first (Kimi-K3): capacity counts the MLA group's tokens per page
    engine.kv = kv(group(0, "recurrent_state", 64, "checkpoint"), group(1, "mla_latent", 16, "prefix"))
    engine.runner.kv_pages = (np.zeros(3 * 2**20, np.uint8),)
    assert "KV cache: 16,000 tokens (1,000 pages of 16) in 3.0 MiB" in ready_line(engine, "k", "K", "::1", 1, 0)
    engine.runner.kv_pages = (np.zeros(2**30 - 2**20, np.uint8),)  # 1 GiB's worth of whole pages: a bit less
    assert "in 1.00 GiB" in ready_line(engine, "k", "K", "::1", 1, 0)


def test_warm_up_skips_a_data_parallel_engine_and_builds_nothing(caplog):
    """A data-parallel engine counts compiles too, yet warm_up covers single-rank engines only: serve
    logs the skip instead of running a single-rank warm-up on it."""
    from agentjax import LLM
    from agentjax.server.launcher import warm_up_engine
    from tests.sharding.parity import need_devices

    need_devices(2)
    engine = LLM("preset:tiny-dense", num_kv_blocks=16, data_parallel_size=2).engine
    with caplog.at_level("WARNING", logger="agentjax.server.launcher"):
        warm_up_engine(engine, "decode")
    assert "warm-up skipped" in caplog.text
    assert engine.stats()["compiled_executables"] == 0


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
