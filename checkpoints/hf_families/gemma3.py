"""The Gemma-3 text family (`model_type` gemma3_text, `Gemma3ForCausalLM`).

Sliding and full-attention layers with their own RoPE bases, QK norms, sandwich norms and a
scaled embedding. Gemma's RMSNorm scales by `1 + w`; the `+ 1` is folded into the weights here.
Host only: never imports jax.
"""
from __future__ import annotations

import numpy as np

from agentjax.config import ModelConfig
from checkpoints.hf_config import ConfigFields, rope_settings
from checkpoints.hf_families._common import attention_mlp_renames, decoder_fields, renamed_family
from checkpoints.hf_tensors import Rename

# transformers' Gemma3TextConfig defaults (used when config.json leaves a field out)
DEFAULT_SLIDING_PATTERN = 6
DEFAULT_HEAD_DIM = 256
DEFAULT_QUERY_PRE_ATTN_SCALAR = 256


def _plus_one(weight: np.ndarray) -> np.ndarray:
    return weight + 1.0


def _with_plus_one(rule: Rename) -> Rename:
    return Rename(rule.hf, rule.param, rule.transpose, _plus_one) if rule.hf.endswith("norm.weight") else rule


_NORMS = {
    "post_attention_layernorm": "post_attn_norm",
    "pre_feedforward_layernorm": "pre_mlp_norm",
    "post_feedforward_layernorm": "post_mlp_norm",
    "self_attn.q_norm": "attn.q_norm",
    "self_attn.k_norm": "attn.k_norm",
}
RENAMES = [
    *(_with_plus_one(rule) for rule in attention_mlp_renames()),
    *(Rename(f"model.layers.{{i}}.{hf}.weight", f"layers.{{i}}.{ours}.weight", convert=_plus_one)
      for hf, ours in _NORMS.items()),
]


def model_config(fields: ConfigFields) -> ModelConfig:
    fields.choice("hidden_activation", ["gelu_pytorch_tanh"], default="gelu_pytorch_tanh")
    fields.reject("attn_logit_softcapping", "null (attention logit soft-capping is not supported)")
    fields.reject("use_bidirectional_attention", "false (bidirectional attention is not supported)")
    fields.reject("attention_bias", "false (attention biases are not supported)")
    common = decoder_fields(fields, default_max_positions=131072, default_eps=1e-6,
                            default_head_dim=DEFAULT_HEAD_DIM)
    num_layers = common["num_layers"]
    pattern = fields.integer("sliding_window_pattern", fields.raw.get("_sliding_window_pattern")
                             or DEFAULT_SLIDING_PATTERN)
    default_types = tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                          for i in range(num_layers))
    layer_types = fields.string_list("layer_types", ["full_attention", "sliding_attention"], num_layers,
                                     default_types)
    theta, scaling = rope_settings(fields, "full_attention", default_theta=1_000_000.0)
    if fields.has("rope_parameters"):
        local_theta, local_scaling = rope_settings(fields, "sliding_attention", default_theta=10_000.0)
    else:
        local_theta, local_scaling = fields.number("rope_local_base_freq", 10_000.0), None
    if local_scaling is not None:
        raise fields.error("rope_parameters", fields.raw["rope_parameters"],
                           "no RoPE scaling on sliding_attention layers")
    sliding = "sliding_attention" in layer_types
    return ModelConfig(
        architecture="gemma3",
        **common,
        rope_theta=theta,
        rope_scaling=scaling,
        local_rope_theta=local_theta,
        sliding_window=fields.integer("sliding_window") if sliding else None,
        layer_types=layer_types,
        tie_word_embeddings=fields.boolean("tie_word_embeddings", True),
        hidden_activation="gelu_tanh",
        embedding_multiplier=float(common["hidden_size"]) ** 0.5,
        attention_scale=fields.number("query_pre_attn_scalar", DEFAULT_QUERY_PRE_ATTN_SCALAR) ** -0.5,
        use_qk_norm=True,
        use_sandwich_norms=True,
        final_logit_softcap=fields.number("final_logit_softcapping", None),
    )


FAMILY = renamed_family("gemma3", ("gemma3_text",), ("Gemma3ForCausalLM",), model_config, RENAMES)
