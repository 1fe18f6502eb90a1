"""A float64 numpy transcription of transformers 5.24.0's DeepseekV4Attention in its decode semantics.

Written from `modeling_deepseek_v4.py` (DeepseekV4Attention, DeepseekV4HCACompressor,
DeepseekV4CSACompressor, DeepseekV4Indexer, DeepseekV4IndexerScorer, eager_attention_forward,
apply_rotary_pos_emb, the YaRN frequencies of modeling_rope_utils) for one whole sequence at once:
token t sees the raw K=V rows of positions t-window+1..t and the compressed entries whose block ends at
or before t (HCA: all of them; CSA: the `index_topk` its indexer scores highest, ties to the lower
entry), plus a per-head sink in the softmax denominator. Parameters use agentjax's names and layouts
(kernels [in, out]). No jax, no torch: the tests compare agentjax's paged mixer against it.
"""
from __future__ import annotations

import math

import numpy as np


def inverse_frequencies(rope_dim: int, theta: float, scaling=None) -> tuple[np.ndarray, float]:
    """`(inv_freq [rope_dim/2], cos/sin factor)`: plain RoPE or transformers' YaRN."""
    base = theta ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    inv_freq = 1.0 / base
    if scaling is None:
        return inv_freq, 1.0
    assert scaling.kind == "yarn"

    def correction_dim(rotations):
        return rope_dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = inv_freq / scaling.factor * (1 - extrapolation) + inv_freq * extrapolation
    factor = scaling.attention_factor
    if factor is None:
        factor = 0.1 * math.log(scaling.factor) + 1.0 if scaling.factor > 1 else 1.0
    return inv_freq, factor


def rotate(x: np.ndarray, positions: np.ndarray, rope, inverse: bool = False) -> np.ndarray:
    """Interleaved RoPE on the last 2*len(inv_freq) channels of `x [n, ..., dim]` at `positions [n]`."""
    inv_freq, factor = rope
    half = len(inv_freq)
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]
    shape = (len(positions),) + (1,) * (x.ndim - 2) + (half,)
    cos, sin = (np.cos(angles) * factor).reshape(shape), (np.sin(angles) * factor).reshape(shape)
    if inverse:
        sin = -sin
    out = x.astype(np.float64).copy()
    tail = out[..., x.shape[-1] - 2 * half:]
    even, odd = tail[..., 0::2].copy(), tail[..., 1::2].copy()
    tail[..., 0::2] = even * cos - odd * sin
    tail[..., 1::2] = odd * cos + even * sin
    return out


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    normed = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return normed if weight is None else normed * weight


