"""Block-quantised weights kept on the device (agentjax.models.block_weights): exact float32 values,
the lookups and projections that avoid dequantising a whole table, the cache's flat form, GGUF's three
block formats, and the embedded model giving bit-identical logits with and without blocks."""
from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentjax.models import block_weights
from agentjax.models.block_weights import BLOCK, BlockWeight, flatten_blocks, project, take_rows, unflatten_blocks
from agentjax.numerics import dense
from checkpoints.gguf import block_parts, load_gguf


def _random_block_weight(rows, cols, axis, seed=0, offset=True, q_dtype=np.uint8):
    rng = np.random.default_rng(seed)
    blocked = (rows, cols // BLOCK) if axis == -1 else (rows // BLOCK, cols)
    q = rng.integers(0, 16, (rows, cols)).astype(q_dtype)
    scale = rng.standard_normal(blocked).astype(np.float16).astype(np.float32)
    low = rng.standard_normal(blocked).astype(np.float16).astype(np.float32) if offset else None
    return BlockWeight(q, scale, low, axis=axis)


def _reference(weight: BlockWeight) -> np.ndarray:
    """Element by element: q * scale + offset of the element's block."""
    q = weight.q.astype(np.float32)
    rows, cols = q.shape
    r = np.arange(rows)[:, None] // (1 if weight.axis == -1 else BLOCK)
    c = np.arange(cols)[None, :] // (BLOCK if weight.axis == -1 else 1)
    out = q * weight.scale[r, c]
    return out + weight.offset[r, c] if weight.offset is not None else out


@pytest.mark.parametrize("axis", [-1, -2])
@pytest.mark.parametrize("offset", [True, False])
def test_dequantize_matches_the_elementwise_definition_on_device_and_host(axis, offset):
    weight = _random_block_weight(64, 96, axis, offset=offset)
    expected = _reference(weight)
    np.testing.assert_array_equal(np.asarray(weight), expected)
    on_device = jax.jit(lambda w: w[...])(weight.to_device())
    np.testing.assert_array_equal(np.asarray(on_device), expected)
    assert weight.shape == (64, 96) and weight.dtype == np.float32


def test_swap_last_axes_is_the_transpose_and_stack_adds_a_leading_axis():
    weight = _random_block_weight(64, 32, -1)
    swapped = weight.swap_last_axes()
    assert swapped.axis == -2 and swapped.shape == (32, 64)
    np.testing.assert_array_equal(np.asarray(swapped), np.asarray(weight).T)
    layers = [_random_block_weight(64, 32, -2, seed=s) for s in range(3)]
    stacked = BlockWeight.stack(layers)
    assert stacked.shape == (3, 64, 32)
    np.testing.assert_array_equal(np.asarray(stacked[...]), np.stack([np.asarray(w) for w in layers]))
    scanned = jax.lax.map(lambda w: w[...].sum(), stacked)  # a layer scan slices every part
    np.testing.assert_allclose(np.asarray(scanned), [np.asarray(w).sum() for w in layers], rtol=1e-5)


def test_a_weight_is_read_whole():
    with pytest.raises(TypeError, match="read whole"):
        _random_block_weight(32, 32, -1)[0]
    with pytest.raises(ValueError, match="last two axes"):
        BlockWeight(np.zeros((2, 32, 32), np.uint8), np.zeros((2, 32, 1), np.float32), axis=0)


def test_take_rows_dequantises_only_the_rows_asked_for():
    table = _random_block_weight(50, 64, -1, q_dtype=np.int8, offset=False).to_device()
    ids = jnp.asarray([3, 0, 49, 3])
    np.testing.assert_array_equal(np.asarray(take_rows(table, ids)), np.asarray(table)[[3, 0, 49, 3]])
    plain = jnp.asarray(np.asarray(table))
    np.testing.assert_array_equal(np.asarray(take_rows(plain, ids)), np.asarray(plain)[[3, 0, 49, 3]])
    with pytest.raises(ValueError, match="blocked along its rows"):
        take_rows(_random_block_weight(64, 64, -2), ids)


@pytest.mark.parametrize("numerics", ["fast", "batch_invariant"])
@pytest.mark.parametrize("transposed", [False, True])
def test_project_in_chunks_equals_the_dense_matmul(monkeypatch, numerics, transposed):
    monkeypatch.setattr(block_weights, "HEAD_CHUNK_ROWS", 32)  # 4 chunks of the 128 output columns
    weight = (_random_block_weight(128, 64, -1, seed=1) if transposed
              else _random_block_weight(64, 128, -2, seed=1)).to_device()
    x = jnp.asarray(np.random.default_rng(2).standard_normal((5, 64)), jnp.float32)
    matrix = jnp.asarray(np.asarray(weight))
    expected = dense(x, matrix.T if transposed else matrix, numerics)
    got = jax.jit(lambda x, w: project(x, w, numerics, transposed=transposed))(x, weight)
    assert got.shape == (5, 128)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)
    # An output width that is no multiple of the chunk (Gemma-3's 262,144-token vocabulary): whole chunks,
    # then the rest; one narrower than two chunks is one matrix.
    for columns in (80, 48):
        ragged = (_random_block_weight(columns, 64, -1, seed=3) if transposed
                  else _random_block_weight(64, columns, -2, seed=3)).to_device()
        matrix = jnp.asarray(np.asarray(ragged))
        np.testing.assert_allclose(np.asarray(project(x, ragged, numerics, transposed=transposed)),
                                   np.asarray(dense(x, matrix.T if transposed else matrix, numerics)),
                                   rtol=1e-5, atol=1e-5)


