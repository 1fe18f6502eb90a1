"""DeepSeek-V4's attention settings and tensors for the deepseek_v4 family (checkpoints/hf_families/deepseek_v4.py).

`attention_config(fields, num_layers)` reads the layer schedule (`layer_types`, or the legacy per-layer
`compress_ratios`), the compression rates, heads, LoRA ranks, grouped output projection, window,
indexer and both RoPE settings, with errors naming the field; `attention_tensors(cfg, layer)` lists,
for each parameter of one layer's mixer, its HF spellings (upstream first, then transformers'
module names) and how the weight is converted. Host only: never imports jax.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from agentjax.config import CompressedAttentionConfig, RopeScaling
from checkpoints.hf_config import ConfigFields
from checkpoints.hf_tensors import contiguous

# transformers' DeepseekV4Config defaults
DEFAULTS = dict(num_attention_heads=64, num_key_value_heads=1, head_dim=512, q_lora_rank=1024, o_groups=8,
                o_lora_rank=1024, sliding_window=128, index_n_heads=64, index_head_dim=128, index_topk=512,
                rope_theta=10000.0, compress_rope_theta=160000.0, partial_rotary_factor=64 / 512)
HF_LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
LAYER_TYPES = dict(zip(HF_LAYER_TYPES, ("swa_mqa", "csa", "hca")))
LEGACY_RATIOS = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
DEFAULT_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def _layer_types(fields: ConfigFields, num_layers: int) -> tuple[str, ...]:
    """transformers' schedule: `layer_types`, else legacy `compress_ratios` (0/4/128 per layer, an MTP
    entry past the last layer dropped), else two HCA layers then CSA at odd and HCA at even offsets."""
    if fields.has("layer_types"):
        return fields.string_list("layer_types", HF_LAYER_TYPES, num_layers)
    legacy = fields.raw.get("compress_ratios")
    if legacy is not None:
        if not isinstance(legacy, list) or len(legacy) < num_layers or any(r not in LEGACY_RATIOS for r in legacy):
            raise fields.error("compress_ratios", legacy, f"a list of at least {num_layers} ratios, each 0, 4 or 128")
        return tuple(LEGACY_RATIOS[r] for r in legacy[:num_layers])
    interleave = ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
                  for i in range(max(num_layers - 2, 0))]
    return tuple((["heavily_compressed_attention"] * min(num_layers, 2) + interleave)[:num_layers])


def _rates(fields: ConfigFields) -> dict[str, int]:
    rates = dict(DEFAULT_RATES)
    if fields.has("compress_rates"):
        section = fields.section("compress_rates")
        for key in rates:
            rates[key] = section.integer(key, rates[key], minimum=1)
    for key, legacy in (("compressed_sparse_attention", "compress_rate_csa"),
                        ("heavily_compressed_attention", "compress_rate_hca")):
        rates[key] = fields.integer(legacy, rates[key], minimum=1)
    return rates


def _rope_parameters(fields: ConfigFields) -> tuple[dict[str, Any], dict[str, Any], float]:
    """`(main, compress, partial_rotary_factor)` as transformers' __post_init__ resolves them."""
    raw = fields.raw.get("rope_parameters") or {}
    if not isinstance(raw, Mapping):
        raise fields.error("rope_parameters", raw, "a JSON object")
    factor = fields.raw.get("partial_rotary_factor")
    if factor is None and fields.has("qk_rope_head_dim"):
        factor = fields.integer("qk_rope_head_dim", minimum=0) / fields.integer("head_dim", DEFAULTS["head_dim"])
    factor = DEFAULTS["partial_rotary_factor"] if factor is None else factor
    if isinstance(raw.get("main"), Mapping) and isinstance(raw.get("compress"), Mapping):
        return dict(raw["main"]), dict(raw["compress"]), factor
    flat = {k: v for k, v in raw.items() if k not in ("main", "compress")} or dict(fields.raw.get("rope_scaling") or {})
    main = {"rope_type": "default", "rope_theta": fields.number("rope_theta", DEFAULTS["rope_theta"])}
    compress = {**flat, "rope_theta": fields.number("compress_rope_theta", DEFAULTS["compress_rope_theta"])}
    compress["rope_type"] = compress.get("rope_type", compress.get("type", "default"))
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return main, compress, factor


