"""Random weights for the tiny fixture models, scaled so that every feature moves the output, the names and
shapes of a MiniMax-M3 MTP module as real checkpoints store them, and MiniMax-M3's tiny vision tower config.
Shared by scripts/make_model_fixtures.py and scripts/fuzz_parity_configs.py; runs in the transformers
environment, never imported by the agentjax package.
"""
from __future__ import annotations

import math

import numpy as np
import torch

TINY_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                   patch_size=2, temporal_patch_size=2, spatial_merge_size=2, image_size=8)


def _normal(gen: torch.Generator, shape, std: float, mean: float = 0.0) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean


def random_value(name: str, shape: tuple[int, ...], gen: torch.Generator, gemma_norms: bool,
                  lm_head_gain: float) -> torch.Tensor:
    """A random value for one tensor, scaled so that every feature changes the output."""
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("e_score_correction_bias"):
        return _normal(gen, shape, 0.15)
    if leaf == "A_log":  # decay rate exp(A_log) in [0.5, 2]
        return torch.log(torch.rand(shape, generator=gen) * 1.5 + 0.5)
    if leaf == "dt_bias":  # softplus(dt_bias) ~ 0.03..0.3, so per-step decay stays 0.55..0.99
        return _normal(gen, shape, 0.5, -2.5)
    if "conv1d" in name and leaf == "weight" and len(shape) == 3:
        return _normal(gen, shape, 0.5)
    if leaf == "bias":  # only the vision tower and its projector have biases
        return _normal(gen, shape, 0.05)
    if len(shape) == 1:  # a norm weight
        if "vision_tower" in name or not gemma_norms:
            return _normal(gen, shape, 0.15, 1.0)
        return _normal(gen, shape, 0.15)  # Gemma-style (1 + w) norm: w near 0
    if name.endswith("embed_tokens.weight"):
        return _normal(gen, shape, 1.0)
    if name.endswith("lm_head.weight"):
        return _normal(gen, shape, lm_head_gain / math.sqrt(shape[-1]))
    # [out, in] linears and [E, out, in] fused experts scale by `in`; the vision patch conv by C*T*P*P.
    fan_in = shape[-1] if len(shape) in (2, 3) else int(np.prod(shape[1:]))
    return _normal(gen, shape, 1.0 / math.sqrt(fan_in))


def randomize(model: torch.nn.Module, seed: int, gemma_norms: bool, lm_head_gain: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in sorted(model.state_dict().items()):
            tensor.copy_(random_value(name, tuple(tensor.shape), gen, gemma_norms, lm_head_gain))


def mtp_tensor_shapes(text: dict, prefix: str) -> dict[str, tuple[int, ...]]:
    """Names and shapes of one MiniMax-M3 MTP module as the real checkpoint stores them.

    The names follow vLLM's MiniMaxM3MTP loader: `<prefix>mtp.layers.0.{enorm,hnorm,eh_proj,
    final_layernorm}` and a sparse-attention + MoE decoder layer under `transformer_layer.`, with the
    original checkpoint spelling (block_sparse_moe, experts.N.w1/w2/w3, index_q_proj, ...).
    """
    h, hd, nh, kv = text["hidden_size"], text["head_dim"], text["num_attention_heads"], text["num_key_value_heads"]
    ih, idim = text["index_n_heads"], text["index_head_dim"]
    inter, shared, experts = text["intermediate_size"], text["shared_intermediate_size"], text["num_local_experts"]
    root = f"{prefix}mtp.layers.0."
    layer = root + "transformer_layer."
    shapes = {
        root + "enorm.weight": (h,), root + "hnorm.weight": (h,), root + "eh_proj.weight": (h, 2 * h),
        root + "final_layernorm.weight": (h,),
        layer + "input_layernorm.weight": (h,), layer + "post_attention_layernorm.weight": (h,),
        layer + "self_attn.q_proj.weight": (nh * hd, h), layer + "self_attn.k_proj.weight": (kv * hd, h),
        layer + "self_attn.v_proj.weight": (kv * hd, h), layer + "self_attn.o_proj.weight": (h, nh * hd),
        layer + "self_attn.q_norm.weight": (hd,), layer + "self_attn.k_norm.weight": (hd,),
        layer + "self_attn.index_q_proj.weight": (ih * idim, h),
        layer + "self_attn.index_k_proj.weight": (idim, h),
        layer + "self_attn.index_q_norm.weight": (idim,), layer + "self_attn.index_k_norm.weight": (idim,),
        layer + "block_sparse_moe.gate.weight": (experts, h),
        layer + "block_sparse_moe.e_score_correction_bias": (experts,),
        layer + "block_sparse_moe.shared_experts.gate_proj.weight": (shared, h),
        layer + "block_sparse_moe.shared_experts.up_proj.weight": (shared, h),
        layer + "block_sparse_moe.shared_experts.down_proj.weight": (h, shared),
    }
    for e in range(experts):
        shapes[layer + f"block_sparse_moe.experts.{e}.w1.weight"] = (inter, h)
        shapes[layer + f"block_sparse_moe.experts.{e}.w2.weight"] = (h, inter)
        shapes[layer + f"block_sparse_moe.experts.{e}.w3.weight"] = (inter, h)
    return shapes
