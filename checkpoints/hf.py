"""HF model directories (config.json + safetensors) of the llama and gemma3 families.

Maps HF tensor names onto agentjax's parameter names, transposes projections to [in, out], and
folds Gemma's `1 + w` RMSNorm convention into the weights. The tokenizer comes from the
directory's tokenizer.json and tokenizer_config.json when they exist. Host only: no jax.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from agentjax.config import ModelConfig, RopeScaling
from agentjax.errors import ModelLoadError, UnsupportedModelError

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Gemma3ForCausalLM": "gemma3"}
_LAYER_NAMES = {
    "input_layernorm.weight": "input_norm.weight",
    "self_attn.q_proj.weight": "attn.q_proj.kernel",
    "self_attn.k_proj.weight": "attn.k_proj.kernel",
    "self_attn.v_proj.weight": "attn.v_proj.kernel",
    "self_attn.o_proj.weight": "attn.o_proj.kernel",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "post_attention_layernorm.weight": "post_attn_norm.weight",  # gemma; llama's is remapped below
    "pre_feedforward_layernorm.weight": "pre_mlp_norm.weight",
    "post_feedforward_layernorm.weight": "post_mlp_norm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.kernel",
    "mlp.up_proj.weight": "mlp.up_proj.kernel",
    "mlp.down_proj.weight": "mlp.down_proj.kernel",
}
_LAYER_PATTERN = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _rope_scaling(raw: dict | None) -> RopeScaling | None:
    if not raw:
        return None
    kind = raw.get("rope_type") or raw.get("type")
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(raw["factor"]))
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=float(raw["factor"]),
            low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
            high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
        )
    raise UnsupportedModelError(f"unsupported rope_scaling type {kind!r}; supported: linear, llama3")


def config_from_hf(raw: dict[str, Any], name: str) -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedModelError(f"unsupported architectures {archs}; supported: {', '.join(ARCHITECTURES)}")
    num_heads = raw["num_attention_heads"]
    eos = raw.get("eos_token_id")
    common = dict(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads", num_heads),
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=raw.get("rope_theta", 10_000.0),
        rope_scaling=_rope_scaling(raw.get("rope_scaling")),
        tie_word_embeddings=raw.get("tie_word_embeddings", True),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
        name=name,
    )
    if arch == "llama":
        return ModelConfig(**common)
    num_layers = raw["num_hidden_layers"]
    layer_types = raw.get("layer_types") or [
        "full_attention" if (i + 1) % raw.get("sliding_window_pattern", 6) == 0 else "sliding_attention"
        for i in range(num_layers)
    ]
    return ModelConfig(
        **common,
        local_rope_theta=raw.get("rope_local_base_freq", 10_000.0),
        sliding_window=raw.get("sliding_window"),
        layer_types=tuple(layer_types),
        hidden_activation="gelu_tanh",
        embedding_multiplier=float(raw["hidden_size"]) ** 0.5,
        attention_scale=raw.get("query_pre_attn_scalar", common["head_dim"]) ** -0.5,
        use_qk_norm=True,
        use_sandwich_norms=True,
        final_logit_softcap=raw.get("final_logit_softcapping"),
    )


def param_name(hf_name: str, arch: str) -> str | None:
    if hf_name == "model.embed_tokens.weight":
        return "embed"
    if hf_name == "model.norm.weight":
        return "final_norm.weight"
    if hf_name == "lm_head.weight":
        return "lm_head"
    match = _LAYER_PATTERN.match(hf_name)
    if not match:
        return None
    layer, rest = match.groups()
    if arch == "llama" and rest == "post_attention_layernorm.weight":
        return f"layers.{layer}.pre_mlp_norm.weight"
    mapped = _LAYER_NAMES.get(rest)
    return f"layers.{layer}.{mapped}" if mapped else None


def load_hf(directory: str | Path) -> tuple[ModelConfig, dict[str, np.ndarray], Any]:
    """`(config, flat float32 arrays, tokenizer or None)` from an HF directory."""
    from safetensors.numpy import load_file

    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{directory} has no config.json")
    raw = json.loads(config_path.read_text())
    cfg = config_from_hf(raw, name=directory.name)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory} has no .safetensors files")
    arrays: dict[str, np.ndarray] = {}
    for file in files:
        for hf_name, tensor in load_file(str(file)).items():
            name = param_name(hf_name, cfg.architecture)
            if name is None:
                continue
            array = np.asarray(tensor, np.float32)
            if name.endswith("kernel") or name == "lm_head":
                array = np.ascontiguousarray(array.T)
            elif cfg.architecture == "gemma3" and name.endswith("weight"):
                array = array + 1.0  # Gemma's RMSNorm scales by (1 + w)
            arrays[name] = array
    if "lm_head" in arrays and cfg.tie_word_embeddings:
        del arrays["lm_head"]
    return cfg, arrays, _load_tokenizer(directory, cfg)


def _load_tokenizer(directory: Path, cfg: ModelConfig) -> Any:
    """The directory's tokenizer, or None when it ships without tokenizer.json."""
    import tokenizers

    from checkpoints.tokenizer import Tokenizer

    path = directory / "tokenizer.json"
    if not path.is_file():
        return None
    backend = tokenizers.Tokenizer.from_file(str(path))
    settings_path = directory / "tokenizer_config.json"
    settings = json.loads(settings_path.read_text()) if settings_path.is_file() else {}
    tokens = [backend.id_to_token(i) or "" for i in range(backend.get_vocab_size(with_added_tokens=True))]
    return Tokenizer(
        backend,
        tokens=tokens,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_ids[0] if cfg.eos_token_ids else 0,
        pad_token_id=settings.get("pad_token_id"),
        add_bos_token=bool(settings.get("add_bos_token", False)),
        chat_template=settings.get("chat_template"),
        architecture=cfg.architecture,
    )
