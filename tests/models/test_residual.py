"""DeepSeek-V4's mHC residual topology (agentjax/models/residual.py) against a float64 numpy transcription of
transformers 5.24.0's DeepseekV4HyperConnection, DeepseekV4HyperHead and the decoder layer's stream update."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from agentjax.config import HyperConnectionConfig, ModelConfig
from agentjax.errors import InvalidRequestError
from agentjax.models.residual import HyperConnectionResidual, HyperHead, StreamMix, layer_residual, residual_stream

NUMERICS = ("fast", "batch_invariant")


def _config(hidden: int = 16, streams: int = 4, iterations: int = 20, eps: float = 1e-6) -> ModelConfig:
    return ModelConfig(architecture="deepseek_v4", vocab_size=32, hidden_size=hidden, intermediate_size=8, num_layers=1,
                       num_heads=1, num_kv_heads=1, head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-6,
                       hyper_connections=HyperConnectionConfig(streams, iterations, eps))


def _randomize(module: nnx.Module, seed: int) -> dict[str, np.ndarray]:
    """Every parameter random (biases and scales away from their init), returned in float64."""
    rng = np.random.default_rng(seed)
    params = {}
    for path, variable in nnx.to_flat_state(nnx.state(module)):
        shape, leaf = variable.get_value().shape, str(path[-1])
        if leaf == "fn":
            value = rng.standard_normal(shape) / np.sqrt(shape[0])
        elif leaf == "base":
            value = 0.5 * rng.standard_normal(shape)
        else:  # scale
            value = 1.0 + 0.3 * rng.standard_normal(shape)
        variable.set_value(jnp.asarray(value, jnp.float32))
        params[".".join(map(str, path))] = np.asarray(value, np.float32).astype(np.float64)
    return params


def _sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def _normed(streams: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    flat = streams.reshape(streams.shape[0], -1)
    return flat / np.sqrt(np.mean(flat**2, axis=-1, keepdims=True) + eps)


def reference_mix(streams, fn, base, scale, hc: HyperConnectionConfig):
    """transformers' DeepseekV4HyperConnection.forward with its fn stored [in, out]: (collapsed, post, comb)."""
    n, eps = hc.num_streams, hc.eps
    weights = _normed(streams) @ fn
    pre = _sigmoid(weights[:, :n] * scale[0] + base[:n]) + eps
    post = 2 * _sigmoid(weights[:, n:2 * n] * scale[1] + base[n:2 * n])
    logits = (weights[:, 2 * n:] * scale[2]).reshape(-1, n, n) + base[2 * n:].reshape(n, n)
    comb = np.exp(logits - logits.max(-1, keepdims=True))
    comb = comb / comb.sum(-1, keepdims=True) + eps
    comb = comb / (comb.sum(-2, keepdims=True) + eps)
    for _ in range(hc.sinkhorn_iterations - 1):
        comb = comb / (comb.sum(-1, keepdims=True) + eps)
        comb = comb / (comb.sum(-2, keepdims=True) + eps)
    return (pre[..., None] * streams).sum(axis=1), post, comb


def reference_expand(streams, out, post, comb):
    """The decoder layer's update: post_k * out + sum_j comb[j, k] * h_j (comb transposed)."""
    return post[..., None] * out[:, None, :] + np.einsum("tjk,tjd->tkd", comb, streams)


