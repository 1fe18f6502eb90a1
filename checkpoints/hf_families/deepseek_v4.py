"""The DeepSeek-V4 family: `deepseek_v4` (transformers 5.24.0's DeepseekV4ForCausalLM).

Config: DeepseekV4Config as saved (`layer_types`, `compress_rates`, `mlp_layer_types`, nested
`rope_parameters` {main, compress}) and its legacy forms (`compress_ratios` per layer, `num_hash_layers`,
`compress_rate_csa/hca`, `qk_rope_head_dim`, flat `rope_parameters`/`rope_scaling`). Tensors: the
upstream spelling transformers' save writes back (`layers.{i}.attn.wq_a`, `ffn.experts.{e}.w1`,
`hc_attn_fn`, `gate.tid2eid`, ... under `model.` or not, `head.weight`), transformers' own module
names (`self_attn.q_a_proj`, fused `mlp.experts.gate_up_proj`, `attn_hc.fn`, ...), and the MTP
modules `mtp.{k}.*` in the upstream spelling (transformers never loads those). Host only.
"""
from __future__ import annotations

import logging
import re

import numpy as np

from agentjax.config import HyperConnectionConfig, ModelConfig, MoEConfig
from agentjax.errors import ModelConfigError, TensorMismatchError
from checkpoints.hf_config import ConfigFields
from checkpoints.hf_families import HFFamily
from checkpoints.hf_families._reader import TensorReader
from checkpoints.hf_families._deepseek_v4_attention import attention_config, attention_tensors
from checkpoints.hf_tensors import HFTensors, contiguous

# transformers' DeepseekV4Config defaults (used when config.json leaves a field out)
DEFAULTS = dict(vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43,
                num_experts_per_tok=6, n_routed_experts=256, n_shared_experts=1, routed_scaling_factor=1.5,
                max_position_embeddings=1048576, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, swiglu_limit=10.0,
                num_hash_layers=3, rms_norm_eps=1e-6, num_nextn_predict_layers=1)
MLP_TYPES = {"hash_moe": "hash_moe", "moe": "moe"}
PREFIXES = ("", "model.")
logger = logging.getLogger(__name__)


def _mlp_layer_types(fields: ConfigFields, num_layers: int) -> tuple[str, ...]:
    """Explicit `mlp_layer_types`, else the first `num_hash_layers` (default 3) hash-routed."""
    if fields.has("mlp_layer_types"):
        return tuple(MLP_TYPES[t] for t in fields.string_list("mlp_layer_types", list(MLP_TYPES), num_layers))
    hashed = fields.integer("num_hash_layers", DEFAULTS["num_hash_layers"], minimum=0)
    return tuple("hash_moe" if i < hashed else "moe" for i in range(num_layers))


