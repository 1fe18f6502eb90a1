"""Kimi's MLA over the paged latent cache against the expanded formula in float64 numpy, and its
exactness across batching and chunking in batch-invariant numerics."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from agentjax.config import MLAConfig, ModelConfig
from agentjax.errors import UnsupportedModelError
from agentjax.models.mla import MLAAttention
from agentjax.ragged_batch import RaggedBatch

PAGE = 8
HIDDEN = 32


def _config(q_lora_rank, output_gate, **mla_changes) -> ModelConfig:
    mla = MLAConfig(kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=4, v_head_dim=10,
                    q_lora_rank=q_lora_rank, output_gate=output_gate, **mla_changes)
    return ModelConfig(architecture="kimi_linear", vocab_size=64, hidden_size=HIDDEN, intermediate_size=64,
                       num_layers=1, num_heads=3, num_kv_heads=3, head_dim=mla.qk_head_dim,
                       max_position_embeddings=512, layer_types=("mla",), mla=mla)


def _layer(cfg: ModelConfig, seed: int = 0) -> MLAAttention:
    layer = MLAAttention(cfg, 0, {"latent": 0}, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for norm in ("q_a_layernorm", "kv_a_layernorm"):  # weights other than 1 so a swapped norm shows
        if hasattr(layer, norm):
            weight = getattr(layer, norm).weight
            weight[...] = jnp.asarray(1 + 0.3 * rng.standard_normal(weight[...].shape), jnp.float32)
    return layer


def _weights(layer: MLAAttention) -> dict[str, np.ndarray]:
    return {"/".join(str(p) for p in path): np.asarray(v.get_value(), np.float64)
            for path, v in nnx.to_flat_state(nnx.state(layer))}


def _reference(layer: MLAAttention, x: np.ndarray) -> np.ndarray:
    """Expanded (non-absorbed) MLA of one sequence, causal, no RoPE, as transformers computes it."""
    w, mla, heads = _weights(layer), layer.mla, layer.num_heads

    def rms(v, weight, eps):
        return v / np.sqrt(np.mean(v * v, -1, keepdims=True) + eps) * weight

    tokens = x.shape[0]
    if mla.q_lora_rank is None:
        q = x @ w["q_proj/kernel"]
    else:
        q = rms(x @ w["q_a_proj/kernel"], w["q_a_layernorm/weight"], mla.norm_eps) @ w["q_b_proj/kernel"]
    q = q.reshape(tokens, heads, mla.qk_head_dim)
    compressed = x @ w["kv_a_proj_with_mqa/kernel"]
    latent = rms(compressed[:, :mla.kv_lora_rank], w["kv_a_layernorm/weight"], mla.norm_eps)
    k_rot = compressed[:, mla.kv_lora_rank:]
    kvb = (latent @ w["kv_b_proj/kernel"]).reshape(tokens, heads, mla.qk_nope_head_dim + mla.v_head_dim)
    k = np.concatenate([kvb[..., :mla.qk_nope_head_dim], np.broadcast_to(k_rot[:, None], (tokens, heads, 4))], -1)
    v = kvb[..., mla.qk_nope_head_dim:]
    scores = np.einsum("qhd,khd->hqk", q, k) * mla.qk_head_dim**-0.5
    scores = np.where(np.tril(np.ones((tokens, tokens), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("hqk,khd->qhd", probs, v)
    if mla.output_gate:
        out = out / (1 + np.exp(-(x @ w["g_proj/kernel"]).reshape(out.shape)))
    return out.reshape(tokens, -1) @ w["o_proj/kernel"]


_JITTED = {}


def _jitted(layer: MLAAttention, numerics: str):
    """The layer's call as one jitted function of (params, x, kv, batch)."""
    key = (id(layer), numerics)
    if key not in _JITTED:
        graphdef = nnx.graphdef(layer)

        def call(state, x, kv, batch):
            return nnx.merge(graphdef, state)(x, kv, batch, numerics, {"latent": jnp.int32(0)})

        _JITTED[key] = (layer, jax.jit(call))  # the layer is kept so its id is never reused
    return _JITTED[key][1]


