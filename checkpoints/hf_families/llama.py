"""The llama family (`model_type` llama, `LlamaForCausalLM`): SmolLM2, Llama 2/3 and their kin.

Reads transformers' config.json (RoPE from `rope_parameters` or the older `rope_theta` and
`rope_scaling`) and maps its tensors one to one, transposing linear weights to `[in, out]`.
Host only: never imports jax.
"""
from __future__ import annotations

from agentjax.config import ModelConfig
from checkpoints.hf_config import ConfigFields, rope_settings
from checkpoints.hf_families._common import attention_mlp_renames, decoder_fields, renamed_family
from checkpoints.hf_tensors import Rename

RENAMES = [
    *attention_mlp_renames(),
    # llama's norm before the MLP is called post_attention_layernorm
    Rename("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.pre_mlp_norm.weight"),
]


def model_config(fields: ConfigFields) -> ModelConfig:
    fields.choice("hidden_act", ["silu"], default="silu")
    fields.reject("attention_bias", "false (attention biases are not supported)")
    fields.reject("mlp_bias", "false (MLP biases are not supported)")
    theta, scaling = rope_settings(fields)
    return ModelConfig(
        architecture="llama",
        **decoder_fields(fields, default_max_positions=2048, default_eps=1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=fields.boolean("tie_word_embeddings", False),
    )


FAMILY = renamed_family("llama", ("llama",), ("LlamaForCausalLM",), model_config, RENAMES)
