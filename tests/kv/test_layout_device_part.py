"""A "pool" layout built for one device of a parallel layout (agentjax/kv/layout_build.py `device_part`):
the pages per slab are chosen on the device's page sizes, so every group fills a device's slab, and the
memory asked for is each device's. Full-size presets, abstract shapes (host only)."""
from __future__ import annotations

import dataclasses

import pytest

from agentjax.config import EngineConfig
from agentjax.engine_kv import engine_kv_layout
from agentjax.kv.layout_build import build_layout, local_layout
from agentjax.models import preset_config
from sharding.layouts import local_model_config
from sharding.mesh import ParallelConfig

GIB = 2**30
CASES = [("minimax-m3", dict(tensor_parallel_size=8)),
         ("kimi-k3", dict(tensor_parallel_size=8)),
         ("kimi-k3", dict(tensor_parallel_size=8, decode_context_parallel_size=8)),
         ("deepseek-v4-pro", dict(tensor_parallel_size=8))]


def engine_format(name: str):
    """The preset in the KV format the engine stores today (DeepSeek-V4's fp8_ds_mla rows have no device format)."""
    cfg = preset_config(name, abstract=True)
    if cfg.compressed_attention is not None:
        cfg = cfg.replace(compressed_attention=dataclasses.replace(cfg.compressed_attention, kv_format="model_dtype"))
    return cfg


def slab_fill(device) -> list[float]:
    """Of one device's slab, the share each group's pages fill when the slab is that group's."""
    return [g.pages_per_slab * device.page_bytes(i) / device.slab_bytes for i, g in enumerate(device.groups)]


@pytest.mark.parametrize("name, parallel", CASES)
def test_every_group_fills_a_devices_slab_and_the_device_holds_the_memory_asked(name, parallel):
    cfg, par = engine_format(name), ParallelConfig(**parallel)
    block, dcp = par.kv_page_tokens(64), par.decode_context_parallel_size
    part = (local_model_config(cfg, par), dcp)
    device = local_layout(build_layout(cfg, block, memory_bytes=8 * GIB, device_part=part), *part)
    assert min(slab_fill(device)) >= 0.95
    assert 0.95 * 8 * GIB <= device.total_bytes <= 8 * GIB


def test_the_whole_model_geometry_left_a_kimi_k3_devices_slabs_mostly_empty():
    """What the device geometry fixes: chosen on the whole model's pages, a TP8 device's slab held one
    state page of an eighth of the slab, and the pool held a third of the memory asked for per device."""
    cfg, par = engine_format("kimi-k3"), ParallelConfig(tensor_parallel_size=8)
    local = local_model_config(cfg, par)
    whole = local_layout(build_layout(cfg, 64, memory_bytes=8 * GIB), local)
    assert min(slab_fill(whole)) < 0.2
    per_device = local_layout(build_layout(cfg, 64, memory_bytes=8 * GIB, device_part=(local, 1)), local)
    assert per_device.num_slabs > 7 * whole.num_slabs


def test_an_engine_on_a_parallel_layout_sizes_each_device_by_kv_cache_memory_gb():
    cfg = preset_config("tiny-kimi-k3")
    engine_cfg = EngineConfig(kv_cache_memory_gb=0.01, kv_layout="pool", tensor_parallel_size=2)
    layout = engine_kv_layout(cfg, engine_cfg)
    device = local_layout(layout, local_model_config(cfg, engine_cfg.parallel))
    assert 0.9 * 0.01 * GIB <= device.total_bytes <= 0.01 * GIB


def test_num_kv_blocks_on_a_parallel_layout_is_that_many_shared_pages_of_a_devices_share():
    cfg = preset_config("tiny-dense")
    engine_cfg = EngineConfig(num_kv_blocks=64, kv_layout="pool", tensor_parallel_size=2)
    device = local_layout(engine_kv_layout(cfg, engine_cfg), local_model_config(cfg, engine_cfg.parallel))
    shared_page = sum(k.cell_words * len(k.layers) for k in device.kinds) * device.word_bytes
    assert device.total_bytes == 64 * shared_page
