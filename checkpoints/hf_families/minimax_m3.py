"""The MiniMax-M3 family: `minimax_m3_vl` (the VL wrapper, text model under `text_config`) and
`minimax_m3_vl_text` (transformers' text-only MiniMaxM3VLForCausalLM).

Config: transformers 5.24.0's MiniMaxM3VLTextConfig, flat fields or the legacy
`sparse_attention_config` / `moe_layer_freq` forms; RoPE width is `head_dim * partial_rotary_factor`
as transformers computes it. Tensors: both spellings transformers writes (the wrapper keeps the
original `block_sparse_moe.experts.{e}.w1/w2/w3` and `self_attn.index_*`; the text model its fused
`mlp.experts.gate_up_proj`, `mlp.gate_up_proj` and `self_attn.indexer.*`), Gemma-style norms with
the `+ 1` folded in, and the `mtp.layers.{k}` modules. The vision tower is dropped. Host only.
"""
from __future__ import annotations

import logging
import re

import numpy as np

from agentjax.config import BlockSparseConfig, ModelConfig, MoEConfig
from agentjax.errors import ModelConfigError, TensorMismatchError
from checkpoints.hf_config import ConfigFields, rope_settings
from checkpoints.hf_families import HFFamily
from checkpoints.hf_families._reader import TensorReader
from checkpoints.hf_families._common import decoder_fields
from checkpoints.hf_tensors import HFTensors, contiguous

logger = logging.getLogger(__name__)

# transformers' MiniMaxM3VLTextConfig defaults
DEFAULTS = dict(head_dim=128, max_position_embeddings=524288, rms_norm_eps=1e-6, rope_theta=5_000_000.0,
                dense_intermediate_size=12288, shared_intermediate_size=3072, routed_scaling_factor=2.0,
                swiglu_alpha=1.702, swiglu_limit=7.0, index_n_heads=4, index_head_dim=128,
                index_block_size=128, index_topk_blocks=16, index_local_blocks=1,
                num_local_experts=128, num_experts_per_tok=4)
LEGACY_INDEX_KEYS = {"index_n_heads": "sparse_num_index_heads", "index_head_dim": "sparse_index_dim",
                     "index_block_size": "sparse_block_size", "index_topk_blocks": "sparse_topk_blocks",
                     "index_local_blocks": "sparse_local_block"}
LAYER_TYPES = {"full_attention": "full_attention", "minimax_m3_sparse": "block_sparse_attention"}
MLP_TYPES = {"dense": "dense", "sparse": "moe"}
# Where the text model's tensors live: the wrapper as saved, the wrapper as loaded, the text model.
MODEL_PREFIXES = ("language_model.model.", "model.language_model.", "model.")
LM_HEADS = ("language_model.lm_head.weight", "lm_head.weight")
VISION = r"(model\.)?(vision_tower|multi_modal_projector|patch_merge_mlp)\..*"


def _per_layer(fields: ConfigFields, key: str, legacy: list | None, names: dict[str, str], num_layers: int,
               flags: tuple[str, str], default: str) -> tuple[str, ...]:
    """`layer_types` / `mlp_layer_types` in agentjax's names, from the field, its legacy list of
    0/1 flags (`flags` = the names of 0 and of 1) or the default."""
    if fields.has(key):
        return tuple(names[v] for v in fields.string_list(key, list(names), num_layers))
    if legacy is not None:
        if not isinstance(legacy, list) or len(legacy) != num_layers:
            raise ModelConfigError(f"{fields.source}: the legacy form of {fields.path(key)!r} is {legacy!r}; "
                                   f"expected a list of {num_layers} 0/1 flags")
        return tuple(names[flags[1] if flag else flags[0]] for flag in legacy)
    return (names[default],) * num_layers


