"""An independent float64 numpy forward for llama and gemma3 GGUF files (test oracle only).

It reads tensors straight from the GGUF file and uses GGUF's own RoPE conventions (interleaved
pairs for llama, halves for gemma3), so it also checks agentjax's Q/K un-permutation.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import gguf
import numpy as np


class Float64Weights(Mapping):
    """Every tensor of a GGUF file as float64, dequantised when read.

    Nothing is kept: a whole 270M-parameter model in float64 is 2 GB, and a forward only needs one
    layer's tensors (and the embedding) at a time."""

    def __init__(self, reader):
        self._tensors = {t.name: t for t in reader.tensors}

    def __getitem__(self, name: str) -> np.ndarray:
        t = self._tensors[name]
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        return np.asarray(arr, np.float64).reshape(tuple(int(d) for d in reversed(t.shape)))

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def reference_weights(reader) -> Float64Weights:
    """The file's tensors for `reference_logits` (pass them in to share them between calls)."""
    return Float64Weights(reader)


def _field(reader, key):
    return reader.metadata[key]


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope_interleaved(x, pos, theta):
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2) / d)
    ang = pos[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out


def _rope_halves(x, pos, theta):
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2) / d)
    ang = pos[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x0, x1 = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([x0 * cos - x1 * sin, x1 * cos + x0 * sin], axis=-1)


def _attention(q, k, v, scale, window):
    n, hq, d = q.shape
    hk = k.shape[1]
    k = np.repeat(k, hq // hk, axis=1)
    v = np.repeat(v, hq // hk, axis=1)
    scores = (q.transpose(1, 0, 2) @ k.transpose(1, 2, 0)) * scale  # [h, q, k], through BLAS
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    mask = j <= i
    if window is not None:
        mask &= j > i - window
    scores = np.where(mask[None], scores, -np.inf)
    scores -= scores.max(-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(-1, keepdims=True)
    return (p @ v.transpose(1, 0, 2)).transpose(1, 0, 2)


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def reference_logits(reader, token_ids, sliding=True, weights=None, positions=None) -> np.ndarray:
    """Logits at every position (or at `positions`), float64. `sliding=False` gives gemma3 full
    attention everywhere; `weights`: `reference_weights(reader)`, when the caller has them already."""
    arch = _field(reader, "general.architecture")
    W = weights if weights is not None else reference_weights(reader)
    n_layers = int(_field(reader, f"{arch}.block_count"))
    hq = int(_field(reader, f"{arch}.attention.head_count"))
    hk = int(_field(reader, f"{arch}.attention.head_count_kv"))
    eps = float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon"))
    theta = float(_field(reader, f"{arch}.rope.freq_base"))
    tokens = np.asarray(token_ids)
    pos = np.arange(len(tokens), dtype=np.float64)
    x = W["token_embd.weight"][tokens]
    hidden = x.shape[1]
    gemma = arch == "gemma3"
    if gemma:
        x = x * math.sqrt(hidden)
        window_size = int(_field(reader, f"{arch}.attention.sliding_window"))
    for i in range(n_layers):
        p = f"blk.{i}."
        h = _rms(x, W[p + "attn_norm.weight"], eps)
        q = (h @ W[p + "attn_q.weight"].T).reshape(len(tokens), hq, -1)
        k = (h @ W[p + "attn_k.weight"].T).reshape(len(tokens), hk, -1)
        v = (h @ W[p + "attn_v.weight"].T).reshape(len(tokens), hk, -1)
        d = q.shape[-1]
        if gemma:
            is_global = (i + 1) % 6 == 0
            q = _rms(q, W[p + "attn_q_norm.weight"], eps)
            k = _rms(k, W[p + "attn_k_norm.weight"], eps)
            layer_theta = theta if is_global else 10_000.0
            q, k = _rope_halves(q, pos, layer_theta), _rope_halves(k, pos, layer_theta)
            window = None if (is_global or not sliding) else window_size
        else:
            q, k = _rope_interleaved(q, pos, theta), _rope_interleaved(k, pos, theta)
            window = None
        attn = _attention(q, k, v, d**-0.5, window).reshape(len(tokens), -1) @ W[p + "attn_output.weight"].T
        if gemma:
            attn = _rms(attn, W[p + "post_attention_norm.weight"], eps)
        x = x + attn
        h = _rms(x, W[p + "ffn_norm.weight"], eps)
        gate = h @ W[p + "ffn_gate.weight"].T
        act = _gelu_tanh(gate) if gemma else gate / (1 + np.exp(-gate))
        mlp = (act * (h @ W[p + "ffn_up.weight"].T)) @ W[p + "ffn_down.weight"].T
        if gemma:
            mlp = _rms(mlp, W[p + "post_ffw_norm.weight"], eps)
        x = x + mlp
    x = _rms(x if positions is None else x[positions], W["output_norm.weight"], eps)
    head = W["output.weight"] if "output.weight" in W else W["token_embd.weight"]
    return x @ head.T