def attention_settings(fields: ConfigFields, num_layers: int) -> dict[str, Any]:
    """Every attention setting, checked, in transformers' terms (`attention_config` maps them to agentjax)."""
    heads = fields.integer("num_attention_heads", DEFAULTS["num_attention_heads"])
    if fields.integer("num_key_value_heads", DEFAULTS["num_key_value_heads"]) != 1:
        raise fields.error("num_key_value_heads", fields.raw["num_key_value_heads"],
                           "1 (DeepSeek-V4's attention is shared-KV MQA: one K=V head)")
    head_dim = fields.integer("head_dim", DEFAULTS["head_dim"])
    groups = fields.integer("o_groups", DEFAULTS["o_groups"])
    if heads % groups:
        raise fields.error("o_groups", groups, f"a divisor of num_attention_heads={heads}")
    main, compress, factor = _rope_parameters(fields)
    rope_dim = int(head_dim * factor) if isinstance(factor, (int, float)) and not isinstance(factor, bool) else -1
    if not 0 < rope_dim <= head_dim or rope_dim % 2:
        raise fields.error("partial_rotary_factor", factor,
                           f"a factor in (0, 1] giving an even number of rotated channels of head_dim={head_dim}")
    for label, params, allowed in (("main", main, ("default",)), ("compress", compress, ("default", "yarn"))):
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in allowed:
            raise fields.error(f"rope_parameters.{label}.rope_type", kind, " or ".join(map(repr, allowed)))
    return dict(
        layer_types=_layer_types(fields, num_layers), compress_rates=_rates(fields), num_heads=heads,
        head_dim=head_dim, rope_dim=rope_dim, q_lora_rank=fields.integer("q_lora_rank", DEFAULTS["q_lora_rank"]),
        o_groups=groups, o_lora_rank=fields.integer("o_lora_rank", DEFAULTS["o_lora_rank"]),
        sliding_window=fields.integer("sliding_window", DEFAULTS["sliding_window"]),
        index_heads=fields.integer("index_n_heads", DEFAULTS["index_n_heads"]),
        index_head_dim=fields.integer("index_head_dim", DEFAULTS["index_head_dim"]),
        index_topk=fields.integer("index_topk", DEFAULTS["index_topk"]),
        main_rope=main, compress_rope=compress,
    )


def _rope_scaling(fields: ConfigFields, params: Mapping[str, Any]) -> RopeScaling | None:
    """The compress RoPE's YaRN scaling as transformers computes it (None: plain RoPE)."""
    if params.get("rope_type", params.get("type", "default")) != "yarn":
        return None
    checked = ConfigFields(params, fields.source, prefix=fields.path("rope_parameters.compress."))
    attention_factor = params.get("attention_factor")
    if attention_factor is None and (params.get("mscale") or params.get("mscale_all_dim")):
        raise checked.error("mscale", params.get("mscale"), "absent (YaRN's mscale is not supported; DeepSeek-V4 "
                                                            "sets attention_factor 1.0)")
    return RopeScaling(
        kind="yarn", factor=checked.number("factor"),
        original_max_position_embeddings=checked.integer("original_max_position_embeddings"),
        beta_fast=checked.number("beta_fast", 32.0), beta_slow=checked.number("beta_slow", 1.0),
        attention_factor=None if attention_factor is None else checked.number("attention_factor"),
        truncate=checked.boolean("truncate", True),
    )


