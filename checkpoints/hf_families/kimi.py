"""The Kimi family: `kimi_linear` (transformers' KimiLinearForCausalLM: KDA + NoPE MLA + MoE) and
`kimi_k3` (the Kimi-K3 wrapper, its text model a kimi_linear config under `text_config`).

Config: transformers 5.24.0's KimiLinearConfig as saved (checkpoint spellings such as
`num_experts`, `linear_attn_config` with 1-based `kda_layers` / `full_attn_layers`) plus Kimi-K3's
fields (`mla_use_output_gate`, `attn_res_block_size`, `routed_expert_hidden_size`,
`latent_moe_use_norm`, `hidden_act: situ` with its betas, `linear_attn_config.use_full_rank_gate` and
`gate_lower_bound`). Tensors: the names transformers saves (dense layers as `mlp.*` or, as its save
reversal writes them, `block_sparse_moe.*`; experts per expert as `w1/w2/w3` or fused 3-D
`gate_up_proj` / `down_proj`), under `model.` or the K3 wrapper's `language_model.model.`. Host only.
"""
from __future__ import annotations

import logging

import numpy as np

from agentjax.config import KDAConfig, MLAConfig, ModelConfig, MoEConfig
from checkpoints.hf_config import ConfigFields
from checkpoints.hf_families import HFFamily
from checkpoints.hf_families._reader import TensorReader
from checkpoints.hf_tensors import HFTensors, contiguous

# transformers' KimiLinearConfig defaults (used when config.json leaves a field out)
DEFAULTS = dict(vocab_size=163840, hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024,
                num_hidden_layers=27, num_attention_heads=32, num_shared_experts=1, routed_scaling_factor=2.446,
                kv_lora_rank=512, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, num_expert_group=1,
                topk_group=1, num_experts_per_token=8, max_position_embeddings=1048576, rms_norm_eps=1e-5,
                num_experts=256, linear_head_dim=128, linear_num_heads=32, linear_conv_kernel_dim=4,
                first_k_dense_replace=1)
LAYER_TYPES = {"linear_attention": "kda", "full_attention": "mla"}
MLP_TYPES = {"dense": "dense", "sparse": "moe"}
# Where the text model's tensors live: kimi_linear, then the K3 wrapper.
PREFIXES = (("model.", "lm_head.weight"), ("language_model.model.", "language_model.lm_head.weight"))
logger = logging.getLogger(__name__)


def _layer_types(fields: ConfigFields, linear: ConfigFields, num_layers: int) -> tuple[str, ...]:
    """Explicit `layer_types`, else `linear_attn_config`'s 1-based lists, else transformers' default."""
    if fields.has("layer_types"):
        return tuple(LAYER_TYPES[t] for t in fields.string_list("layer_types", list(LAYER_TYPES), num_layers))
    full, kda = linear.raw.get("full_attn_layers"), linear.raw.get("kda_layers")
    if full is not None and kda is not None:
        types: list[str | None] = [None] * num_layers
        for key, values, kind in (("full_attn_layers", full, "mla"), ("kda_layers", kda, "kda")):
            if not isinstance(values, list) or any(isinstance(v, bool) or not isinstance(v, int)
                                                   or not 1 <= v <= num_layers for v in values):
                raise linear.error(key, values, f"a list of 1-based layer numbers in [1, {num_layers}]")
            for v in values:
                types[v - 1] = kind
        if None in types:
            raise linear.error("kda_layers", kda, f"full_attn_layers and kda_layers covering every layer 1.."
                                                  f"{num_layers} (layer {types.index(None) + 1} is in neither)")
        return tuple(types)
    return tuple("mla" if i and i % 4 == 0 else "kda" for i in range(num_layers))


