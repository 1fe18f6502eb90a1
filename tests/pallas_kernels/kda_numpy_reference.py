"""A plain float64 numpy KDA (Kimi delta attention), written from transformers 5.24.0's recurrent form (test oracle only).

One sequence at a time, token by token: the causal depthwise conv over `[conv tail, new inputs]`, SiLU,
l2 norms (eps inside the sqrt), q scaled by D**-0.5, and per token
`S = exp(g) S; S += k ((v - S^T k) beta)^T; o = S^T q`; then, for the whole layer, the low-rank
gates and the gated RMSNorm. Never imports jax or the code under test.
"""
from __future__ import annotations

import numpy as np


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def silu(x):
    return x * sigmoid(x)


def l2norm(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def causal_conv(x, weight, tail=None):
    """`x [T, C]`, `weight [C, K]` (`weight[:, K-1]` on the current token), `tail [K-1, C]` (the
    K-1 inputs before x; zeros if None): `(y [T, C], new tail [K-1, C])`."""
    kernel = weight.shape[1]
    tail = np.zeros((kernel - 1, x.shape[1])) if tail is None else tail
    full = np.concatenate([tail, x], 0)
    y = sum(full[j:j + len(x)] * weight[:, j] for j in range(kernel))
    return y, full[len(full) - (kernel - 1):]


def delta_rule(q, k, v, g, beta, state=None):
    """Token-sequential gated delta rule: `q, k, g [T, H, Dk]`, `v [T, H, Dv]`, `beta [T, H]`, state
    `[H, Dk, Dv]` (zeros if None); q already normed and scaled. Returns `(out [T, H, Dv], state)`."""
    num_heads, dk, dv = q.shape[1], q.shape[2], v.shape[2]
    state = np.zeros((num_heads, dk, dv)) if state is None else state.copy()
    out = np.zeros((len(q), num_heads, dv))
    for t in range(len(q)):
        state = state * np.exp(g[t])[..., None]
        remembered = (state * k[t][..., None]).sum(-2)
        delta = (v[t] - remembered) * beta[t][..., None]
        state = state + k[t][..., None] * delta[..., None, :]
        out[t] = (state * q[t][..., None]).sum(-2)
    return out, state


def kda_core(mixed_qkv, g, beta, conv_weight, num_heads, head_dim, state=None, tail=None):
    """The op's math for one sequence: `(out [T, H, D], recurrent state [H, D, D], conv tail [K-1, 3HD])`."""
    width = num_heads * head_dim
    y, tail = causal_conv(np.asarray(mixed_qkv, np.float64), np.asarray(conv_weight, np.float64), tail)
    y = silu(y)
    q, k, v = (y[:, i * width:(i + 1) * width].reshape(len(y), num_heads, head_dim) for i in range(3))
    q = l2norm(q) * head_dim ** -0.5
    k = l2norm(k)
    out, state = delta_rule(q, k, v, np.asarray(g, np.float64), np.asarray(beta, np.float64), state)
    return out, state, tail


def softplus(x):
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))


def kda_layer(weights, h, eps, state=None, tail=None):
    """transformers' KimiLinearDeltaAttention on one sequence `h [T, hidden]`, from its checkpoint
    tensors (`weights[name]` with the `self_attn.` names and shapes as saved, e.g. `q_proj.weight
    [P, hidden]`, `q_conv1d.weight [P, 1, K]`, `A_log [1, 1, H, 1]`). Returns `(out, state, tail)`."""
    w = {name: np.asarray(value, np.float64) for name, value in weights.items()}
    h = np.asarray(h, np.float64)
    num_heads = w["b_proj.weight"].shape[0]
    head_dim = w["o_norm.weight"].shape[0]
    mixed = np.concatenate([h @ w[f"{n}_proj.weight"].T for n in "qkv"], -1)
    conv = np.concatenate([w[f"{n}_conv1d.weight"][:, 0, :] for n in "qkv"], 0)
    z = (h @ w["f_a_proj.weight"].T @ w["f_b_proj.weight"].T + w["dt_bias"]).reshape(len(h), num_heads, head_dim)
    g = -np.exp(w["A_log"].reshape(num_heads))[None, :, None] * softplus(z)
    beta = sigmoid(h @ w["b_proj.weight"].T)
    out, state, tail = kda_core(mixed, g, beta, conv, num_heads, head_dim, state, tail)
    gate = (h @ w["g_a_proj.weight"].T @ w["g_b_proj.weight"].T).reshape(len(h), num_heads, head_dim)
    normed = out / np.sqrt((out * out).mean(-1, keepdims=True) + eps) * w["o_norm.weight"]
    gated = (normed * sigmoid(gate)).reshape(len(h), num_heads * head_dim)
    return gated @ w["o_proj.weight"].T, state, tail