def attention_config(fields: ConfigFields, num_layers: int) -> dict[str, Any]:
    """The ModelConfig fields of DeepSeek-V4's attention: layer types, heads, window, RoPE and the
    `compressed_attention` sub-config."""
    settings = attention_settings(fields, num_layers)
    rates = settings["compress_rates"]
    compressed = CompressedAttentionConfig(
        q_lora_rank=settings["q_lora_rank"], o_lora_rank=settings["o_lora_rank"], o_groups=settings["o_groups"],
        csa_rate=rates["compressed_sparse_attention"], hca_rate=rates["heavily_compressed_attention"],
        index_num_heads=settings["index_heads"], index_head_dim=settings["index_head_dim"],
        index_topk=settings["index_topk"],
        compress_rope_theta=float(settings["compress_rope"].get("rope_theta", DEFAULTS["compress_rope_theta"])),
        compress_rope_scaling=_rope_scaling(fields, settings["compress_rope"]),
    )
    return dict(
        layer_types=tuple(LAYER_TYPES[t] for t in settings["layer_types"]),
        num_heads=settings["num_heads"], num_kv_heads=1, head_dim=settings["head_dim"],
        rotary_dim=settings["rope_dim"], sliding_window=settings["sliding_window"],
        rope_theta=float(settings["main_rope"].get("rope_theta", DEFAULTS["rope_theta"])),
        compressed_attention=compressed,
    )


def _transposed(array: np.ndarray) -> np.ndarray:
    return contiguous(array.T)


def attention_tensors(cfg, layer: int) -> dict[str, tuple[list[str], Callable[[np.ndarray], np.ndarray] | None]]:
    """`{mixer parameter: ([HF spellings under the layer], convert)}` for one layer (an MTP block: `layer`
    past the stack, always swa_mqa). [out, in] weights become [in, out] kernels; the grouped output
    projection's `[groups * o_rank, in]` becomes `[groups, in, o_rank]`."""
    kind = cfg.layer_types[layer] if layer < cfg.num_layers else "swa_mqa"
    attention = cfg.compressed_attention

    def grouped(array: np.ndarray) -> np.ndarray:
        if array.ndim != 2 or array.shape[0] != attention.o_groups * attention.o_lora_rank:
            return array  # the loader's shape check names it
        return contiguous(array.reshape(attention.o_groups, attention.o_lora_rank, -1).transpose(0, 2, 1))

    def spell(upstream: str, hf: str) -> list[str]:
        return [f"attn.{upstream}", f"self_attn.{hf}"]

    tensors = {
        "q_a_proj.kernel": (spell("wq_a.weight", "q_a_proj.weight"), _transposed),
        "q_a_norm.weight": (spell("q_norm.weight", "q_a_norm.weight"), None),
        "q_b_proj.kernel": (spell("wq_b.weight", "q_b_proj.weight"), _transposed),
        "kv_proj.kernel": (spell("wkv.weight", "kv_proj.weight"), _transposed),
        "kv_norm.weight": (spell("norm.weight", "kv_norm.weight"), None),
        "o_a_proj.kernel": (spell("wo_a.weight", "o_a_proj.weight"), grouped),
        "o_b_proj.kernel": (spell("wo_b.weight", "o_b_proj.weight"), _transposed),
        "sinks": (spell("attn_sink", "sinks"), None),
    }
    if kind in ("csa", "hca"):
        for sub, (upstream, hf) in {"compressor": ("compressor.", "compressor."),
                                    "indexer": ("indexer.compressor.", "compressor.indexer.")}.items():
            if sub == "indexer" and kind != "csa":
                continue
            tensors.update({
                f"{sub}.kv_proj.kernel": (spell(upstream + "wkv.weight", hf + "kv_proj.weight"), _transposed),
                f"{sub}.gate_proj.kernel": (spell(upstream + "wgate.weight", hf + "gate_proj.weight"), _transposed),
                f"{sub}.position_bias": (spell(upstream + "ape", hf + "position_bias"), None),
                f"{sub}.kv_norm.weight": (spell(upstream + "norm.weight", hf + "kv_norm.weight"), None),
            })
    if kind == "csa":
        tensors["indexer.q_b_proj.kernel"] = (spell("indexer.wq_b.weight", "compressor.indexer.q_b_proj.weight"),
                                              _transposed)
        tensors["indexer.weights_proj.kernel"] = (
            spell("indexer.weights_proj.weight", "compressor.indexer.scorer.weights_proj.weight"), _transposed)
    return tensors
