"""The KimiDeltaAttention mixer (agentjax/models/kda.py) on Kimi-Linear fixture weights and in a decoder.

The layer's parameters are filled from the fixtures' checkpoint tensors with only a transpose of the
Linear kernels, and its output is checked against a float64 numpy KDA layer written from transformers.
"""
from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from agentjax.config import KDAConfig, ModelConfig
from agentjax.models.decoder import Decoder
from agentjax.models.kda import KimiDeltaAttention
from agentjax.ragged_batch import RaggedBatch

sys.path.insert(0, str(Path(__file__).parents[1] / "pallas_kernels"))
from kda_numpy_reference import kda_layer  # noqa: E402

DATA = Path(__file__).parent / "data"
# (fixture, KDA layer, hidden, heads, head dim, conv width, rms_norm_eps), as in the fixtures' config.json.
FIXTURES = [("kimi-linear-a", 0, 64, 2, 32, 4, 1e-5), ("kimi-linear-b", 1, 80, 3, 16, 3, 1e-6)]


def _config(hidden, heads, dim, kernel, eps, num_layers=1, mlp=False) -> ModelConfig:
    return ModelConfig(architecture="kimi_linear", vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_layers=num_layers, num_heads=heads, num_kv_heads=heads, head_dim=dim,
                       max_position_embeddings=4096, rms_norm_eps=eps, layer_types=("kda",) * num_layers,
                       kda=KDAConfig(num_heads=heads, head_dim=dim, conv_kernel_size=kernel), tie_word_embeddings=True)


def _checkpoint_layer(fixture: str, layer: int) -> dict[str, np.ndarray]:
    prefix = f"model.layers.{layer}.self_attn."
    tensors = load_file(str(DATA / fixture / "model.safetensors"))
    return {name[len(prefix):]: value for name, value in tensors.items() if name.startswith(prefix)}


def _load(mixer: KimiDeltaAttention, weights: dict[str, np.ndarray]) -> None:
    """Each parameter from the checkpoint tensor of the same name (`.kernel` <- `.weight` transposed)."""
    flat = []
    for path, variable in nnx.to_flat_state(nnx.state(mixer, nnx.Param)):
        name = ".".join(map(str, path))
        if name.endswith(".kernel"):
            value = weights[name.removesuffix(".kernel") + ".weight"].T
        else:
            value = weights[name]
        assert value.shape == variable.get_value().shape, name
        flat.append((path, variable.replace(value=jnp.asarray(value))))
    nnx.update(mixer, nnx.from_flat_state(flat))


def _mixer(fixture, layer, hidden, heads, dim, kernel, eps):
    cfg = _config(hidden, heads, dim, kernel, eps)
    mixer = KimiDeltaAttention(cfg, 0, {"state": 0}, rngs=nnx.Rngs(0))
    weights = _checkpoint_layer(fixture, layer)
    _load(mixer, weights)
    return cfg, mixer, weights


def _steps(mixer, cfg, x, chunks, numerics, page=3):
    """Feed `x` to the mixer in steps of `chunks` tokens, the state carried in page `page`; returns
    the outputs and the final state buffer."""
    kv, done, outs = cfg.new_kv_pages(6, 16), 0, []
    step = nnx.jit(lambda m, x, kv, batch: m(x, kv, batch, numerics, {"state": jnp.int32(0)}))
    for count in chunks:
        batch = RaggedBatch.build([([0] * count, done, [page])], 16, state_groups=(0,))
        padded = np.zeros((batch.num_tokens, x.shape[1]), np.float32)
        padded[:count] = x[done:done + count]
        out, kv = step(mixer, jnp.asarray(padded), kv, batch)
        outs.append(np.asarray(out)[:count])
        done += count
    return np.concatenate(outs), kv


@pytest.mark.parametrize("fixture", FIXTURES, ids=[f[0] for f in FIXTURES])
def test_checkpoint_tensors_fill_every_parameter_by_name_with_at_most_a_transpose(fixture):
    _, mixer, weights = _mixer(*fixture)
    names = {".".join(map(str, p)).replace(".kernel", ".weight") for p, _ in nnx.to_flat_state(nnx.state(mixer))}
    assert names == set(weights)


@pytest.mark.parametrize("numerics", ["fast", "batch_invariant"])
@pytest.mark.parametrize("fixture", FIXTURES, ids=[f[0] for f in FIXTURES])
def test_layer_matches_transformers_kda_written_in_numpy(fixture, numerics):
    cfg, mixer, weights = _mixer(*fixture)
    x = np.random.default_rng(0).normal(size=(70, cfg.hidden_size)).astype(np.float32)
    out, kv = _steps(mixer, cfg, x, [70], numerics)
    ref, state, tail = kda_layer(weights, x, cfg.rms_norm_eps)
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=1e-4)
    heads, dim = cfg.kda.num_heads, cfg.kda.head_dim
    page = np.asarray(kv[0][0, 3])
    np.testing.assert_allclose(page[:heads * dim * dim].reshape(heads, dim, dim), state, atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(page[heads * dim * dim:].reshape(tail.shape), tail, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("numerics", ["fast", "batch_invariant"])
def test_prefill_in_chunks_then_decode_equals_one_prefill(numerics):
    """Chunked prefill of 16 tokens then 1-token decode steps, the state carried by the page,
    against the whole sequence in one step: bitwise in batch_invariant numerics."""
    cfg, mixer, _ = _mixer(*FIXTURES[0])
    x = np.random.default_rng(1).normal(size=(40, cfg.hidden_size)).astype(np.float32)
    whole, whole_kv = _steps(mixer, cfg, x, [40], numerics)
    split, split_kv = _steps(mixer, cfg, x, [16, 16, 3, 1, 1, 1, 1, 1], numerics)
    if numerics == "batch_invariant":
        np.testing.assert_array_equal(split, whole)
        np.testing.assert_array_equal(np.asarray(split_kv[0]), np.asarray(whole_kv[0]))
    else:
        np.testing.assert_allclose(split, whole, atol=1e-5, rtol=1e-5)


def test_kda_decoder_layers_keep_their_states_in_their_own_slots():
    """A 3-layer KDA decoder (one scanned segment, one state group of 3 slots): a prompt in two steps
    gives the hidden states of one step, bitwise, and each layer's state lands in its own slot."""
    cfg = _config(32, 2, 8, 4, 1e-5, num_layers=3)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    prompt = list(np.random.default_rng(2).integers(0, cfg.vocab_size, size=21))
    run = nnx.jit(lambda m, kv, batch: m(kv, batch, "batch_invariant"))

    def steps(chunks):
        kv, done, hidden = cfg.new_kv_pages(4, 16), 0, []
        for count in chunks:
            batch = RaggedBatch.build([(prompt[done:done + count], done, [2])], 16, state_groups=(0,))
            out, kv = run(model, kv, batch)
            hidden.append(np.asarray(out)[:count])
            done += count
        return np.concatenate(hidden), kv

    whole, whole_kv = steps([21])
    split, split_kv = steps([8, 13])
    np.testing.assert_array_equal(split, whole)
    np.testing.assert_array_equal(np.asarray(split_kv[0]), np.asarray(whole_kv[0]))
    states = np.asarray(whole_kv[0])
    assert states.shape == (3, 4, cfg.kda.state_size)
    assert np.all(states[:, [0, 1, 3]] == 0) and all(np.any(states[s, 2] != 0) for s in range(3))
    assert not np.array_equal(states[0, 2], states[1, 2])
