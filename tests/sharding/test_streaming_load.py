"""sharding/streaming_load.py: a checkpoint streams straight into a layout's device arrays (quantised parts
split on whole scale blocks) with exactly the values the single-device load places, slab by slab when a
shard is large, after a memory check that names the numbers when the weights do not fit."""
from __future__ import annotations

from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from agentjax.config import EngineConfig
from agentjax.errors import InsufficientMemoryError, ParallelLayoutError
from agentjax.models.params import expected_shapes
from agentjax.models.quantized import StoredWeight
from checkpoints.hf import load_hf
from checkpoints.lazy_reads import READS
from checkpoints.quant_writer import quantize_checkpoint
from sharding.layouts import plan_parameters
from sharding.streaming_load import load_params

DATA = Path(__file__).parents[1] / "models" / "data"


@pytest.fixture(scope="module")
def nvfp4_dir(tmp_path_factory) -> Path:
    return quantize_checkpoint(DATA / "minimax-m3-a", tmp_path_factory.mktemp("s") / "nvfp4", "nvfp4", shards=4,
                               source_dtype=ml_dtypes.bfloat16)


def _host(value) -> np.ndarray:
    return np.asarray(value) if isinstance(value, StoredWeight) else np.asarray(jax.device_get(value))


@pytest.mark.parametrize("settings", [dict(tensor_parallel_size=2), dict(tensor_parallel_size=4),
                                      dict(data_parallel_size=4, enable_expert_parallel=True)],
                         ids=["tp2", "tp4", "dep4"])
def test_a_layout_streams_the_values_of_the_single_device_load(nvfp4_dir, settings):
    cfg, recipes, _ = load_hf(nvfp4_dir, expected_shapes, lazy=True)
    single = dict(nnx.to_flat_state(load_params(cfg, recipes, progress=False)))
    parallel = EngineConfig(numerics="batch_invariant", **settings).parallel
    placed = dict(nnx.to_flat_state(load_params(cfg, recipes, parallel=parallel, numerics="batch_invariant",
                                                progress=False, piece_bytes=4096)))  # small slabs: the slab path too
    plans = plan_parameters(cfg, parallel, "batch_invariant")
    assert placed.keys() == plans.keys()
    quantised_splits = 0
    for path, plan in plans.items():
        value = placed[path].get_value()
        want = plan.place(_host(single[path].get_value()))
        np.testing.assert_array_equal(_host(value), want, err_msg=".".join(map(str, path)))
        if isinstance(value, StoredWeight) and value.codec.values == "e2m1" and any(plan.spec):
            quantised_splits += 1
            local = value.values.addressable_shards[0].data
            assert local.dtype == np.uint8  # each device holds packed E2M1 bytes, not floats
    assert quantised_splits > 0


def test_a_split_that_cuts_a_scale_block_is_a_layout_error(tmp_path):
    coarse = quantize_checkpoint(DATA / "minimax-m3-a", tmp_path / "fp8", "fp8", block=(16, 16), shards=2)
    cfg, recipes, _ = load_hf(coarse, expected_shapes, lazy=True)
    parallel = EngineConfig(tensor_parallel_size=4).parallel
    before = READS.bytes_read
    with pytest.raises(ParallelLayoutError, match=r"experts\.\w+_proj: .*cuts the checkpoint.s scale blocks of 16"):
        load_params(cfg, recipes, parallel=parallel, progress=False)
    assert READS.bytes_read == before


def test_weights_and_kv_that_do_not_fit_fail_with_the_numbers_before_any_read(nvfp4_dir, capsys):
    cfg, recipes, _ = load_hf(nvfp4_dir, expected_shapes, lazy=True)
    before, arrays = READS.bytes_read, len(jax.live_arrays())
    with pytest.raises(InsufficientMemoryError, match=r"needs 0\.00 GB for weights on tp2 \+ 1000000\.00 GB KV; "
                                                      r"it has [\d.]+ GB"):
        load_params(cfg, recipes, parallel=EngineConfig(tensor_parallel_size=2).parallel, kv_bytes=10**15)
    assert READS.bytes_read == before and len(jax.live_arrays()) == arrays
    assert "does not fit" in capsys.readouterr().err


def test_the_accelerator_path_writes_slabs_by_compiled_updates_to_the_same_values(nvfp4_dir, monkeypatch):
    """Off a CPU a shard's slabs go into a zeroed device buffer by a donated dynamic_update_slice; forced here."""
    import sharding.streaming_load as streaming

    cfg, recipes, _ = load_hf(nvfp4_dir, expected_shapes, lazy=True)
    parallel = EngineConfig(data_parallel_size=2, enable_expert_parallel=True).parallel
    in_place = dict(nnx.to_flat_state(load_params(cfg, recipes, parallel=parallel, progress=False, piece_bytes=4096)))
    monkeypatch.setattr(streaming, "_host_view", lambda array: None)
    updated = dict(nnx.to_flat_state(load_params(cfg, recipes, parallel=parallel, progress=False, piece_bytes=4096)))
    for path, variable in in_place.items():
        np.testing.assert_array_equal(_host(updated[path].get_value()), _host(variable.get_value()))