def _step(layer, cfg, kv, rows, inputs, numerics):
    """One call on rows of (new token count, tokens already cached, pages); `inputs` holds each row's
    hidden states for its new tokens. Returns each row's outputs and the updated KV buffers."""
    batch = RaggedBatch.build([([0] * n, start, pages) for n, start, pages in rows], PAGE)
    x = np.zeros((batch.num_tokens, HIDDEN), np.float32)
    x[: sum(len(i) for i in inputs)] = np.concatenate(inputs)
    out, kv = _jitted(layer, numerics)(nnx.state(layer), jnp.asarray(x), kv, batch.for_groups(1))
    out = np.asarray(out)
    starts = np.cumsum([0] + [n for n, _, _ in rows])
    return [out[a:b] for a, b in zip(starts, starts[1:])], kv


@pytest.mark.parametrize("q_lora_rank, output_gate, numerics",
                         [(None, False, "fast"), (20, False, "batch_invariant"), (20, True, "fast")],
                         ids=["plain-q", "q-lora-invariant", "q-lora-gated"])
def test_two_sequences_match_the_expanded_formula(q_lora_rank, output_gate, numerics):
    cfg = _config(q_lora_rank, output_gate)
    layer = _layer(cfg)
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((n, HIDDEN)).astype(np.float32) for n in (19, 30)]
    kv = cfg.new_kv_pages(16, PAGE)
    outs, _ = _step(layer, cfg, kv, [(19, 0, [3, 1, 7]), (30, 0, [2, 9, 4, 5])], xs, numerics)
    for x, out in zip(xs, outs):
        np.testing.assert_allclose(out, _reference(layer, x.astype(np.float64)), rtol=1e-5, atol=2e-5)


def test_cached_rows_are_the_normed_latent_and_the_rope_part():
    cfg = _config(20, True)
    layer = _layer(cfg)
    x = np.random.default_rng(2).standard_normal((11, HIDDEN)).astype(np.float32)
    _, kv = _step(layer, cfg, cfg.new_kv_pages(8, PAGE), [(11, 0, [5, 2])], [x], "fast")
    rows = np.asarray(kv[0][0]).reshape(-1, cfg.mla.latent_width)[[5 * PAGE + t for t in range(8)] + [16, 17, 18]]
    np.testing.assert_allclose(rows, np.asarray(layer.latent_rows(jnp.asarray(x), "fast")), rtol=1e-6)
    assert cfg.mla.latent_width == 16 + 4


def test_batch_invariant_output_is_the_same_alone_chunked_and_beside_others():
    cfg = _config(20, True)
    layer = _layer(cfg, seed=3)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((37, HIDDEN)).astype(np.float32)
    other = rng.standard_normal((23, HIDDEN)).astype(np.float32)
    pages = [4, 1, 6, 3, 8]
    alone, _ = _step(layer, cfg, cfg.new_kv_pages(16, PAGE), [(37, 0, pages)], [x], "batch_invariant")
    # in chunks (16, 16, then one token at a time), beside another sequence that decodes
    kv = cfg.new_kv_pages(16, PAGE)
    chunks, start, other_start = [], 0, 0
    for size in (16, 16, 1, 1, 1, 1, 1):
        other_size = 7 if other_start == 0 else 1
        rows = [(other_size, other_start, [10, 11, 12]), (size, start, pages)]
        out, kv = _step(layer, cfg, kv, rows, [other[other_start:other_start + other_size], x[start:start + size]],
                        "batch_invariant")
        chunks.append(out[1])
        start, other_start = start + size, other_start + other_size
    assert np.array_equal(np.concatenate(chunks), alone[0])


def test_rope_mla_is_refused():
    with pytest.raises(UnsupportedModelError, match="RoPE"):
        MLAAttention(_config(None, False, use_rope=True), 0, {"latent": 0}, rngs=nnx.Rngs(0))
