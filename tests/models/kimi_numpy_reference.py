"""A float64 numpy forward of the Kimi family written from the formulas, Kimi-K3's additions included.

It reads agentjax's parameter names (`arrays_from_params`) and a `ModelConfig`, runs one sequence
without any cache, token by token in the KDA recurrence, and returns its logits. Kimi-Linear follows
transformers 5.24.0's KimiLinearForCausalLM; Kimi-K3's additions (transformers has none) follow the
published K3 design: block attention residuals (a block starts at layer i % block_size == 0; each
mixer and MLP input is `softmax_j(query . (norm * rmsnorm(v_j)))`-weighted over the finished block
sums and the running sum), the gated MLA (`o_proj(attn * sigmoid(g_proj(x)))`), the latent MoE
(`up(rmsnorm(sum_j w_j expert_j(down(x))))` plus shared experts on x), SiTU-GLU, KDA's full-rank
output gate and its gate lower bound (`log-decay = bound * sigmoid(exp(A_log) * (f + dt_bias))`).
"""
from __future__ import annotations

import numpy as np


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _softmax(x, axis=-1):
    e = np.exp(x - np.max(x, axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def _act(gate, up, kind, beta, linear_beta):
    if kind == "silu":
        return gate * _sigmoid(gate) * up
    if linear_beta is not None:
        up = linear_beta * np.tanh(up / linear_beta)
    return beta * np.tanh(gate / beta) * _sigmoid(gate) * up  # situ


def _kda(cfg, w, a, h):
    kda, T = cfg.kda, h.shape[0]
    H, D, K = kda.num_heads, kda.head_dim, kda.conv_kernel_size
    qkv = np.concatenate([h @ w[a + f"{n}_proj.kernel"] for n in "qkv"], -1)
    conv = np.concatenate([w[a + f"{n}_conv1d.weight"][:, 0, :] for n in "qkv"], 0)  # [3P, K]
    padded = np.concatenate([np.zeros((K - 1, qkv.shape[1])), qkv], 0)
    qkv = sum(conv[:, j] * padded[j:j + T] for j in range(K))
    qkv = qkv * _sigmoid(qkv)  # the short conv's activation is SiLU
    q, k, v = (t.reshape(T, H, D) for t in np.split(qkv, 3, -1))
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * D**-0.5
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    z = ((h @ w[a + "f_a_proj.kernel"]) @ w[a + "f_b_proj.kernel"] + w[a + "dt_bias"]).reshape(T, H, D)
    rate = np.exp(w[a + "A_log"].reshape(H))[None, :, None]
    bound = kda.gate_lower_bound
    if bound is None:
        g = -rate * np.where(z > 20, z, np.log1p(np.exp(np.minimum(z, 20))))
    else:
        g = bound * _sigmoid(rate * z)
    beta = _sigmoid(h @ w[a + "b_proj.kernel"])
    state, out = np.zeros((H, D, D)), np.zeros((T, H, D))
    for t in range(T):
        state = state * np.exp(g[t])[:, :, None]
        delta = (v[t] - np.einsum("hkv,hk->hv", state, k[t])) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", state, q[t])
    if kda.full_rank_gate:
        gate = h @ w[a + "g_proj.kernel"]
    else:
        gate = (h @ w[a + "g_a_proj.kernel"]) @ w[a + "g_b_proj.kernel"]
    out = _rms(out, w[a + "o_norm.weight"], cfg.rms_norm_eps) * _sigmoid(gate.reshape(T, H, D))
    return out.reshape(T, H * D) @ w[a + "o_proj.kernel"]


def _mla(cfg, w, a, h):
    mla, T, nh = cfg.mla, h.shape[0], cfg.num_heads
    dn, dr, dv, r = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim, mla.kv_lora_rank
    if mla.q_lora_rank is None:
        q = h @ w[a + "q_proj.kernel"]
    else:
        q = _rms(h @ w[a + "q_a_proj.kernel"], w[a + "q_a_layernorm.weight"], mla.norm_eps) @ w[a + "q_b_proj.kernel"]
    q = q.reshape(T, nh, dn + dr)
    ckv = h @ w[a + "kv_a_proj_with_mqa.kernel"]
    kvb = (_rms(ckv[:, :r], w[a + "kv_a_layernorm.weight"], mla.norm_eps) @ w[a + "kv_b_proj.kernel"])
    kvb = kvb.reshape(T, nh, dn + dv)
    k = np.concatenate([kvb[..., :dn], np.broadcast_to(ckv[:, None, r:], (T, nh, dr))], -1)
    scores = np.einsum("qhd,khd->hqk", q, k) * (dn + dr) ** -0.5
    scores = np.where(np.tril(np.ones((T, T), bool))[None], scores, -np.inf)
    out = np.einsum("hqk,khd->qhd", _softmax(scores), kvb[..., dn:])
    if mla.output_gate:
        out = out * _sigmoid((h @ w[a + "g_proj.kernel"]).reshape(T, nh, dv))
    return out.reshape(T, nh * dv) @ w[a + "o_proj.kernel"]


def _dense(cfg, w, m, h):
    hidden = _act(h @ w[m + "gate_proj.kernel"], h @ w[m + "up_proj.kernel"], cfg.hidden_activation,
                  cfg.situ_beta, cfg.situ_linear_beta)
    return hidden @ w[m + "down_proj.kernel"]


def _moe(cfg, w, m, h):
    moe, T = cfg.moe, h.shape[0]
    E, k, groups = moe.num_experts, moe.num_experts_per_token, moe.num_expert_groups

    def ffn(x, gate_up, down):
        gate, up = np.split(x @ gate_up, 2, -1)
        return _act(gate, up, moe.activation, moe.situ_beta, moe.situ_linear_beta) @ down

    scores = _sigmoid(h @ w[m + "router.kernel"])
    choice = scores + w[m + "router.selection_bias"]
    top2 = np.sort(choice.reshape(T, groups, E // groups), -1)[..., -2:].sum(-1)
    kept = np.zeros((T, groups), bool)
    np.put_along_axis(kept, np.argsort(-top2, -1)[:, :moe.topk_groups], True, -1)
    choice = np.where(np.repeat(kept, E // groups, -1), choice, -np.inf)
    ids = np.argsort(-choice, -1)[:, :k]
    weights = np.take_along_axis(scores, ids, -1)
    if moe.renormalize:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    weights = weights * moe.routed_scaling_factor
    x = h @ w[m + "latent_down_proj"] if moe.latent_size else h
    routed = np.zeros_like(x)
    for t in range(T):
        for j in range(k):
            e = ids[t, j]
            routed[t] += weights[t, j] * ffn(x[t], w[m + "experts.gate_up_proj"][e], w[m + "experts.down_proj"][e])
    if moe.latent_size:
        if moe.latent_norm:
            routed = _rms(routed, w[m + "latent_norm"], moe.norm_eps)
        routed = routed @ w[m + "latent_up_proj"]
    if moe.num_shared_experts:
        routed = routed + ffn(h, w[m + "shared_experts.gate_up_proj"], w[m + "shared_experts.down_proj"])
    return routed


def _mix(w, prefix, partial, blocks, eps):
    """AttnRes: the softmax mix of the finished block sums and the running sum, per token."""
    sources = np.stack(blocks + [partial], 1)  # [T, S, d]
    normed = sources / np.sqrt(np.mean(sources * sources, -1, keepdims=True) + eps) * w[prefix + "norm"]
    weights = _softmax(normed @ w[prefix + "query"], -1)
    return np.einsum("ts,tsd->td", weights, sources)


def kimi_logits(cfg, arrays: dict[str, np.ndarray], ids) -> np.ndarray:
    """Logits `[len(ids), vocab]` of one uncached forward."""
    w = {name: np.asarray(value, np.float64) for name, value in arrays.items()}
    eps, block = cfg.rms_norm_eps, cfg.attn_res_block_size
    x = w["embed"][np.asarray(ids)]
    partial, blocks = x, []
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        if block is None:
            h = x
        else:
            h = _mix(w, p + "residual.attn_res.", partial, blocks, eps) if blocks else partial
            if i % block == 0:
                blocks, partial = blocks + [partial], None
        mixer = _mla if cfg.layer_types[i] == "mla" else _kda
        out = mixer(cfg, w, p + "attn.", _rms(h, w[p + "input_norm.weight"], eps))
        if block is None:
            x = h = x + out
        else:
            partial = out if partial is None else partial + out
            h = _mix(w, p + "residual.mlp_res.", partial, blocks, eps)
        mlp = _moe if cfg.mlp_layer_types[i] == "moe" else _dense
        out = mlp(cfg, w, p + "mlp.", _rms(h, w[p + "pre_mlp_norm.weight"], eps))
        if block is None:
            x = x + out
        else:
            partial = partial + out
    final = x if block is None else _mix(w, "residual.output_res.", partial, blocks, eps)
    head = w["embed"].T if cfg.tie_word_embeddings else w["lm_head"]
    return _rms(final, w["final_norm.weight"], eps) @ head
