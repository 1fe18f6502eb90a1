"""The Kimi HF family: kimi_linear and the kimi_k3 wrapper in every tensor spelling, and bad configs
and checkpoints named in their errors (all on the host, before any weight reaches a device)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from agentjax.errors import ModelConfigError, TensorMismatchError
from agentjax.models.params import expected_shapes
from agentjax.models.presets import PRESETS
from checkpoints.hf import load_hf

FIXTURE = Path(__file__).parents[1] / "models" / "data" / "kimi-linear-a"


def _random_arrays(cfg, seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in expected_shapes(cfg).items()}


def _k3_text_config(cfg) -> dict:
    """Kimi-K3's text_config fields for a tiny-kimi-k3 shaped ModelConfig."""
    mla, kda, moe = cfg.mla, cfg.kda, cfg.moe
    return {
        "model_type": "kimi_linear", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers, "intermediate_size": cfg.intermediate_size,
        "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "linear_attn_config": {
            "kda_layers": [i + 1 for i, t in enumerate(cfg.layer_types) if t == "kda"],
            "full_attn_layers": [i + 1 for i, t in enumerate(cfg.layer_types) if t == "mla"],
            "num_heads": kda.num_heads, "head_dim": kda.head_dim, "short_conv_kernel_size": kda.conv_kernel_size,
            "use_full_rank_gate": True, "gate_lower_bound": -5.0},
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_heads,
        "q_lora_rank": mla.q_lora_rank, "kv_lora_rank": mla.kv_lora_rank, "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim, "v_head_dim": mla.v_head_dim, "mla_use_nope": True,
        "mla_use_output_gate": True, "attn_res_block_size": cfg.attn_res_block_size,
        "num_experts": moe.num_experts, "num_experts_per_token": moe.num_experts_per_token,
        "num_shared_experts": moe.num_shared_experts, "moe_intermediate_size": moe.expert_intermediate_size,
        "routed_expert_hidden_size": moe.latent_size, "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid", "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
        "topk_method": "noaux_tc", "moe_renormalize": True, "routed_scaling_factor": 1.0, "hidden_act": "situ",
        "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0, "num_nextn_predict_layers": 0,
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": False,
    }


