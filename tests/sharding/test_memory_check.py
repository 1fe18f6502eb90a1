"""sharding/memory_check.py's KV term: the bytes the streaming loader counts for each device's KV are the
bytes the engine's runner then allocates there (the engine's own layout, one device or its part of it
under TP and DCP), for the pool and the shared layout."""
from __future__ import annotations

import jax
import pytest

from agentjax.config import EngineConfig
from agentjax.engine_kv import engine_kv_layout
from agentjax.models import load_model
from agentjax.runner.model_runner import kv_cache_bytes
from agentjax.runner.sharded_runner import make_model_runner
from sharding.memory_check import kv_bytes_per_device

TP2, TP2_DCP2 = dict(tensor_parallel_size=2), dict(tensor_parallel_size=2, decode_context_parallel_size=2)
CASES = [("tiny-kimi-k3", "pool", {}), ("tiny-kimi-k3", "pool", TP2), ("tiny-kimi-k3", "pool", TP2_DCP2),
         ("tiny-kimi-k3", "shared", TP2), ("tiny-minimax-m3", "pool", TP2), ("tiny-minimax-m3", "shared", {})]


@pytest.mark.parametrize("preset, kv_layout, parallel", CASES)
def test_the_kv_bytes_checked_per_device_are_the_bytes_the_runner_allocates(preset, kv_layout, parallel):
    cfg, params, _ = load_model(f"preset:{preset}")
    engine_cfg = EngineConfig(kv_cache_memory_gb=0.002, kv_layout=kv_layout, block_size=16, **parallel)
    if engine_cfg.parallel.num_devices > len(jax.devices()):
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
    layout = engine_kv_layout(cfg, engine_cfg)
    runner = make_model_runner(cfg, params, layout.num_slabs, engine_cfg, kv_layout=layout)
    expected = kv_cache_bytes(runner.kv_pages) // engine_cfg.parallel.num_devices
    assert kv_bytes_per_device(cfg, engine_cfg) == expected > 0
