"""The model specs `--model` and `LLM(model=...)` accept, named for help texts and errors.

Host only: never imports jax (`agentjax.models.presets` holds the configs themselves; a test keeps
the names here equal to its `PRESETS` and `FULL_SIZE_PRESETS`).
"""
from __future__ import annotations

from checkpoints.embedded import DEFAULT_MODEL, EMBEDDED_MODELS

# Small random-weight models with SmolLM2's tokenizer (`preset:NAME`).
PRESET_NAMES = ("tiny-dense", "tiny-sliding", "tiny-long", "tiny-minimax-m3", "tiny-kimi-k3", "tiny-dsv4")
# The target families at full size: abstract shapes for the planner and `sweep`; never loaded.
FULL_SIZE_NAMES = ("minimax-m3", "kimi-k3", "deepseek-v4-pro")


def model_spec_help() -> str:
    """One sentence listing every spec `--model` accepts."""
    presets = ", ".join(f"preset:{name}" for name in PRESET_NAMES)
    return (f"the model: an embedded one ({', '.join(EMBEDDED_MODELS)}), a preset with random weights "
            f"({presets}), a GGUF file or an HF checkpoint directory (default: {DEFAULT_MODEL})")