def _k3_tensors(cfg, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """agentjax arrays under the K3 wrapper's names: language_model.*, `mlp.` MoE blocks with
    per-expert w1/w2/w3, A_log as [H], AttnRes pseudo-queries as [1, d] projections."""
    out = {"vision_tower.patch_embed.weight": np.zeros((4, 4), np.float32)}  # dropped by the loader
    lm = "language_model.model."
    inner, shared = cfg.moe.expert_intermediate_size, cfg.moe.shared_size
    for name, value in arrays.items():
        parts = name.split(".")
        if name == "embed":
            out[lm + "embed_tokens.weight"] = value
        elif name == "final_norm.weight":
            out[lm + "norm.weight"] = value
        elif name == "lm_head":
            out["language_model.lm_head.weight"] = value.T
        elif name.startswith("residual.output_res."):
            out[lm + "output_attn_res." + ("norm.weight" if parts[-1] == "norm" else "proj.weight")] = (
                value if parts[-1] == "norm" else value[None])
        else:
            layer, rest = f"{lm}layers.{parts[1]}.", ".".join(parts[2:])
            if rest in ("input_norm.weight", "pre_mlp_norm.weight"):
                out[layer + {"input_norm.weight": "input_layernorm.weight",
                             "pre_mlp_norm.weight": "post_attention_layernorm.weight"}[rest]] = value
            elif rest.startswith("residual."):
                which = {"attn_res": "self_attention_res", "mlp_res": "mlp_res"}[parts[3]]
                out[layer + which + (".norm.weight" if parts[4] == "norm" else ".proj.weight")] = (
                    value if parts[4] == "norm" else value[None])
            elif rest.startswith("attn."):
                base = layer + "self_attn." + parts[3]
                if rest.endswith(".kernel"):
                    out[base + ".weight"] = value.T
                elif parts[3] == "A_log":
                    out[base] = value.reshape(-1)
                else:
                    out[base + ("" if parts[3] == "dt_bias" else ".weight")] = value
            elif rest.endswith(("gate_proj.kernel", "up_proj.kernel", "down_proj.kernel")) and "experts" not in rest:
                out[layer + "mlp." + parts[3] + ".weight"] = value.T
            else:
                moe = layer + "mlp."
                if rest == "mlp.router.kernel":
                    out[moe + "gate.weight"] = value.T
                elif rest == "mlp.router.selection_bias":
                    out[moe + "gate.e_score_correction_bias"] = value
                elif rest == "mlp.experts.gate_up_proj":
                    for e, kernel in enumerate(value):
                        out[moe + f"experts.{e}.w1.weight"] = kernel[:, :inner].T
                        out[moe + f"experts.{e}.w3.weight"] = kernel[:, inner:].T
                elif rest == "mlp.experts.down_proj":
                    for e, kernel in enumerate(value):
                        out[moe + f"experts.{e}.w2.weight"] = kernel.T
                elif rest == "mlp.shared_experts.gate_up_proj":
                    out[moe + "shared_experts.gate_proj.weight"] = value[:, :shared].T
                    out[moe + "shared_experts.up_proj.weight"] = value[:, shared:].T
                elif rest == "mlp.shared_experts.down_proj":
                    out[moe + "shared_experts.down_proj.weight"] = value.T
                else:
                    hf = {"mlp.latent_down_proj": "routed_expert_down_proj",
                          "mlp.latent_up_proj": "routed_expert_up_proj", "mlp.latent_norm": "routed_expert_norm"}[rest]
                    out[moe + hf + ".weight"] = value if rest == "mlp.latent_norm" else value.T
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def test_kimi_k3_wrapper_loads_every_parameter_by_its_k3_name(tmp_path):
    cfg = PRESETS["tiny-kimi-k3"].replace(vocab_size=512)
    arrays = _random_arrays(cfg)
    config = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "bos_token_id": 1,
              "eos_token_id": 2, "text_config": _k3_text_config(cfg), "vision_config": {}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(_k3_tensors(cfg, arrays), str(tmp_path / "model.safetensors"))
    loaded_cfg, loaded, tokenizer = load_hf(tmp_path, expected_shapes)
    assert tokenizer is None
    assert loaded_cfg.replace(name=cfg.name) == cfg
    assert sorted(loaded) == sorted(arrays)
    assert all(np.array_equal(loaded[name], arrays[name]) for name in arrays)


def _fixture_copy(tmp_path: Path, config_changes=None, tensors=None) -> Path:
    config = json.loads((FIXTURE / "config.json").read_text())
    config.update(config_changes or {})
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    if tensors is None:
        shutil.copy(FIXTURE / "model.safetensors", tmp_path / "model.safetensors")
    else:
        save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_fused_experts_and_mlp_spelling_load_like_the_saved_spelling(tmp_path):
    """transformers' runtime layout (experts fused as [E, 2I, H] gate_up / [E, H, I] down) and real
    checkpoints' `mlp.*` dense layers give the same parameters as the saved per-expert spelling."""
    saved = load_file(FIXTURE / "model.safetensors")
    fused = {}
    for name, value in saved.items():
        if ".experts." in name:
            continue
        fused[name.replace("block_sparse_moe.gate_proj", "mlp.gate_proj").replace(
            "block_sparse_moe.up_proj", "mlp.up_proj").replace("block_sparse_moe.down_proj", "mlp.down_proj")] = value
    for i in (1, 2, 3):
        block = f"model.layers.{i}.block_sparse_moe.experts."
        fused[block + "gate_up_proj"] = np.stack(
            [np.concatenate([saved[f"{block}{e}.w1.weight"], saved[f"{block}{e}.w3.weight"]]) for e in range(8)])
        fused[block + "down_proj"] = np.stack([saved[f"{block}{e}.w2.weight"] for e in range(8)])
    assert "model.layers.0.mlp.gate_proj.weight" in fused
    _, reference, _ = load_hf(FIXTURE, expected_shapes)
    _, loaded, _ = load_hf(_fixture_copy(tmp_path, tensors=fused), expected_shapes)
    assert sorted(loaded) == sorted(reference)
    assert all(np.array_equal(loaded[name], reference[name]) for name in reference)


@pytest.mark.parametrize("changes, named", [
    ({"num_key_value_heads": 1}, "num_key_value_heads"),
    ({"layer_types": None, "linear_attn_config": {"kda_layers": [1, 2], "full_attn_layers": [4], "num_heads": 2,
                                                  "head_dim": 32, "short_conv_kernel_size": 4}}, "kda_layers"),
    ({"linear_attn_config": {"num_heads": 2, "head_dim": 32, "short_conv_kernel_size": 4, "gate_lower_bound": 1.0}},
     "gate_lower_bound"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
    ({"mla_use_nope": False}, "mla_use_nope"),
    ({"quantization_config": {"quant_method": "compressed-tensors"}}, "quantization_config.format"),
    ({"num_experts": "eight"}, "num_experts"),
], ids=["kv-heads", "uncovered-layer", "positive-gate-bound", "activation", "softmax-router", "rope-mla",
        "quantized", "non-integer"])
def test_bad_config_fields_are_named(tmp_path, changes, named):
    with pytest.raises(ModelConfigError, match=named):
        load_hf(_fixture_copy(tmp_path, changes), expected_shapes)


def test_a_missing_expert_tensor_is_named(tmp_path):
    tensors = load_file(FIXTURE / "model.safetensors")
    del tensors["model.layers.2.block_sparse_moe.experts.5.w3.weight"]
    with pytest.raises(TensorMismatchError, match=r"experts\.5\.w3"):
        load_hf(_fixture_copy(tmp_path, tensors=tensors), expected_shapes)


def test_a_missing_mla_tensor_is_named_in_hf_terms(tmp_path):
    tensors = load_file(FIXTURE / "model.safetensors")
    del tensors["model.layers.3.self_attn.kv_b_proj.weight"]
    with pytest.raises(TensorMismatchError, match=r"model\.layers\.3\.self_attn\.kv_b_proj\.weight"):
        load_hf(_fixture_copy(tmp_path, tensors=tensors), expected_shapes)