def text_config(fields: ConfigFields, *, tied_head: bool = True) -> ModelConfig:
    """A KimiLinearConfig (plus Kimi-K3's text fields) as a ModelConfig. `tied_head=False`: the LM head
    is always its own tensor (transformers' KimiLinearForCausalLM ties nothing, whatever
    `tie_word_embeddings` says)."""
    for key, why in (("mla_use_nope", "true (Kimi's MLA applies no RoPE)"),):
        if fields.raw.get(key, True) is not True:
            raise fields.error(key, fields.raw[key], why)
    activation = fields.choice("hidden_act", ["silu", "situ"], default="silu")
    scoring = fields.choice("moe_router_activation_func", ["sigmoid"], default="sigmoid")
    num_layers = fields.integer("num_hidden_layers", DEFAULTS["num_hidden_layers"])
    hidden = fields.integer("hidden_size", DEFAULTS["hidden_size"])
    heads = fields.integer("num_attention_heads", DEFAULTS["num_attention_heads"])
    if fields.integer("num_key_value_heads", heads) != heads:
        raise fields.error("num_key_value_heads", fields.raw["num_key_value_heads"],
                           f"num_attention_heads={heads} (Kimi's MLA keys are per head after kv_b_proj)")
    eps = fields.number("rms_norm_eps", DEFAULTS["rms_norm_eps"])
    linear = (fields.section("linear_attn_config") if fields.has("linear_attn_config")
              else ConfigFields({}, fields.source, prefix="linear_attn_config."))
    layer_types = _layer_types(fields, linear, num_layers)
    if fields.has("mlp_layer_types"):
        mlp_types = tuple(MLP_TYPES[t] for t in fields.string_list("mlp_layer_types", list(MLP_TYPES), num_layers))
    else:
        dense = fields.integer("first_k_dense_replace", DEFAULTS["first_k_dense_replace"], minimum=0)
        mlp_types = tuple("dense" if i < dense else "moe" for i in range(num_layers))
    mla = MLAConfig(
        kv_lora_rank=fields.integer("kv_lora_rank", DEFAULTS["kv_lora_rank"]),
        qk_nope_head_dim=fields.integer("qk_nope_head_dim", DEFAULTS["qk_nope_head_dim"]),
        qk_rope_head_dim=fields.integer("qk_rope_head_dim", DEFAULTS["qk_rope_head_dim"], minimum=0),
        v_head_dim=fields.integer("v_head_dim", DEFAULTS["v_head_dim"]),
        q_lora_rank=fields.integer("q_lora_rank", None),
        output_gate=fields.boolean("mla_use_output_gate", False),
    )
    kda = KDAConfig(
        num_heads=linear.integer("num_heads", fields.integer("linear_num_heads", DEFAULTS["linear_num_heads"])),
        head_dim=linear.integer("head_dim", fields.integer("linear_head_dim", DEFAULTS["linear_head_dim"])),
        conv_kernel_size=linear.integer("short_conv_kernel_size",
                                        fields.integer("linear_conv_kernel_dim", DEFAULTS["linear_conv_kernel_dim"])),
        **_kda_k3_fields(linear),
    )
    situ = dict(situ_beta=fields.number("activation_situ_beta", 4.0),
                situ_linear_beta=fields.number("activation_situ_linear_beta", 25.0 if activation == "situ" else None))
    latent = fields.integer("routed_expert_hidden_size", None)
    moe = MoEConfig(
        num_experts=fields.integer("num_experts", DEFAULTS["num_experts"]),
        num_experts_per_token=fields.integer("num_experts_per_token", DEFAULTS["num_experts_per_token"]),
        expert_intermediate_size=fields.integer("moe_intermediate_size", DEFAULTS["moe_intermediate_size"]),
        num_shared_experts=fields.integer("num_shared_experts", DEFAULTS["num_shared_experts"], minimum=0),
        scoring=scoring,
        use_routing_bias=True,
        num_expert_groups=fields.integer("num_expert_group", DEFAULTS["num_expert_group"]),
        topk_groups=fields.integer("topk_group", DEFAULTS["topk_group"]),
        renormalize=fields.boolean("moe_renormalize", True),
        routed_scaling_factor=fields.number("routed_scaling_factor", DEFAULTS["routed_scaling_factor"]),
        activation=activation,
        **situ,
        latent_size=latent,
        latent_norm=fields.boolean("latent_moe_use_norm", False) if latent is not None else False,
        norm_eps=eps,
    )
    bos, eos = fields.token_ids("bos_token_id"), fields.token_ids("eos_token_id")
    return ModelConfig(
        architecture="kimi_linear",
        vocab_size=fields.integer("vocab_size", DEFAULTS["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=fields.integer("intermediate_size", DEFAULTS["intermediate_size"]),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=mla.qk_head_dim,  # transformers' `head_dim` field is qk_rope_head_dim: not a head size
        max_position_embeddings=fields.integer("max_position_embeddings", DEFAULTS["max_position_embeddings"]),
        rms_norm_eps=eps,
        layer_types=layer_types,
        mlp_layer_types=mlp_types,
        tie_word_embeddings=_tied(fields, tied_head),
        hidden_activation=activation,
        **situ,
        attn_res_block_size=fields.integer("attn_res_block_size", None),
        mla=mla if "mla" in layer_types else None,
        kda=kda if "kda" in layer_types else None,
        moe=moe if "moe" in mlp_types else None,
        bos_token_id=bos[0] if bos else None,
        eos_token_ids=eos,
    )


def _tied(fields: ConfigFields, tied_head: bool) -> bool:
    tie = fields.boolean("tie_word_embeddings", False)
    if tie and not tied_head:
        logger.warning("%s: tie_word_embeddings=true is ignored (as transformers' KimiLinearForCausalLM does): "
                       "the LM head is read from lm_head.weight", fields.source)
    return tie and tied_head


def _kda_k3_fields(linear: ConfigFields) -> dict:
    """Kimi-K3's KDA options: the full-rank output gate and the bound on the log-decay."""
    bound = linear.number("gate_lower_bound", None, positive=False)
    if bound is not None and bound >= 0:
        raise linear.error("gate_lower_bound", bound, "a negative number (a bound on the log-decay) or null")
    return dict(full_rank_gate=linear.boolean("use_full_rank_gate", False), gate_lower_bound=bound)


def model_config(fields: ConfigFields) -> ModelConfig:
    if fields.raw.get("model_type") == "kimi_k3":
        text = fields.section("text_config")
        cfg = text_config(text)
        top_eos = fields.token_ids("eos_token_id")
        return cfg.replace(eos_token_ids=top_eos or cfg.eos_token_ids,
                           bos_token_id=(fields.token_ids("bos_token_id") or (cfg.bos_token_id,))[0])
    return text_config(fields, tied_head=False)


def _mla(read: TensorReader, src: str, dst: str, cfg: ModelConfig) -> None:
    names = ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    names += ["q_proj"] if cfg.mla.q_lora_rank is None else ["q_a_proj", "q_b_proj"]
    names += ["g_proj"] if cfg.mla.output_gate else []
    for p in names:
        read.one(f"{dst}attn.{p}.kernel", [f"{src}self_attn.{p}.weight"], transpose=True)
    norms = ["kv_a_layernorm"] + ([] if cfg.mla.q_lora_rank is None else ["q_a_layernorm"])
    for p in norms:
        read.one(f"{dst}attn.{p}.weight", [f"{src}self_attn.{p}.weight"])


def _kda(read: TensorReader, src: str, dst: str, cfg: ModelConfig) -> None:
    kda = cfg.kda
    gate = ["g_proj"] if kda.full_rank_gate else ["g_a_proj", "g_b_proj"]
    for p in ["q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "o_proj", *gate]:
        read.one(f"{dst}attn.{p}.kernel", [f"{src}self_attn.{p}.weight"], transpose=True)
    for p in ("q_conv1d", "k_conv1d", "v_conv1d", "o_norm"):
        read.one(f"{dst}attn.{p}.weight", [f"{src}self_attn.{p}.weight"])
    expected = read.tensors.expected or {}
    a_log_shape = expected.get(f"{dst}attn.A_log", (1, 1, kda.num_heads, 1))
    read.one(f"{dst}attn.A_log", [f"{src}self_attn.A_log"], shape=a_log_shape)
    read.one(f"{dst}attn.dt_bias", [f"{src}self_attn.dt_bias"])


def _dense(read: TensorReader, src: str, dst: str) -> None:
    for p in ("gate_proj", "up_proj", "down_proj"):
        read.one(f"{dst}mlp.{p}.kernel", [f"{src}mlp.{p}.weight", f"{src}block_sparse_moe.{p}.weight"], transpose=True)


def _moe(read: TensorReader, src: str, dst: str, cfg: ModelConfig) -> None:
    moe = cfg.moe
    block = next((f"{src}{b}." for b in ("block_sparse_moe", "mlp") if f"{src}{b}.gate.weight" in read.tensors),
                 f"{src}block_sparse_moe.")
    read.one(f"{dst}mlp.router.kernel", [block + "gate.weight"], transpose=True)
    read.one(f"{dst}mlp.router.selection_bias", [block + "gate.e_score_correction_bias"])
    gate_up, down = f"{dst}mlp.experts.gate_up_proj", f"{dst}mlp.experts.down_proj"
    if block + "experts.gate_up_proj" in read.tensors:  # fused [E, 2I, in] and [E, in, I]: to [E, in, out]
        for param, name in ((gate_up, "gate_up_proj"), (down, "down_proj")):
            read.one(param, [block + f"experts.{name}"])
            read.arrays[param] = contiguous(read.arrays[param].transpose(0, 2, 1))
    else:
        experts = range(moe.num_experts)
        read.stacked(gate_up, [[block + f"experts.{e}.w1.weight", block + f"experts.{e}.w3.weight"] for e in experts])
        read.stacked(down, [[block + f"experts.{e}.w2.weight"] for e in experts])
    shared = block + "shared_experts."
    if not moe.num_shared_experts:  # transformers builds them anyway, 0 wide: they add exactly 0
        read.tensors.ignore(*[n for n in read.tensors.names if n.startswith(shared) and 0 in read.tensors.shape(n)])
    else:
        if shared + "gate_up_proj.weight" in read.tensors:
            read.one(f"{dst}mlp.shared_experts.gate_up_proj", [shared + "gate_up_proj.weight"], transpose=True)
        else:
            param = f"{dst}mlp.shared_experts.gate_up_proj"
            read.stacked(param, [[shared + "gate_proj.weight", shared + "up_proj.weight"]])  # one "expert"
            read.arrays[param] = read.arrays[param][0]
        read.one(f"{dst}mlp.shared_experts.down_proj", [shared + "down_proj.weight"], transpose=True)
    if moe.latent_size is not None:
        read.one(f"{dst}mlp.latent_down_proj", [block + "routed_expert_down_proj.weight"], transpose=True)
        read.one(f"{dst}mlp.latent_up_proj", [block + "routed_expert_up_proj.weight"], transpose=True)
        if moe.latent_norm:
            read.one(f"{dst}mlp.latent_norm", [block + "routed_expert_norm.weight"])


def _attention_residual(read: TensorReader, src: str, dst: str, hidden: int) -> None:
    read.one(f"{dst}.norm", [f"{src}.norm.weight"])
    read.one(f"{dst}.query", [f"{src}.proj.weight"], shape=(hidden,))


def convert_tensors(cfg: ModelConfig, tensors: HFTensors) -> dict[str, np.ndarray]:
    prefix, lm_head = next(((p, h) for p, h in PREFIXES if p + "embed_tokens.weight" in tensors), PREFIXES[0])
    tensors.ignore_matching(r".*rotary_emb\.inv_freq")
    if prefix != PREFIXES[0][0]:  # the K3 wrapper: drop the vision tower and the projector
        tensors.ignore(*[n for n in tensors.names if not n.startswith("language_model.")])
    read = TensorReader(tensors)
    read.one("embed", [prefix + "embed_tokens.weight"])
    read.one("final_norm.weight", [prefix + "norm.weight"])
    if cfg.tie_word_embeddings:
        tensors.ignore(lm_head)
    else:
        read.one("lm_head", [lm_head], transpose=True)
    if cfg.attn_res_block_size is not None:
        _attention_residual(read, prefix + "output_attn_res", "residual.output_res", cfg.hidden_size)
    for i in range(cfg.num_layers):
        src, dst = f"{prefix}layers.{i}.", f"layers.{i}."
        read.one(f"{dst}input_norm.weight", [src + "input_layernorm.weight"])
        read.one(f"{dst}pre_mlp_norm.weight", [src + "post_attention_layernorm.weight"])
        (_mla if cfg.layer_types[i] == "mla" else _kda)(read, src, dst, cfg)
        if cfg.mlp_layer_types[i] == "moe":
            _moe(read, src, dst, cfg)
        else:
            _dense(read, src, dst)
        if cfg.attn_res_block_size is not None:
            _attention_residual(read, src + "self_attention_res", f"{dst}residual.attn_res", cfg.hidden_size)
            _attention_residual(read, src + "mlp_res", f"{dst}residual.mlp_res", cfg.hidden_size)
    return read.arrays


FAMILY = HFFamily(
    name="kimi",
    model_types=("kimi_linear", "kimi_k3"),
    architectures=("KimiLinearForCausalLM", "KimiK3ForConditionalGeneration"),
    model_config=model_config,
    convert_tensors=convert_tensors,
)