def _streams(tokens: int, cfg: ModelConfig, seed: int = 3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((tokens, cfg.hyper_connections.num_streams, cfg.hidden_size)).astype(np.float32)


@pytest.mark.parametrize("numerics", NUMERICS)
@pytest.mark.parametrize("streams, iterations", [(4, 20), (3, 7)])
def test_stream_mix_matches_transformers_hyper_connection(numerics, streams, iterations):
    cfg = _config(streams=streams, iterations=iterations, eps=1e-4)
    mix = StreamMix(cfg, rngs=nnx.Rngs(0))
    p = _randomize(mix, seed=streams)
    h = _streams(13, cfg)
    collapsed, post, comb = jax.jit(lambda s: mix(s, numerics))(jnp.asarray(h))
    ref = reference_mix(h.astype(np.float64), p["fn"], p["base"], p["scale"], cfg.hyper_connections)
    for ours, theirs in zip((collapsed, post, comb), ref):
        np.testing.assert_allclose(np.asarray(ours), theirs, rtol=2e-5, atol=2e-6)


def test_sinkhorn_makes_the_mixing_matrix_doubly_stochastic():
    cfg = _config()
    mix = StreamMix(cfg, rngs=nnx.Rngs(0))
    _randomize(mix, seed=1)
    _, _, comb = mix(jnp.asarray(_streams(9, cfg)), "fast")
    comb = np.asarray(comb)
    np.testing.assert_allclose(comb.sum(axis=-2), 1.0, atol=1e-5)  # the last step normalises columns
    np.testing.assert_allclose(comb.sum(axis=-1), 1.0, atol=1e-3)
    assert (comb > 0).all() and not np.allclose(comb, 1.0 / comb.shape[-1], atol=1e-2)


@pytest.mark.parametrize("numerics", NUMERICS)
def test_a_layer_collapses_mixes_and_expands_the_streams_as_transformers_does(numerics):
    cfg = _config()
    layer = HyperConnectionResidual(cfg, rngs=nnx.Rngs(0))
    p = _randomize(layer, seed=5)
    h = _streams(11, cfg, seed=8)
    w_attn, w_mlp = (np.random.default_rng(s).standard_normal((16, 16)).astype(np.float32) / 4 for s in (1, 2))

    def run(streams):
        stream = (streams, jnp.zeros(streams.shape[:2]), jnp.zeros(streams.shape[:2] + streams.shape[1:2]))
        stream, x = layer.mixer_input(stream, jnp.int32(0), numerics)
        stream, x = layer.mlp_input(stream, jnp.tanh(x @ w_attn), numerics)
        return layer.add_mlp_output(stream, jnp.tanh(x @ w_mlp), numerics)[0]

    ours = np.asarray(jax.jit(run)(jnp.asarray(h)))
    hc, ref = cfg.hyper_connections, h.astype(np.float64)
    for name, weights in (("attn_hc", w_attn), ("ffn_hc", w_mlp)):
        collapsed, post, comb = reference_mix(ref, p[f"{name}.fn"], p[f"{name}.base"], p[f"{name}.scale"], hc)
        ref = reference_expand(ref, np.tanh(collapsed @ weights), post, comb)
    np.testing.assert_allclose(ours, ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("numerics", NUMERICS)
def test_hyper_head_starts_every_stream_from_the_embedding_and_collapses_them(numerics):
    cfg = _config(streams=3)
    head = HyperHead(cfg, rngs=nnx.Rngs(0))
    p = _randomize(head, seed=2)
    x = np.random.default_rng(4).standard_normal((6, 16)).astype(np.float32)
    streams, post, comb = head.start(jnp.asarray(x))
    assert streams.shape == (6, 3, 16) and post.shape == (6, 3) and comb.shape == (6, 3, 3)
    assert all(np.array_equal(np.asarray(streams[:, n]), x) for n in range(3))
    h = _streams(6, cfg)
    ours = np.asarray(head.finish((jnp.asarray(h), post, comb), numerics))
    pre = _sigmoid((_normed(h.astype(np.float64)) @ p["fn"]) * p["scale"][0] + p["base"]) + 1e-6
    np.testing.assert_allclose(ours, (pre[..., None] * h).sum(axis=1), rtol=2e-5, atol=2e-6)


def test_batch_invariant_row_is_bitwise_equal_alone_and_inside_batches():
    cfg = _config(hidden=256)
    layer = HyperConnectionResidual(cfg, rngs=nnx.Rngs(0))
    _randomize(layer, seed=6)

    @jax.jit
    def run(streams):
        stream = (streams, jnp.zeros(streams.shape[:2]), jnp.zeros(streams.shape[:2] + streams.shape[1:2]))
        stream, x = layer.mixer_input(stream, jnp.int32(0), "batch_invariant")
        stream, x = layer.mlp_input(stream, x * 0.5, "batch_invariant")
        return layer.add_mlp_output(stream, x, "batch_invariant")[0]

    row = _streams(1, cfg, seed=99)
    alone = np.asarray(run(jnp.asarray(row)))[0]
    for size in (3, 17, 64):
        batch = _streams(size, cfg, seed=size)
        batch[size // 2] = row[0]
        assert np.array_equal(np.asarray(run(jnp.asarray(batch)))[size // 2], alone), f"differs inside {size} rows"


def test_topology_follows_the_config():
    cfg = _config()
    assert isinstance(layer_residual(cfg, rngs=nnx.Rngs(0)), HyperConnectionResidual)
    assert isinstance(residual_stream(cfg, rngs=nnx.Rngs(0)), HyperHead)
    with pytest.raises(InvalidRequestError, match="two residual topologies"):
        cfg.replace(attn_res_block_size=2)
    with pytest.raises(InvalidRequestError, match="num_streams must be >= 1, got 0"):
        HyperConnectionConfig(num_streams=0)