def text_config(fields: ConfigFields) -> ModelConfig:
    """A `MiniMaxM3VLTextConfig` (flat or nested) as a ModelConfig."""
    fields.choice("hidden_act", ["silu", "swigluoai"], default="silu")
    fields.reject("attention_output_gate", "false (the attention output gate is not supported)")
    if fields.number("swiglu_beta", 1.0) != 1.0:
        raise fields.error("swiglu_beta", fields.raw["swiglu_beta"], "1.0 (transformers adds 1 to up)")
    common = decoder_fields(fields, default_max_positions=DEFAULTS["max_position_embeddings"],
                            default_eps=DEFAULTS["rms_norm_eps"], default_head_dim=DEFAULTS["head_dim"])
    num_layers, head_dim = common["num_layers"], common["head_dim"]
    theta, scaling = rope_settings(fields, default_theta=DEFAULTS["rope_theta"])
    rope = fields.raw.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", fields.raw.get("partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * factor) if isinstance(factor, (int, float)) and not isinstance(factor, bool) else -1
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise fields.error("rope_parameters", rope, f"a partial_rotary_factor in (0, 1] giving an even number of "
                                                    f"rotated channels of head_dim={head_dim}")
    if fields.has("rotary_dim") and fields.raw["rotary_dim"] != rotary_dim:
        logger.warning("%s: rotary_dim=%s is ignored (as transformers does); RoPE rotates head_dim * "
                       "partial_rotary_factor = %d channels", fields.source, fields.raw["rotary_dim"], rotary_dim)
    sparse_legacy = fields.raw.get("sparse_attention_config") or {}
    if not isinstance(sparse_legacy, dict):
        raise fields.error("sparse_attention_config", sparse_legacy, "a JSON object")
    layer_types = _per_layer(fields, "layer_types", sparse_legacy.get("sparse_attention_freq"), LAYER_TYPES,
                             num_layers, ("full_attention", "minimax_m3_sparse"), "full_attention")
    mlp_types = _per_layer(fields, "mlp_layer_types", fields.raw.get("moe_layer_freq"), MLP_TYPES, num_layers,
                           ("dense", "sparse"), "sparse")
    legacy_fields = ConfigFields(sparse_legacy, fields.source, fields.path("sparse_attention_config."))
    index = {}
    for key, legacy in LEGACY_INDEX_KEYS.items():  # a legacy key wins, as in transformers
        least = 0 if key == "index_local_blocks" else 1
        index[key] = legacy_fields.integer(legacy, None, minimum=least)
        if index[key] is None:
            index[key] = fields.integer(key, DEFAULTS[key], minimum=least)
    block_sparse = None
    if "block_sparse_attention" in layer_types or fields.integer("num_mtp_modules", 0, minimum=0):
        block_sparse = BlockSparseConfig(index["index_n_heads"], index["index_head_dim"], index["index_block_size"],
                                         index["index_topk_blocks"], index["index_local_blocks"])
    num_experts = fields.integer("num_local_experts", fields.raw.get("num_experts") or DEFAULTS["num_local_experts"])
    moe = MoEConfig(
        num_experts=num_experts,
        num_experts_per_token=fields.integer("num_experts_per_tok", DEFAULTS["num_experts_per_tok"]),
        expert_intermediate_size=common["intermediate_size"],
        num_shared_experts=1,  # transformers always builds one shared MLP of shared_intermediate_size
        shared_intermediate_size=fields.integer("shared_intermediate_size", DEFAULTS["shared_intermediate_size"]),
        scoring=fields.choice("scoring_func", ["sigmoid"], default="sigmoid"),
        use_routing_bias=True,
        routed_scaling_factor=fields.number("routed_scaling_factor", DEFAULTS["routed_scaling_factor"]),
        activation="swigluoai",
        swiglu_alpha=fields.number("swiglu_alpha", DEFAULTS["swiglu_alpha"]),
        swiglu_limit=fields.number("swiglu_limit", DEFAULTS["swiglu_limit"]),
    )
    dense_width = fields.integer("dense_intermediate_size", DEFAULTS["dense_intermediate_size"])
    return ModelConfig(
        architecture="minimax_m3",
        **{**common, "intermediate_size": dense_width},
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_dim=rotary_dim,
        layer_types=layer_types,
        mlp_layer_types=mlp_types,
        tie_word_embeddings=fields.boolean("tie_word_embeddings", False),
        hidden_activation="swigluoai",
        swiglu_alpha=moe.swiglu_alpha,
        swiglu_limit=moe.swiglu_limit,
        use_qk_norm=True,
        block_sparse=block_sparse,
        moe=moe if "moe" in mlp_types or fields.integer("num_mtp_modules", 0, minimum=0) else None,
        num_mtp_modules=fields.integer("num_mtp_modules", 0, minimum=0),
    )


def model_config(fields: ConfigFields) -> ModelConfig:
    if fields.raw.get("model_type") == "minimax_m3_vl":
        cfg = text_config(fields.section("text_config"))
        return cfg.replace(tie_word_embeddings=cfg.tie_word_embeddings or fields.boolean("tie_word_embeddings", False))
    return text_config(fields)