def model_config(fields: ConfigFields) -> ModelConfig:
    """A DeepseekV4Config (any of the forms transformers reads) as a ModelConfig."""
    fields.choice("hidden_act", ["silu"], default="silu")
    num_layers = fields.integer("num_hidden_layers", DEFAULTS["num_hidden_layers"])
    hidden = fields.integer("hidden_size", DEFAULTS["hidden_size"])
    inner = fields.integer("moe_intermediate_size", DEFAULTS["moe_intermediate_size"])
    if fields.integer("n_shared_experts", DEFAULTS["n_shared_experts"], minimum=0) != 1:
        raise fields.error("n_shared_experts", fields.raw["n_shared_experts"],
                           "1 (transformers builds exactly one shared expert of moe_intermediate_size)")
    mlp_types = _mlp_layer_types(fields, num_layers)
    if not fields.boolean("norm_topk_prob", True):
        logger.warning("%s: norm_topk_prob=false is ignored (as transformers does): DeepSeek-V4's routers always "
                       "renormalise the chosen experts' weights", fields.source)
    moe = MoEConfig(
        num_experts=fields.integer("n_routed_experts", fields.raw.get("num_local_experts") or DEFAULTS["n_routed_experts"]),
        num_experts_per_token=fields.integer("num_experts_per_tok", DEFAULTS["num_experts_per_tok"]),
        expert_intermediate_size=inner,
        num_shared_experts=1,
        shared_intermediate_size=inner,
        scoring=fields.choice("scoring_func", ["sqrtsoftplus", "sigmoid", "softmax"], default="sqrtsoftplus"),
        use_routing_bias=True,
        renormalize=True,  # transformers' DeepseekV4TopKRouter and HashRouter, whatever norm_topk_prob says
        routed_scaling_factor=fields.number("routed_scaling_factor", DEFAULTS["routed_scaling_factor"]),
        activation="clamped_swiglu",
        swiglu_limit=fields.number("swiglu_limit", DEFAULTS["swiglu_limit"]),
    )
    hyper = HyperConnectionConfig(
        num_streams=fields.integer("hc_mult", DEFAULTS["hc_mult"]),
        sinkhorn_iterations=fields.integer("hc_sinkhorn_iters", DEFAULTS["hc_sinkhorn_iters"]),
        eps=fields.number("hc_eps", DEFAULTS["hc_eps"], positive=False),
    )
    bos, eos = fields.token_ids("bos_token_id"), fields.token_ids("eos_token_id")
    return ModelConfig(
        architecture="deepseek_v4",
        vocab_size=fields.integer("vocab_size", DEFAULTS["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=inner,
        num_layers=num_layers,
        max_position_embeddings=fields.integer("max_position_embeddings", DEFAULTS["max_position_embeddings"]),
        rms_norm_eps=fields.number("rms_norm_eps", DEFAULTS["rms_norm_eps"]),
        mlp_layer_types=mlp_types,
        tie_word_embeddings=fields.boolean("tie_word_embeddings", False),
        hidden_activation="silu",
        hyper_connections=hyper,
        moe=moe,
        num_mtp_modules=fields.integer("num_nextn_predict_layers", DEFAULTS["num_nextn_predict_layers"], minimum=0),
        bos_token_id=bos[0] if bos else None,
        eos_token_ids=eos,
        **attention_config(fields, num_layers),
    )


def _hyper_connection(read: TensorReader, src: str, dst: str, upstream: str, hf: str) -> None:
    """One mHC mapping: `fn` [(2+N)N, N*D] -> [N*D, (2+N)N], `base`, `scale` (upstream `hc_{attn,ffn}_*`)."""
    read.one(f"{dst}.fn", [f"{src}{upstream}_fn", f"{src}{hf}.fn"], transpose=True)
    read.one(f"{dst}.base", [f"{src}{upstream}_base", f"{src}{hf}.base"])
    read.one(f"{dst}.scale", [f"{src}{upstream}_scale", f"{src}{hf}.scale"])


def _hash_table(read: TensorReader, src: str, dst: str, cfg: ModelConfig) -> None:
    table = read.one(f"{dst}mlp.hash_table", [f"{src}ffn.gate.tid2eid", f"{src}mlp.gate.tid2eid"])
    if table is None:
        return
    moe, want = cfg.moe, (cfg.vocab_size, cfg.moe.num_experts_per_token)
    if table.shape != want:
        return  # the loader's shape check names it
    if not (np.all(table == np.rint(table)) and table.min() >= 0 and table.max() < moe.num_experts):
        raise TensorMismatchError(f"{read.tensors.where}: {read.name([f'{src}ffn.gate.tid2eid', f'{src}mlp.gate.tid2eid'])}"
                                  f" holds {table.min()}..{table.max()}; expected expert ids in [0, {moe.num_experts})")
    read.arrays[f"{dst}mlp.hash_table"] = table.astype(np.int32)


def _moe(read: TensorReader, src: str, dst: str, cfg: ModelConfig, hashed: bool) -> None:
    read.one(f"{dst}mlp.router.kernel", [f"{src}ffn.gate.weight", f"{src}mlp.gate.weight"], transpose=True)
    if hashed:
        _hash_table(read, src, dst, cfg)
    else:
        read.one(f"{dst}mlp.router.selection_bias", [f"{src}ffn.gate.bias", f"{src}mlp.gate.e_score_correction_bias"])
    gate_up, down = f"{dst}mlp.experts.gate_up_proj", f"{dst}mlp.experts.down_proj"
    if read.name([f"{src}mlp.experts.gate_up_proj"]) is not None:  # fused [E, 2I, H] and [E, H, I]: to [E, in, out]
        for param, name in ((gate_up, "gate_up_proj"), (down, "down_proj")):
            read.arrays[param] = contiguous(read.one(param, [f"{src}mlp.experts.{name}"]).transpose(0, 2, 1))
    else:
        experts = range(cfg.moe.num_experts)
        read.stacked(gate_up, [[f"{src}ffn.experts.{e}.w1.weight", f"{src}ffn.experts.{e}.w3.weight"] for e in experts])
        read.stacked(down, [[f"{src}ffn.experts.{e}.w2.weight"] for e in experts])
    shared = f"{dst}mlp.shared_experts."
    spellings = {"gate": ("ffn.shared_experts.w1", "mlp.shared_experts.gate_proj"),
                 "up": ("ffn.shared_experts.w3", "mlp.shared_experts.up_proj"),
                 "down": ("ffn.shared_experts.w2", "mlp.shared_experts.down_proj")}
    for half in ("gate", "up"):
        read.one(f"{shared}{half}", [f"{src}{s}.weight" for s in spellings[half]], transpose=True)
    gate, up = (read.arrays.pop(f"{shared}{half}", None) for half in ("gate", "up"))
    if gate is not None and up is not None and gate.shape == up.shape:
        read.arrays[f"{shared}gate_up_proj"] = np.concatenate([gate, up], axis=1)
    read.tensors.origins[f"{shared}gate_up_proj"] = read.root + src + spellings["gate"][0] + ".weight"
    read.one(f"{shared}down_proj", [f"{src}{s}.weight" for s in spellings["down"]], transpose=True)


def _block(read: TensorReader, src: str, dst: str, cfg: ModelConfig, layer: int, hashed: bool) -> None:
    """One decoder block: norms, attention, MoE and its two hyper-connections."""
    read.one(f"{dst}input_norm.weight", [f"{src}attn_norm.weight", f"{src}input_layernorm.weight"])
    read.one(f"{dst}pre_mlp_norm.weight", [f"{src}ffn_norm.weight", f"{src}post_attention_layernorm.weight"])
    for param, (candidates, convert) in attention_tensors(cfg, layer).items():
        array = read.one(f"{dst}attn.{param}", [src + c for c in candidates])
        if array is not None and convert is not None:
            read.arrays[f"{dst}attn.{param}"] = convert(array)
    _moe(read, src, dst, cfg, hashed)
    _hyper_connection(read, src, f"{dst}residual.attn_hc", "hc_attn", "attn_hc")
    _hyper_connection(read, src, f"{dst}residual.ffn_hc", "hc_ffn", "ffn_hc")


def _hyper_head(read: TensorReader, src: str, dst: str) -> None:
    read.one(f"{dst}.fn", [f"{src}hc_head_fn", f"{src}hc_head.hc_fn"], transpose=True)
    read.one(f"{dst}.base", [f"{src}hc_head_base", f"{src}hc_head.hc_base"])
    read.one(f"{dst}.scale", [f"{src}hc_head_scale", f"{src}hc_head.hc_scale"])


def _mtp(read: TensorReader, cfg: ModelConfig, k: int) -> None:
    src, dst = f"mtp.{k}.", f"mtp.{k}."
    if not any(n.startswith((src, "model." + src)) for n in read.tensors.names):
        raise ModelConfigError(
            f"{read.tensors.where}/config.json: field 'num_nextn_predict_layers' is {cfg.num_mtp_modules} but the "
            f"checkpoint has no {src}* tensors (transformers drops the MTP module when it saves); set it to {k} "
            f"to load without MTP module {k}")
    root, read.root = read.root, "" if any(n.startswith(src) for n in read.tensors.names) else "model."
    for norm in ("enorm", "hnorm"):
        read.one(f"{dst}{norm}.weight", [f"{src}{norm}.weight"])
    read.one(f"{dst}final_norm.weight", [f"{src}norm.weight", f"{src}shared_head.norm.weight"])
    for proj in ("e_proj", "h_proj"):
        read.one(f"{dst}{proj}.kernel", [f"{src}{proj}.weight"], transpose=True)
    _hyper_head(read, src, f"{dst}hc_head")
    _block(read, src, f"{dst}block.", cfg, cfg.num_layers + k, hashed=False)
    read.tensors.ignore(*[read.root + src + n for n in ("emb.tok_emb.weight", "head.weight", "shared_head.head.weight")])
    read.root = root


def convert_tensors(cfg: ModelConfig, tensors: HFTensors) -> dict[str, np.ndarray]:
    root = next((p for p in PREFIXES if any(p + e in tensors for e in ("embed.weight", "embed_tokens.weight"))), "")
    tensors.ignore_matching(r".*rotary_emb\.\w*inv_freq")
    beyond = rf"(model\.)?mtp\.(\d+)\..*"
    extra = sorted({int(m.group(2)) for n in tensors.names if (m := re.fullmatch(beyond, n))
                    and int(m.group(2)) >= cfg.num_mtp_modules})
    for k in extra:  # MTP modules the config does not declare
        tensors.ignore_matching(rf"(model\.)?mtp\.{k}\..*")
    read = TensorReader(tensors, root)
    read.one("embed", ["embed.weight", "embed_tokens.weight"])
    read.one("final_norm.weight", ["norm.weight"])
    lm_heads = ["head.weight", "lm_head.weight"]
    if cfg.tie_word_embeddings:
        tensors.ignore(*[p + h for p in PREFIXES for h in lm_heads])
    else:
        read.root = ""  # transformers saves the head without the model prefix
        read.one("lm_head", lm_heads + [f"model.{h}" for h in lm_heads], transpose=True)
        read.root = root
    _hyper_head(read, "", "residual")
    for i in range(cfg.num_layers):
        _block(read, f"layers.{i}.", f"layers.{i}.", cfg, i, cfg.mlp_layer_types[i] == "hash_moe")
    for k in range(cfg.num_mtp_modules):
        _mtp(read, cfg, k)
    return read.arrays


FAMILY = HFFamily(
    name="deepseek_v4",
    model_types=("deepseek_v4",),
    architectures=("DeepseekV4ForCausalLM",),
    model_config=model_config,
    convert_tensors=convert_tensors,
)
