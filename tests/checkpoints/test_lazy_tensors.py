"""checkpoints/lazy_tensors.py and lazy_quant.py: recipes read exactly the values numpy would give, a region
reads only its bytes, and quantised recipes keep their scale blocks whole."""
from __future__ import annotations

import numpy as np
import pytest

from agentjax.errors import UnsupportedModelError
from checkpoints import lazy_tensors
from checkpoints.lazy_quant import BlockAlignmentError, LazyQuant
from checkpoints.lazy_reads import FileReads, Source
from checkpoints.lazy_tensors import full_index, normalize
from checkpoints.quant_codecs import Codec, encode
from checkpoints.quant_writer import write_safetensors
from checkpoints.safetensors_reader import read_header

RNG = np.random.default_rng(1)


@pytest.fixture
def stored(tmp_path):
    arrays = {"a": RNG.standard_normal((6, 40, 24)).astype(np.float32), "b": RNG.standard_normal((24, 8)).astype(np.float32),
              "c": RNG.standard_normal((24, 8)).astype(np.float32)}
    write_safetensors(tmp_path / "t.safetensors", arrays)
    reads = FileReads()
    entries = read_header(tmp_path / "t.safetensors")
    yield arrays, {n: Source(e, reads) for n, e in entries.items()}, reads
    reads.close()


@pytest.mark.parametrize("index", [(slice(None),), (slice(2, 5), slice(3, 17)), (slice(0, 6), slice(None), slice(5, 9)),
                                   (slice(1, 2), slice(39, 40), slice(0, 24))])
def test_a_region_reads_what_numpy_slicing_gives(stored, index):
    arrays, lazy, _ = stored
    np.testing.assert_array_equal(lazy["a"].read(normalize(index, (6, 40, 24))), arrays["a"][index])


def test_a_row_range_reads_only_its_bytes_and_a_narrow_column_strip_little_more(stored):
    arrays, lazy, reads = stored
    before = reads.bytes_read
    lazy["a"].read(normalize((slice(2, 4),), (6, 40, 24)))
    assert reads.bytes_read - before == 2 * 40 * 24 * 4
    before = reads.bytes_read
    lazy["a"].read(normalize((slice(None), slice(None), slice(0, 3)), (6, 40, 24)))
    assert reads.bytes_read - before == arrays["a"].nbytes // 8  # 3 of 24 columns, row by row


def test_numpy_operations_build_recipes_with_the_same_values(stored):
    arrays, lazy, _ = stored
    a, b, c = arrays["a"], arrays["b"], arrays["c"]
    cases = [
        (lazy["a"].T, a.T), (lazy["a"].transpose(0, 2, 1), a.transpose(0, 2, 1)),
        (np.concatenate([lazy["b"].T, lazy["c"].T], axis=1), np.concatenate([b.T, c.T], axis=1)),
        (np.stack([lazy["b"], lazy["c"]]), np.stack([b, c])), (lazy["a"].reshape(2, 3, 40, 24), a.reshape(2, 3, 40, 24)),
        (lazy["a"][1], a[1]), (lazy["b"] + 1.0, b + 1.0), (lazy["a"][:, 3:9], a[:, 3:9]),
    ]
    for recipe, want in cases:
        assert isinstance(recipe, lazy_tensors.Lazy), type(recipe)
        assert recipe.shape == want.shape
        np.testing.assert_array_equal(np.asarray(recipe), want)
        region = normalize((slice(0, 1),), want.shape)
        np.testing.assert_array_equal(recipe.read(region), want[:1])


def _quant(tmp_path, w, kind="mxfp4", block=(16, 16)):
    values, scales, _ = encode(w, kind, block)
    write_safetensors(tmp_path / "q.safetensors", {"w.values": values, "w.scales": scales})
    entries = read_header(tmp_path / "q.safetensors")
    codec = Codec("e2m1", "e8m0", (1, 32)) if kind == "mxfp4" else Codec("e4m3", "f32", block)
    return LazyQuant(Source(entries["w.values"]), Source(entries["w.scales"]), None, codec, w.shape, "w")


def test_quantised_recipes_transpose_stack_and_split_on_whole_blocks(tmp_path):
    w = RNG.standard_normal((64, 96)).astype(np.float32)
    q = _quant(tmp_path, w)
    dense = np.asarray(q)
    kernel = q.T
    np.testing.assert_array_equal(np.asarray(kernel), dense.T)
    stacked = np.stack([kernel, kernel])
    assert isinstance(stacked, LazyQuant) and stacked.shape == (2, 96, 64)
    np.testing.assert_array_equal(np.asarray(stacked[1]), dense.T)
    values, scales, _ = kernel.region(normalize((slice(32, 64), slice(10, 30)), kernel.shape))
    assert values == (slice(16, 32), slice(10, 30)) and scales == (slice(1, 2), slice(10, 30))
    with pytest.raises(BlockAlignmentError, match="cuts its scale blocks of 32"):
        kernel.region(normalize((slice(0, 48),), kernel.shape))
    np.testing.assert_array_equal(kernel.read_region(normalize((slice(5, 40), slice(3, 7)), kernel.shape)),
                                  dense.T[5:40, 3:7])


def test_joining_quantised_pieces_that_cut_a_block_is_an_error(tmp_path):
    q = _quant(tmp_path, RNG.standard_normal((40, 32)).astype(np.float32), kind="fp8")
    with pytest.raises(UnsupportedModelError, match="cuts scale blocks of 16"):
        np.concatenate([q, q], axis=0)
    joined = np.concatenate([q, q], axis=1)  # columns: 32 is two whole blocks
    np.testing.assert_array_equal(np.asarray(joined), np.concatenate([np.asarray(q)] * 2, axis=1))
    assert full_index(joined.shape) == (slice(0, 40), slice(0, 64))