class _Reader(TensorReader):
    """The shared reader, plus MiniMax-M3's fused gate_up weights."""

    def split_gate_up(self, params: tuple[str, str], fused: str, width: int, hidden: int) -> None:
        """A fused `[2 * width, hidden]` gate_up weight (gate first) into two `[hidden, width]` kernels."""
        array = self.tensors.take(fused, shape=(2 * width, hidden), param=params[0])
        self.tensors.origins[params[1]] = fused
        self.arrays[params[0]] = contiguous(array[:width].T)
        self.arrays[params[1]] = contiguous(array[width:].T)


def _attention(read: _Reader, src: str, dst: str, sparse: bool) -> None:
    for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
        read.one(f"{dst}attn.{p}.kernel", [f"{src}self_attn.{p}.weight"], transpose=True)
    for p in ("q_norm", "k_norm"):
        read.one(f"{dst}attn.{p}.weight", [f"{src}self_attn.{p}.weight"], norm=True)
    if sparse:
        for p in ("q", "k"):
            read.one(f"{dst}attn.index_{p}_proj.kernel",
                     [f"{src}self_attn.indexer.{p}_proj.weight", f"{src}self_attn.index_{p}_proj.weight"],
                     transpose=True)
            read.one(f"{dst}attn.index_{p}_norm.weight",
                     [f"{src}self_attn.indexer.{p}_norm.weight", f"{src}self_attn.index_{p}_norm.weight"], norm=True)


def _dense_mlp(read: _Reader, src: str, dst: str, cfg: ModelConfig) -> None:
    fused = f"{src}mlp.gate_up_proj.weight"
    if fused in read.tensors:
        read.split_gate_up((f"{dst}mlp.gate_proj.kernel", f"{dst}mlp.up_proj.kernel"), fused,
                           cfg.intermediate_size, cfg.hidden_size)
    else:
        for p in ("gate_proj", "up_proj"):
            read.one(f"{dst}mlp.{p}.kernel", [f"{src}mlp.{p}.weight"], transpose=True)
    read.one(f"{dst}mlp.down_proj.kernel", [f"{src}mlp.down_proj.weight"], transpose=True)


def _moe(read: _Reader, src: str, dst: str, cfg: ModelConfig) -> None:
    moe, hidden = cfg.moe, cfg.hidden_size
    experts, inner, shared = moe.num_experts, moe.expert_intermediate_size, moe.shared_size
    native, original = f"{src}mlp.", f"{src}block_sparse_moe."
    read.one(f"{dst}mlp.router.kernel", [native + "gate.weight", original + "gate.weight"], transpose=True)
    read.one(f"{dst}mlp.router.selection_bias",
             [native + "gate.e_score_correction_bias", original + "e_score_correction_bias"])
    gate_up, down = f"{dst}mlp.experts.gate_up_proj", f"{dst}mlp.experts.down_proj"
    if native + "experts.gate_up_proj" in read.tensors or not read.present([original + "experts.0.w1.weight"]):
        read.one(gate_up, [native + "experts.gate_up_proj"])
        read.one(down, [native + "experts.down_proj"])
        for param in (gate_up, down):  # [E, out, in] -> [E, in, out]
            if param in read.arrays:
                read.arrays[param] = contiguous(read.arrays[param].transpose(0, 2, 1))
    else:
        def expert(e: int, w: str, shape: tuple[int, int]) -> np.ndarray:
            return read.tensors.take(f"{original}experts.{e}.{w}.weight", shape=shape, param=gate_up).T

        for e in range(experts):
            for w in ("w1", "w2", "w3"):
                if f"{original}experts.{e}.{w}.weight" not in read.tensors:
                    raise TensorMismatchError(f"{read.tensors.where} lacks tensor {original}experts.{e}.{w}.weight "
                                              f"(expert {e} of {experts})")
        read.arrays[gate_up] = np.stack([
            np.concatenate([expert(e, "w1", (inner, hidden)), expert(e, "w3", (inner, hidden))], axis=1)
            for e in range(experts)])
        read.arrays[down] = np.stack([expert(e, "w2", (hidden, inner)) for e in range(experts)])
        read.tensors.origins[gate_up] = f"{original}experts.*.w1/w3.weight"
        read.tensors.origins[down] = f"{original}experts.*.w2.weight"
    shared_gate_up = f"{dst}mlp.shared_experts.gate_up_proj"
    fused = native + "shared_experts.gate_up_proj.weight"
    if fused in read.tensors:
        read.one(shared_gate_up, [fused], transpose=True)
    else:
        read.one(f"{shared_gate_up}.gate", [original + "shared_experts.gate_proj.weight"], transpose=True)
        read.one(f"{shared_gate_up}.up", [original + "shared_experts.up_proj.weight"], transpose=True)
        halves = [read.arrays.pop(f"{shared_gate_up}.{h}", None) for h in ("gate", "up")]
        if all(h is not None for h in halves):
            if halves[0].shape != (hidden, shared) or halves[1].shape != (hidden, shared):
                raise TensorMismatchError(
                    f"{read.tensors.where}: {original}shared_experts.gate_proj/up_proj have shapes "
                    f"{halves[0].T.shape} and {halves[1].T.shape}, the model expects ({shared}, {hidden}) each")
            read.arrays[shared_gate_up] = np.concatenate(halves, axis=1)
        else:
            read.tensors.origins[shared_gate_up] = original + "shared_experts.gate_proj.weight"
    read.one(f"{dst}mlp.shared_experts.down_proj",
             [native + "shared_experts.down_proj.weight", original + "shared_experts.down_proj.weight"], transpose=True)


