"""Config fields and tensor names that the llama-shaped families (llama, gemma3) share.

`decoder_fields` reads the sizes every decoder config has; `attention_mlp_renames` is the table
from transformers' `model.layers.{i}.self_attn/mlp` names to agentjax's; `renamed_family` is a family
whose tensors map one to one by such a table. Host only: no jax.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from agentjax.config import ModelConfig
from agentjax.errors import ModelConfigError
from checkpoints.hf_config import ConfigFields
from checkpoints.hf_families import HFFamily
from checkpoints.hf_tensors import HFTensors, Rename, rename_tensors


def decoder_fields(fields: ConfigFields, *, default_max_positions: int, default_eps: float,
                   default_head_dim: int | None = None) -> dict[str, Any]:
    """The `ModelConfig` fields every llama-shaped decoder config holds (sizes, eps, token ids)."""
    hidden = fields.integer("hidden_size")
    num_heads = fields.integer("num_attention_heads")
    head_dim = fields.integer("head_dim", default_head_dim)
    if head_dim is None:
        if hidden % num_heads:
            raise ModelConfigError(
                f"{fields.source}: field {fields.path('head_dim')!r} is missing and hidden_size={hidden} "
                f"is not a multiple of num_attention_heads={num_heads}; give head_dim"
            )
        head_dim = hidden // num_heads
    num_kv_heads = fields.integer("num_key_value_heads", num_heads)
    if num_heads % num_kv_heads:
        raise ModelConfigError(
            f"{fields.source}: field {fields.path('num_key_value_heads')!r} is {num_kv_heads}; expected a "
            f"divisor of num_attention_heads={num_heads}"
        )
    bos = fields.token_ids("bos_token_id")
    return dict(
        vocab_size=fields.integer("vocab_size"),
        hidden_size=hidden,
        intermediate_size=fields.integer("intermediate_size"),
        num_layers=fields.integer("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=fields.integer("max_position_embeddings", default_max_positions),
        rms_norm_eps=fields.number("rms_norm_eps", default_eps),
        bos_token_id=bos[0] if bos else None,
        eos_token_ids=fields.token_ids("eos_token_id"),
    )


def attention_mlp_renames(prefix: str = "model.") -> list[Rename]:
    """Embedding, final norm, LM head and each layer's attention and gated-MLP projections."""
    layer = prefix + "layers.{i}."
    return [
        Rename(prefix + "embed_tokens.weight", "embed"),
        Rename(prefix + "norm.weight", "final_norm.weight"),
        Rename("lm_head.weight", "lm_head", transpose=True),
        Rename(layer + "input_layernorm.weight", "layers.{i}.input_norm.weight"),
        *(Rename(layer + f"self_attn.{p}.weight", f"layers.{{i}}.attn.{p}.kernel", transpose=True)
          for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
        *(Rename(layer + f"mlp.{p}.weight", f"layers.{{i}}.mlp.{p}.kernel", transpose=True)
          for p in ("gate_proj", "up_proj", "down_proj")),
    ]


def ignore_unused(tensors: HFTensors, tie_word_embeddings: bool) -> None:
    """Tensors transformers may save that agentjax recomputes or shares: RoPE buffers, a tied head."""
    tensors.ignore_matching(r".*rotary_emb\.inv_freq")
    if tie_word_embeddings:
        tensors.ignore("lm_head.weight")


def renamed_family(name: str, model_types: tuple[str, ...], architectures: tuple[str, ...],
                   model_config: Callable[[ConfigFields], ModelConfig], renames: list[Rename]) -> HFFamily:
    """A family whose tensors map one to one by `renames` (tied embeddings leave the LM head unread)."""

    def convert_tensors(cfg: ModelConfig, tensors: HFTensors) -> dict[str, np.ndarray]:
        ignore_unused(tensors, cfg.tie_word_embeddings)
        return rename_tensors(tensors, renames, name)

    return HFFamily(name=name, model_types=model_types, architectures=architectures, model_config=model_config,
                    convert_tensors=convert_tensors)
