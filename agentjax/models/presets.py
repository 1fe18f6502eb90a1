"""Small model configurations with random weights, for tests and experiments.

Presets reuse the embedded model's vocabulary size so the embedded tokenizer serves them.
"""
from __future__ import annotations

from agentjax.config import ModelConfig
from agentjax.errors import ModelLoadError

SMOLLM2_VOCAB = 49152

PRESETS: dict[str, ModelConfig] = {
    "tiny-dense": ModelConfig(
        architecture="llama",
        vocab_size=SMOLLM2_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rope_theta=10_000.0,
        bos_token_id=1,
        eos_token_ids=(2,),
        name="tiny-dense",
    ),
    "tiny-sliding": ModelConfig(
        architecture="gemma3",
        vocab_size=SMOLLM2_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_layers=3,
        num_heads=4,
        num_kv_heads=1,
        head_dim=16,
        max_position_embeddings=4096,
        rope_theta=1_000_000.0,
        local_rope_theta=10_000.0,
        sliding_window=8,
        layer_types=("sliding_attention", "sliding_attention", "full_attention"),
        hidden_activation="gelu_tanh",
        embedding_multiplier=8.0,
        use_qk_norm=True,
        use_sandwich_norms=True,
        bos_token_id=1,
        eos_token_ids=(2,),
        name="tiny-sliding",
    ),
    # A long context window (1M positions) on a tiny model: for long-prompt serving tests
    # (chunked prefill, paged KV at 30K+ tokens) without a real model's cost.
    "tiny-long": ModelConfig(
        architecture="llama",
        vocab_size=SMOLLM2_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=1 << 20,
        rope_theta=10_000_000.0,
        bos_token_id=1,
        eos_token_ids=(2,),
        name="tiny-long",
    ),
}


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ModelLoadError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]