def compressed_entries(x: np.ndarray, p: dict, prefix: str, rate: int, overlap: bool, eps: float, rope) -> np.ndarray:
    """Every entry whose block lies inside the sequence: `[len(x) // rate, width]` (normed, rotated at
    the block's first position). CSA (overlap): entry w pools block w-1's Ca with block w's Cb."""
    kv = x @ p[f"{prefix}.kv_proj.kernel"]
    gate = x @ p[f"{prefix}.gate_proj.kernel"]
    bias = p[f"{prefix}.position_bias"]
    width = kv.shape[1] // (2 if overlap else 1)
    entries = []
    for w in range(len(x) // rate):
        block = slice(w * rate, (w + 1) * rate)
        if overlap:
            slots_kv, slots_gate = [kv[block, width:]], [gate[block, width:] + bias[:, width:]]
            if w > 0:
                previous = slice((w - 1) * rate, w * rate)
                slots_kv.insert(0, kv[previous, :width])
                slots_gate.insert(0, gate[previous, :width] + bias[:, :width])
            slot_kv, slot_gate = np.concatenate(slots_kv), np.concatenate(slots_gate)
        else:
            slot_kv, slot_gate = kv[block], gate[block] + bias
        weights = np.exp(slot_gate - slot_gate.max(axis=0))
        weights /= weights.sum(axis=0)
        entries.append(rms_norm((slot_kv * weights).sum(axis=0), p[f"{prefix}.kv_norm.weight"], eps))
    if not entries:
        return np.zeros((0, width))
    starts = np.arange(len(entries)) * rate
    return rotate(np.stack(entries)[:, None], starts, rope)[:, 0]


def indexer_choice(x: np.ndarray, q_residual: np.ndarray, p: dict, cfg, rope) -> tuple[list[np.ndarray], np.ndarray]:
    """Per token, the chosen entry ids (best first, ties to the lower id) and the full score matrix
    `[tokens, entries]` (-inf where the entry's block has not ended)."""
    attention = cfg.compressed_attention
    rate, heads, dim = attention.csa_rate, attention.index_num_heads, attention.index_head_dim
    keys = compressed_entries(x, p, "indexer", rate, True, cfg.rms_norm_eps, rope)
    positions = np.arange(len(x))
    q = rotate((q_residual @ p["indexer.q_b_proj.kernel"]).reshape(len(x), heads, dim), positions, rope)
    weights = (x @ p["indexer.weights_proj.kernel"]) * heads ** -0.5
    scores = np.einsum("thd,ed->the", q, keys)
    scores = (np.maximum(scores, 0) * dim ** -0.5 * weights[:, :, None]).sum(axis=1)
    ended = (positions + 1) // rate
    scores = np.where(np.arange(len(keys))[None, :] < ended[:, None], scores, -np.inf)
    chosen = []
    for t in positions:
        order = np.argsort(-scores[t, :ended[t]], kind="stable")
        chosen.append(order[:attention.index_topk])
    return chosen, scores


def dsv4_attention(x: np.ndarray, p: dict, cfg, layer_type: str) -> dict[str, np.ndarray]:
    """One layer's output for a whole sequence `x [tokens, hidden]` (the normed mixer input):
    `{"out": [tokens, hidden], "scores": indexer scores (csa), ...}`."""
    attention = cfg.compressed_attention
    x = x.astype(np.float64)
    tokens, heads, dim, eps = len(x), cfg.num_heads, cfg.head_dim, cfg.rms_norm_eps
    positions = np.arange(tokens)
    compress_rope = inverse_frequencies(cfg.rope_dim, attention.compress_rope_theta, attention.compress_rope_scaling)
    rope = inverse_frequencies(cfg.rope_dim, cfg.rope_theta) if layer_type == "swa_mqa" else compress_rope
    q_residual = rms_norm(x @ p["q_a_proj.kernel"], p["q_a_norm.weight"], eps)
    q = rms_norm((q_residual @ p["q_b_proj.kernel"]).reshape(tokens, heads, dim), None, eps)
    q = rotate(q, positions, rope)
    rows = rotate(rms_norm(x @ p["kv_proj.kernel"], p["kv_norm.weight"], eps)[:, None], positions, rope)[:, 0]
    result = {}
    entries, chosen = np.zeros((0, dim)), None
    if layer_type != "swa_mqa":
        rate = attention.csa_rate if layer_type == "csa" else attention.hca_rate
        entries = compressed_entries(x, p, "compressor", rate, layer_type == "csa", eps, rope)
    if layer_type == "csa":
        chosen, result["scores"] = indexer_choice(x, q_residual, p, cfg, compress_rope)
        result["chosen"] = chosen
    out = np.zeros((tokens, heads, dim))
    for t in positions:
        keys = rows[max(0, t - cfg.sliding_window + 1): t + 1]
        if layer_type == "hca":
            keys = np.concatenate([keys, entries[: (t + 1) // rate]])
        elif layer_type == "csa":
            keys = np.concatenate([keys, entries[chosen[t]]])
        logits = q[t] @ keys.T * dim ** -0.5  # [heads, keys]
        top = np.maximum(logits.max(axis=1), p["sinks"])
        weights = np.exp(logits - top[:, None])
        denom = weights.sum(axis=1) + np.exp(p["sinks"] - top)
        out[t] = weights @ keys / denom[:, None]
    out = rotate(out, positions, rope, inverse=True)
    groups = attention.o_groups
    grouped = np.einsum("tgi,gio->tgo", out.reshape(tokens, groups, -1), p["o_a_proj.kernel"]).reshape(tokens, -1)
    result["out"] = grouped @ p["o_b_proj.kernel"]
    return result
