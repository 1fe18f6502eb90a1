"""Frozen configuration dataclasses: the model's shape and the engine's settings.

`ModelConfig` describes one decoder (read from a GGUF file, an HF directory or a preset) and makes
its KV pages. `EngineConfig` holds the serving settings under their CLI names in snake case.
Host only at import time: jax is imported lazily inside `ModelConfig.new_kv_pages`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from agentjax.errors import InvalidRequestError

LayerType = Literal["full_attention", "sliding_attention"]
Numerics = Literal["fast", "batch_invariant"]


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `kind` is "linear" or "llama3"; the other fields serve llama3."""

    kind: Literal["linear", "llama3"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """The shape of one decoder-only transformer of the llama or gemma3 family."""

    architecture: Literal["llama", "gemma3"]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling | None = None
    # Gemma-3 local layers use their own base frequency and no scaling.
    local_rope_theta: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[LayerType, ...] = ()
    tie_word_embeddings: bool = True
    hidden_activation: Literal["silu", "gelu_tanh"] = "silu"
    embedding_multiplier: float = 1.0
    attention_scale: float | None = None  # None: head_dim ** -0.5
    use_qk_norm: bool = False
    use_sandwich_norms: bool = False  # Gemma: norms after attention and after the MLP too
    final_logit_softcap: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"
    # "reference": the pure-jnp ragged paged attention; "kernel": its Pallas kernel (GPU).
    attention_impl: Literal["reference", "kernel"] = "reference"
    name: str = "model"

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
        if len(self.layer_types) != self.num_layers:
            raise InvalidRequestError(
                f"layer_types has {len(self.layer_types)} entries, expected num_layers={self.num_layers}"
            )
        if self.num_heads % self.num_kv_heads:
            raise InvalidRequestError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise InvalidRequestError("sliding_attention layers need sliding_window > 0")

    @property
    def query_scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of a layer in tokens, or None for full attention."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def layer_rope_theta(self, layer: int) -> float:
        if self.layer_types[layer] == "sliding_attention" and self.local_rope_theta is not None:
            return self.local_rope_theta
        return self.rope_theta

    def layer_rope_scaling(self, layer: int) -> RopeScaling | None:
        if self.layer_types[layer] == "sliding_attention" and self.local_rope_theta is not None:
            return None
        return self.rope_scaling

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V that one token occupies across all layers."""
        itemsize = 2 if self.dtype == "bfloat16" else 4
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def new_kv_pages(self, num_pages: int, page_size: int) -> Any:
        """Zeroed KV pages, one buffer for all layers:
        `[num_layers, num_pages, page_size, 2 * num_kv_heads, head_dim]` (K heads then V heads).

        Page 0 is the null page: padding rows of a batch write there and nothing reads it.
        """
        import jax.numpy as jnp

        if num_pages < 2 or page_size < 1:
            raise InvalidRequestError(
                f"need num_pages >= 2 (page 0 is reserved) and page_size >= 1, "
                f"got num_pages={num_pages}, page_size={page_size}"
            )
        shape = (self.num_layers, num_pages, page_size, 2 * self.num_kv_heads, self.head_dim)
        return jnp.zeros(shape, dtype=self.dtype)


@dataclass(frozen=True)
class EngineConfig:
    """Serving settings. Field names are the CLI flags in snake case."""

    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the model's context
    long_prefill_token_threshold: int = 0  # 0: no cap
    prefill_schedule_interval: int = 1
    enable_prefix_caching: bool = True
    numerics: Numerics = "fast"
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.numerics not in ("fast", "batch_invariant"):
            raise InvalidRequestError(
                f"numerics must be 'fast' or 'batch_invariant', got {self.numerics!r}"
            )
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "prefill_schedule_interval"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be >= 1, got {getattr(self, name)}")
