"""GGUF loading: real files convert, and bad files fail with errors that name the problem."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from agentjax.errors import ModelLoadError, UnsupportedModelError
from checkpoints.gguf import load_gguf, unpermute_qk


def _write_gguf(path, arch="llama", tensor_type=gguf.GGMLQuantizationType.F32):
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    data = np.ones((4, 8), np.float32)
    if tensor_type == gguf.GGMLQuantizationType.F32:
        writer.add_tensor("token_embd.weight", data)
    else:
        # raw bytes of one Q2_K super-block row (256 values per 84 bytes)
        raw = np.zeros((4, 84), np.uint8)
        writer.add_tensor("token_embd.weight", raw, raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match="not found.*missing.gguf"):
        load_gguf(tmp_path / "missing.gguf")


def test_garbage_file_is_reported_as_not_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        load_gguf(bad)


def test_unsupported_architecture_is_named(tmp_path):
    with pytest.raises(UnsupportedModelError, match="'mamba'"):
        load_gguf(_write_gguf(tmp_path / "m.gguf", arch="mamba"))


def test_unsupported_quantisation_type_is_named(tmp_path):
    path = _write_gguf(tmp_path / "q.gguf", tensor_type=gguf.GGMLQuantizationType.Q2_K)
    with pytest.raises(UnsupportedModelError, match="Q2_K"):
        load_gguf(path)


def test_unpermute_inverts_the_gguf_qk_permutation():
    heads, head_dim, hidden = 3, 8, 5
    hf = np.random.default_rng(0).standard_normal((heads * head_dim, hidden))
    # GGUF conversion: rows of each head go from [half0, half1] to interleaved pairs
    permuted = hf.reshape(heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(hf.shape)
    np.testing.assert_array_equal(unpermute_qk(permuted, heads), hf)


def test_smollm2_converts_with_expected_shapes():
    from checkpoints.embedded import smollm2_path

    cfg, arrays, _ = load_gguf(smollm2_path())
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152
    assert arrays["layers.0.attn.q_proj.kernel"].shape == (576, 576)
    assert arrays["layers.0.attn.k_proj.kernel"].shape == (576, 192)
    assert all(a.dtype == np.float32 and np.isfinite(a).all() for a in arrays.values())