def _layer(read: _Reader, src: str, dst: str, cfg: ModelConfig, sparse: bool, moe: bool) -> None:
    read.one(f"{dst}input_norm.weight", [f"{src}input_layernorm.weight"], norm=True)
    read.one(f"{dst}pre_mlp_norm.weight", [f"{src}post_attention_layernorm.weight"], norm=True)
    _attention(read, src, dst, sparse)
    (_moe if moe else _dense_mlp)(read, src, dst, cfg)


def convert_tensors(cfg: ModelConfig, tensors: HFTensors) -> dict[str, np.ndarray]:
    prefix = next((p for p in MODEL_PREFIXES if p + "embed_tokens.weight" in tensors), MODEL_PREFIXES[-1])
    tensors.ignore_matching(VISION)
    tensors.ignore_matching(r".*rotary_emb\.inv_freq")
    extra_mtp = rf"{re.escape(prefix)}mtp\.layers\.(\d+)\..*"
    beyond = sorted({int(m.group(1)) for n in tensors.names if (m := re.fullmatch(extra_mtp, n))
                     and int(m.group(1)) >= cfg.num_mtp_modules})
    if beyond:
        logger.info("%s: ignoring MTP modules %s (the config declares num_mtp_modules=%d)",
                    tensors.where, beyond, cfg.num_mtp_modules)
        for k in beyond:
            tensors.ignore_matching(rf"{re.escape(prefix)}mtp\.layers\.{k}\..*")
    read = _Reader(tensors)
    read.one("embed", [prefix + "embed_tokens.weight"])
    read.one("final_norm.weight", [prefix + "norm.weight"], norm=True)
    if cfg.tie_word_embeddings:
        tensors.ignore(*LM_HEADS)
    else:
        read.one("lm_head", list(LM_HEADS), transpose=True)
    for i in range(cfg.num_layers):
        _layer(read, f"{prefix}layers.{i}.", f"layers.{i}.", cfg,
               cfg.layer_types[i] == "block_sparse_attention", cfg.mlp_layer_types[i] == "moe")
    for k in range(cfg.num_mtp_modules):
        src, dst = f"{prefix}mtp.layers.{k}.", f"mtp.{k}."
        for ours, theirs in (("enorm", "enorm"), ("hnorm", "hnorm"), ("final_norm", "final_layernorm")):
            read.one(f"{dst}{ours}.weight", [f"{src}{theirs}.weight"], norm=True)
        read.one(f"{dst}eh_proj.kernel", [f"{src}eh_proj.weight"], transpose=True)
        _layer(read, f"{src}transformer_layer.", f"{dst}block.", cfg, sparse=True, moe=True)
    return read.arrays


FAMILY = HFFamily(
    name="minimax_m3",
    model_types=("minimax_m3_vl", "minimax_m3_vl_text"),
    architectures=("MiniMaxM3SparseForConditionalGeneration", "MiniMaxM3VLForCausalLM", "MiniMaxM3SparseForCausalLM"),
    model_config=model_config,
    convert_tensors=convert_tensors,
)