def test_flat_cache_form_round_trips_and_names_a_broken_entry():
    arrays = {"embed": _random_block_weight(64, 32, -1, offset=False, q_dtype=np.int8),
              "layers.0.mlp.down_proj.kernel": _random_block_weight(64, 32, -2),
              "final_norm.weight": np.ones(32, np.float32)}
    flat = flatten_blocks(arrays)
    assert sorted(flat) == ["embed#q", "embed#scale", "final_norm.weight", "layers.0.mlp.down_proj.kernel#offset",
                            "layers.0.mlp.down_proj.kernel#q", "layers.0.mlp.down_proj.kernel#scale"]
    back = unflatten_blocks(flat)
    for name, value in arrays.items():
        assert type(back[name]) is type(value)
        np.testing.assert_array_equal(np.asarray(back[name]), np.asarray(value))
    assert back["embed"].axis == -1 and back["layers.0.mlp.down_proj.kernel"].axis == -2
    with pytest.raises(ValueError, match="needs its q and scale"):
        unflatten_blocks({"embed#q": flat["embed#q"]})
    with pytest.raises(ValueError, match="does not fit blocks"):
        unflatten_blocks({"embed#q": flat["embed#q"], "embed#scale": np.zeros((3, 3), np.float32)})


# -- GGUF's block formats ------------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1,
                                   gguf.GGMLQuantizationType.Q8_0])
def test_gguf_block_parts_read_back_exactly_as_gguf_dequantises(qtype):
    from types import SimpleNamespace

    values = np.random.default_rng(4).standard_normal((6, 128)).astype(np.float32)
    data = gguf.quants.quantize(values, qtype)
    tensor = SimpleNamespace(tensor_type=qtype, data=data, shape=np.array([128, 6]), name="t")
    parts = block_parts(tensor)
    np.testing.assert_array_equal(np.asarray(BlockWeight(*parts, axis=-1)),
                                  gguf.quants.dequantize(data, qtype).reshape(6, 128))
    assert block_parts(SimpleNamespace(tensor_type=gguf.GGMLQuantizationType.Q6_K)) is None


