"""The Mosaic GPU paged decode kernel against the jnp reference, in the Mosaic GPU interpreter
with race detection on (every test also checks that the interpreter found no race)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as gpu_interpreter
from jax.experimental.pallas import mosaic_gpu as plgpu

from agentjax.errors import KernelShapeError
from agentjax.ragged_batch import RaggedBatch
from pallas_kernels.paged_decode_attention_mgpu import decode_attention_step, paged_decode_attention
from pallas_kernels.ragged_paged_attention import attend_paged, ragged_paged_attention

RACE_CHECKED = plgpu.InterpretGPUParams(detect_races=True)


@pytest.fixture(autouse=True)
def fresh_interpreter_state():
    gpu_interpreter.reset_gpu_interpret_mode_state()
    yield


def _assert_no_race():
    assert not gpu_interpreter.get_races().races_found, "the Mosaic GPU interpreter found a data race"


def _decode_case(kv_lens, *, num_heads, num_kv_heads, dim=64, page_size=16, seed=0):
    rng = np.random.default_rng(seed)
    max_pages = max(1, -(-max(kv_lens) // page_size))
    num_pages = 2 + len(kv_lens) * max_pages
    tables = rng.permutation(np.arange(1, num_pages))[: len(kv_lens) * max_pages].reshape(len(kv_lens), max_pages)
    kv_pages = jnp.asarray(rng.standard_normal((2, num_pages, page_size, 2 * num_kv_heads, dim)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((len(kv_lens), num_heads, dim)), jnp.bfloat16)
    return q, kv_pages, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(tables, jnp.int32)


def _compare(kv_lens, *, num_heads=4, num_kv_heads=2, dim=64, page_size=16, seed=0, kernel_options=None, **options):
    q, kv_pages, kv_lens_array, tables = _decode_case(kv_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                                      dim=dim, page_size=page_size, seed=seed)
    options.setdefault("sm_scale", dim**-0.5)
    out, lse = paged_decode_attention(q, kv_pages, kv_lens_array, tables, layer=1, interpret=RACE_CHECKED,
                                      **options, **(kernel_options or {}))
    _assert_no_race()
    reference = jax.jit(lambda q, kv_pages, tables, positions: attend_paged(q, kv_pages, 1, tables, positions,
                                                                           **options))
    want_out, want_lse = reference(q, kv_pages, tables, kv_lens_array - 1)
    live = np.asarray(kv_lens) > 0
    np.testing.assert_allclose(np.asarray(out, np.float32)[live], np.asarray(want_out, np.float32)[live],
                               atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(np.asarray(lse)[live], np.asarray(want_lse)[live], atol=2e-3, rtol=2e-3)
    if not live.all():
        assert not np.asarray(out)[~live].any()


def test_decode_kernel_matches_reference_across_page_boundaries_with_no_race():
    _compare([5, 70, 130, 64], sliding_window=100, soft_cap=2.0, sinks=jnp.array([0.5, -1.0, 3.0, 0.0]),
             kernel_options=dict(num_kv_splits=2))


@pytest.mark.slow
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (16, 2), (6, 3)])
def test_decode_kernel_gqa_ratios(num_heads, num_kv_heads):
    _compare([33, 100], num_heads=num_heads, num_kv_heads=num_kv_heads, seed=num_heads)


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    dict(sliding_window=40),
    dict(soft_cap=1.5),
    dict(sinks=jnp.array([0.5, -1.0, 3.0, 0.0])),
], ids=["window", "soft_cap", "sinks"])
def test_decode_kernel_window_soft_cap_and_sinks(options):
    _compare([1, 77, 150], seed=2, **options)


@pytest.mark.slow
@pytest.mark.parametrize("kernel_options", [
    dict(num_kv_splits=3),
    dict(max_concurrent_steps=1),
    dict(max_concurrent_steps=3, block_kv=128),
], ids=["three_splits", "one_stage", "three_stages_block128"])
def test_decode_kernel_splits_and_pipeline_depths(kernel_options):
    _compare([0, 200, 129], seed=3, kernel_options=kernel_options, sinks=jnp.array([0.1, 0.2, -0.3, 1.0]))


@pytest.mark.slow
def test_decode_kernel_pages_larger_than_a_block():
    _compare([150, 300], page_size=128, seed=4)


def test_decode_step_matches_ragged_paged_attention_on_a_decode_batch():
    rng = np.random.default_rng(5)
    cached = [9, 40, 17]
    page_size, num_heads, num_kv_heads, dim = 16, 4, 2, 64
    tables = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    batch = RaggedBatch.build([([1], c, t) for c, t in zip(cached, tables)], page_size)
    kv_pages = jnp.asarray(rng.standard_normal((1, 10, page_size, 2 * num_kv_heads, dim)), jnp.bfloat16)
    q, k, v = (jnp.asarray(rng.standard_normal((batch.num_tokens, h, dim)), jnp.bfloat16)
               for h in (num_heads, num_kv_heads, num_kv_heads))
    common = dict(layer=0, slot_mapping=batch.slot_mapping[0], sm_scale=0.125, return_lse=True,
                  token_seq_ids=batch.seq_ids, token_positions=batch.positions)
    arrays = (q, k, v, kv_pages, batch.kv_lens, batch.page_indices[0], batch.cu_q_lens)
    out, pages, lse = decode_attention_step(*arrays, interpret=RACE_CHECKED, **common)
    _assert_no_race()
    want_out, want_pages, want_lse = jax.jit(functools.partial(ragged_paged_attention, **common))(*arrays)
    np.testing.assert_array_equal(np.asarray(pages, np.float32), np.asarray(want_pages, np.float32))
    np.testing.assert_allclose(np.asarray(out[:3], np.float32), np.asarray(want_out[:3], np.float32), atol=2e-2)
    np.testing.assert_allclose(np.asarray(lse[:3]), np.asarray(want_lse[:3]), atol=2e-3)
    assert not np.asarray(out[3:]).any() and np.isneginf(np.asarray(lse[3:])).all()


def test_race_detector_is_live_in_this_jax():
    """A kernel that copies shared memory out without committing it must be reported."""

    @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct((128,), jnp.float32),
                       scratch_types=[plgpu.SMEM((128,), jnp.float32)], interpret=RACE_CHECKED)
    def racy(out_ref, smem):
        smem[...] = jnp.ones((128,), jnp.float32)
        plgpu.copy_smem_to_gmem(smem, out_ref)  # missing plgpu.commit_smem()
        plgpu.wait_smem_to_gmem(0)

    racy()
    assert gpu_interpreter.get_races().races_found


def test_decode_kernel_rejects_float32_and_small_pages():
    q, kv_pages, kv_lens, tables = _decode_case([5], num_heads=2, num_kv_heads=1, page_size=4)
    with pytest.raises(KernelShapeError, match="page_size=4"):
        paged_decode_attention(q, kv_pages, kv_lens, tables, layer=0, sm_scale=1.0, interpret=RACE_CHECKED)
    with pytest.raises(KernelShapeError, match="float32"):
        paged_decode_attention(q.astype(jnp.float32), kv_pages.astype(jnp.float32), kv_lens, tables, layer=0,
                               sm_scale=1.0, interpret=RACE_CHECKED)
