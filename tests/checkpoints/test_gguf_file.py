"""checkpoints.gguf_file reads what `gguf.GGUFReader` reads (metadata and tensor views), and names a
broken file."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from agentjax.errors import ModelLoadError
from checkpoints.gguf import open_gguf
from checkpoints.gguf_file import GGUFFile


def _assert_same_as_gguf_reader(path) -> None:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    keys = [key for key in theirs.fields if not key.startswith("GGUF.")]  # the reader's header entries
    assert list(ours.metadata) == keys
    for key in keys:
        assert ours.metadata[key] == theirs.fields[key].contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors):
        assert mine.tensor_type == reference.tensor_type, mine.name
        assert mine.shape == tuple(int(d) for d in reference.shape), mine.name
        assert mine.data.dtype == reference.data.dtype and mine.data.shape == reference.data.shape, mine.name
        assert np.array_equal(mine.data.view(np.uint8), np.asarray(reference.data).view(np.uint8)), mine.name
        assert not mine.data.flags.writeable


def _write(path, alignment: int | None = None, tensors: bool = True):
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_string("general.name", "ünïcode name")
    writer.add_block_count(2)
    writer.add_float32("test.f32", 0.1)
    writer.add_float64("test.f64", -2.5)
    writer.add_bool("test.flag", True)
    writer.add_int8("test.i8", -7)
    writer.add_uint64("test.u64", 2**40 + 3)
    writer.add_array("test.strings", ["a", "", "tokén", "<|im_end|>"])
    writer.add_array("test.ints", [3, -1, 7])
    writer.add_array("test.floats", [0.5, -0.25])
    if tensors:
        rng = np.random.default_rng(0)
        writer.add_tensor("f32.weight", rng.standard_normal((3, 8)).astype(np.float32))
        writer.add_tensor("f16.weight", rng.standard_normal((2, 4)).astype(np.float16))
        writer.add_tensor("i32.weight", np.arange(5, dtype=np.int32))
        # two rows of two Q8_0 blocks (32 values in 34 bytes each): a [2, 64] matrix
        writer.add_tensor("q8.weight", rng.integers(0, 255, (2, 68), dtype=np.uint8),
                          raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_metadata_and_tensors_match_the_gguf_reader(tmp_path, alignment):
    path = _write(tmp_path / "m.gguf", alignment)
    _assert_same_as_gguf_reader(path)
    q8 = GGUFFile(path).tensors[-1]
    assert q8.shape == (64, 2) and q8.data.shape == (2, 68)
    assert gguf.quants.dequantize(q8.data, q8.tensor_type).shape == (2, 64)


def test_a_file_without_tensors_reads(tmp_path):
    file = GGUFFile(_write(tmp_path / "m.gguf", tensors=False))
    assert file.tensors == [] and file.metadata["test.strings"][2] == "tokén"


def test_truncated_files_name_the_problem(tmp_path):
    whole = _write(tmp_path / "m.gguf").read_bytes()
    header_cut, data_cut = tmp_path / "header.gguf", tmp_path / "data.gguf"
    header_cut.write_bytes(whole[:60])
    data_cut.write_bytes(whole[:-40])
    with pytest.raises(ValueError, match="past the end|ends inside"):
        GGUFFile(header_cut)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file.*q8.weight.*past the end"):
        open_gguf(data_cut)


@pytest.mark.slow  # gguf.GGUFReader takes 3 to 12 s on this file
def test_the_embedded_models_file_reads_as_the_gguf_reader_reads_it():
    from checkpoints.embedded import smollm2_path
    from checkpoints.tokenizer import Tokenizer

    _assert_same_as_gguf_reader(smollm2_path())
    text = "def f(x):\n    return x ** 2  # ünïcode"
    assert Tokenizer.from_gguf(GGUFFile(smollm2_path())).encode(text) == Tokenizer.from_gguf(smollm2_path()).encode(text)