def _write_tiny_gguf(path):
    rng = np.random.default_rng(5)
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_block_count, 1), (writer.add_context_length, 64), (writer.add_embedding_length, 64),
                       (writer.add_feed_forward_length, 64), (writer.add_head_count, 2), (writer.add_head_count_kv, 1),
                       (writer.add_layer_norm_rms_eps, 1e-5)):
        add(value)
    tensors = {"token_embd.weight": ((8, 64), gguf.GGMLQuantizationType.Q8_0),
               "blk.0.attn_q.weight": ((64, 64), gguf.GGMLQuantizationType.Q4_0),
               "blk.0.attn_k.weight": ((32, 64), gguf.GGMLQuantizationType.Q4_1),
               "blk.0.ffn_down.weight": ((64, 64), gguf.GGMLQuantizationType.F32)}
    for name, (shape, qtype) in tensors.items():
        values = rng.standard_normal(shape).astype(np.float32)
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_load_gguf_keeps_blocks_with_the_float32_values(tmp_path):
    path = _write_tiny_gguf(tmp_path / "tiny.gguf")
    _, dense_arrays, _ = load_gguf(path)
    _, kept, _ = load_gguf(path, keep_blocks=True)
    assert {n for n, v in kept.items() if isinstance(v, BlockWeight)} == {
        "embed", "layers.0.attn.q_proj.kernel", "layers.0.attn.k_proj.kernel"}
    assert kept["embed"].axis == -1 and kept["layers.0.attn.q_proj.kernel"].axis == -2
    for name, array in dense_arrays.items():
        assert kept[name].shape == array.shape
        np.testing.assert_array_equal(np.asarray(kept[name]), array)  # unpermuted and transposed alike


def test_blocks_that_do_not_read_back_exactly_stay_float32(tmp_path, monkeypatch, caplog):
    import checkpoints.gguf as gguf_module

    path = _write_tiny_gguf(tmp_path / "tiny.gguf")
    _, dense_arrays, _ = load_gguf(path)
    real = gguf_module.block_parts

    def off_by_a_scale(tensor):  # a reader bug: every scale doubled
        parts = real(tensor)
        return None if parts is None else (parts[0], parts[1] * 2, parts[2])

    monkeypatch.setattr(gguf_module, "block_parts", off_by_a_scale)
    with caplog.at_level("WARNING", logger="checkpoints.gguf"):
        _, kept, _ = load_gguf(path, keep_blocks=True)
    assert not any(isinstance(v, BlockWeight) for v in kept.values())
    for name, array in dense_arrays.items():
        np.testing.assert_array_equal(kept[name], array)
    assert sum("keeping it as float32" in r.getMessage() for r in caplog.records) == 3


# -- the embedded model --------------------------------------------------------------------------------
@pytest.mark.slow
def test_embedded_model_gives_identical_logits_with_blocks_in_both_numerics():
    from agentjax.models import load_model
    from agentjax.ragged_batch import RaggedBatch
    from agentjax.runner import make_step

    cfg, blocked, _ = load_model(None)
    _, plain, _ = load_model(None, gguf_blocks=False)
    assert isinstance(blocked["embed"].get_value(), BlockWeight)
    assert isinstance(plain["embed"].get_value(), jax.Array)
    sizes = [sum(getattr(leaf, "nbytes", 0) for leaf in jax.tree.leaves(p)) for p in (blocked, plain)]
    assert sizes[0] < 0.35 * sizes[1], sizes  # the weights' bytes on the device
    page = 16
    batch = RaggedBatch.build([(list(range(5, 45)), 0, [[1, 2, 3]]), ([7], 20, [[4, 5]]), ([9, 10, 11], 30, [[6, 7, 8]])],
                              page)
    for numerics in ("fast", "batch_invariant"):
        step = make_step(cfg, numerics=numerics)
        logits = []
        for params in (plain, blocked):
            kv = cfg.new_kv_pages(num_pages=10, page_size=page)
            out, _ = step(params, kv, batch)
            logits.append(np.asarray(out))
        np.testing.assert_array_equal(logits[1], logits[0])
