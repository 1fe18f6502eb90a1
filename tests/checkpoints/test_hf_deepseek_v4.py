"""The DeepSeek-V4 HF family (checkpoints/hf_families/deepseek_v4.py) on the fixtures: the config in its
saved and legacy forms, every tensor in both spellings (upstream names as transformers' save writes them,
and transformers' module names with fused experts), the MTP module, and errors that name the field or
tensor."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from agentjax.config import RopeScaling
from agentjax.errors import ModelConfigError, TensorMismatchError
from agentjax.models.params import expected_shapes
from checkpoints.hf import family_and_config, load_hf
from checkpoints.hf_tensors import HFTensors

DATA = Path(__file__).parents[1] / "models" / "data"
A, B = DATA / "deepseek-v4-a", DATA / "deepseek-v4-b"


def _copy(src: Path, dst: Path, *, config=None, tensors=None) -> Path:
    """`src` into `dst` with `config(dict)` and `tensors(dict)` applied (each edits in place)."""
    dst.mkdir()
    raw = json.loads((src / "config.json").read_text())
    if config:
        config(raw)
    (dst / "config.json").write_text(json.dumps(raw))
    if tensors:
        arrays = load_file(src / "model.safetensors")
        tensors(arrays)
        save_file(arrays, dst / "model.safetensors")
    else:
        shutil.copy(src / "model.safetensors", dst / "model.safetensors")
    return dst


def _converted(directory: Path) -> tuple[dict[str, np.ndarray], HFTensors]:
    family, cfg = family_and_config(directory)
    tensors = HFTensors.open(directory)
    return family.convert_tensors(cfg, tensors), tensors


# ---- config -------------------------------------------------------------------------------------------

def test_config_of_both_fixtures():
    _, a = family_and_config(A)
    assert a.architecture == "deepseek_v4" and a.layer_types == ("swa_mqa", "csa", "hca", "csa")
    assert a.mlp_layer_types == ("hash_moe", "moe", "moe", "moe") and a.num_mtp_modules == 1
    assert (a.num_heads, a.num_kv_heads, a.head_dim, a.rope_dim, a.sliding_window) == (4, 1, 32, 8, 16)
    attention = a.compressed_attention
    assert (attention.csa_rate, attention.hca_rate, attention.index_topk, attention.o_groups) == (4, 16, 8, 2)
    assert attention.compress_rope_scaling == RopeScaling(kind="yarn", factor=4.0, original_max_position_embeddings=256,
                                                          attention_factor=1.0)
    assert a.rope_theta == 10000.0 and attention.compress_rope_theta == 160000.0
    assert a.hyper_connections.num_streams == 4 and a.hyper_connections.sinkhorn_iterations == 20
    moe = a.moe
    assert (moe.scoring, moe.activation, moe.swiglu_limit, moe.routed_scaling_factor) == (
        "sqrtsoftplus", "clamped_swiglu", 10.0, 2.5)
    assert moe.use_routing_bias and moe.renormalize and moe.shared_size == moe.expert_intermediate_size == 16
    _, b = family_and_config(B)
    assert b.layer_types == ("hca", "hca", "csa", "hca", "csa") and b.mlp_layer_types[:3] == ("hash_moe",) * 2 + ("moe",)
    assert (b.compressed_attention.csa_rate, b.compressed_attention.hca_rate) == (8, 32)
    assert b.compressed_attention.compress_rope_scaling is None and b.hyper_connections.eps == 1e-4


def test_legacy_config_forms_give_the_same_model(tmp_path):
    def legacy(raw):
        ratios = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
        raw["compress_ratios"] = [ratios[t] for t in raw.pop("layer_types")] + [0]  # an MTP entry past the end
        rates = raw.pop("compress_rates")
        raw["compress_rate_csa"] = rates["compressed_sparse_attention"]
        raw["compress_rate_hca"] = rates["heavily_compressed_attention"]
        raw["num_hash_layers"] = raw.pop("mlp_layer_types").count("hash_moe")
        raw["qk_rope_head_dim"] = int(raw["head_dim"] * raw.pop("partial_rotary_factor"))
        compress = raw["rope_parameters"]["compress"]
        raw["rope_parameters"] = {k: compress[k] for k in ("rope_type", "factor", "original_max_position_embeddings",
                                                           "beta_fast", "beta_slow")}

    _, legacy_cfg = family_and_config(_copy(A, tmp_path / "deepseek-v4-a", config=legacy))
    assert legacy_cfg == family_and_config(A)[1]


@pytest.mark.parametrize("edit, field, words", [
    (lambda r: r.update(num_key_value_heads=2), "num_key_value_heads", "one K=V head"),
    (lambda r: r.update(o_groups=3), "o_groups", "divisor of num_attention_heads=4"),
    (lambda r: r.update(n_shared_experts=2), "n_shared_experts", "exactly one shared expert"),
    (lambda r: r.update(hidden_act="gelu"), "hidden_act", "'silu'"),
    (lambda r: r["layer_types"].__setitem__(1, "full_attention"), "layer_types", "compressed_sparse_attention"),
    (lambda r: r["rope_parameters"]["compress"].update(rope_type="llama3"), "rope_parameters.compress.rope_type",
     "'default' or 'yarn'"),
    (lambda r: r.update(quantization_config={"quant_method": "fp8", "weight_block_size": [128]}),
     "quantization_config.weight_block_size", "[rows, cols]"),
    (lambda r: r.update(scoring_func="relu"), "scoring_func", "'sqrtsoftplus'"),
])
def test_bad_config_fields_are_named(tmp_path, edit, field, words):
    directory = _copy(A, tmp_path / "bad", config=edit)
    with pytest.raises(ModelConfigError) as raised:
        family_and_config(directory)
    assert repr(field) in str(raised.value) and words in str(raised.value)


# ---- tensors ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("directory", [A, B])
def test_every_fixture_tensor_becomes_a_parameter(directory):
    arrays, tensors = _converted(directory)
    assert tensors.unread() == [] and set(tensors.taken) == set(tensors.names)
    hf = load_file(directory / "model.safetensors")
    cfg = family_and_config(directory)[1]
    groups, rank = cfg.compressed_attention.o_groups, cfg.compressed_attention.o_lora_rank
    wo_a = hf["model.layers.1.attn.wo_a.weight"]  # [groups * rank, in]: group g is rows g*rank..(g+1)*rank
    np.testing.assert_array_equal(arrays["layers.1.attn.o_a_proj.kernel"][1], wo_a[rank:2 * rank].T)
    assert arrays["layers.1.attn.o_a_proj.kernel"].shape[0] == groups
    np.testing.assert_array_equal(arrays["layers.0.mlp.hash_table"], hf["model.layers.0.ffn.gate.tid2eid"])
    assert arrays["layers.0.mlp.hash_table"].dtype == np.int32 and "layers.0.mlp.router.selection_bias" not in arrays
    np.testing.assert_array_equal(arrays["layers.2.residual.attn_hc.fn"], hf["model.layers.2.hc_attn_fn"].T)
    np.testing.assert_array_equal(arrays["residual.fn"], hf["model.hc_head.hc_fn"].T)
    np.testing.assert_array_equal(arrays["lm_head"], hf["head.weight"].T)
    experts = arrays["layers.2.mlp.experts.gate_up_proj"]
    np.testing.assert_array_equal(experts[3], np.concatenate([hf["model.layers.2.ffn.experts.3.w1.weight"].T,
                                                              hf["model.layers.2.ffn.experts.3.w3.weight"].T], axis=1))
    np.testing.assert_array_equal(arrays["mtp.0.h_proj.kernel"], hf["mtp.0.h_proj.weight"].T)
    np.testing.assert_array_equal(arrays["mtp.0.block.residual.ffn_hc.scale"], hf["mtp.0.hc_ffn_scale"])
    np.testing.assert_array_equal(arrays["mtp.0.final_norm.weight"], hf["mtp.0.norm.weight"])


# transformers' WeightRenaming for deepseek_v4 (its conversion_mapping), upstream -> module names, in order
# (the final norm `model.norm.weight` is already its module name)
TO_MODULE_NAMES = [
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^head\.weight", "lm_head.weight"), (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."), (r"\.hc_attn_(fn|base|scale)", r".attn_hc.\1"),
    (r"\.hc_ffn_(fn|base|scale)", r".ffn_hc.\1"), (r"\.attn_sink", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."), (r"(?<!^model)\.norm\.", ".kv_norm."), (r"\.ape", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."), (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."), (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."), (r"\.gate\.bias", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."), (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]


def _module_names(arrays: dict[str, np.ndarray]) -> None:
    """The main model's tensors as transformers' modules name them, experts fused as it fuses them."""
    for name in [n for n in arrays if not n.startswith("mtp.")]:
        new = name
        for pattern, repl in TO_MODULE_NAMES:
            new = re.sub(pattern, repl, new)
        arrays[new] = arrays.pop(name)
    layers = sorted({int(m.group(1)) for n in arrays if (m := re.match(r"model\.layers\.(\d+)\.mlp\.experts\.0\.", n))})
    for i in layers:
        prefix = f"model.layers.{i}.mlp.experts."
        count = len({n for n in arrays if n.startswith(prefix) and n.endswith(".w1.weight")})
        arrays[prefix + "gate_up_proj"] = np.stack([np.concatenate([arrays.pop(f"{prefix}{e}.w1.weight"),
                                                                    arrays.pop(f"{prefix}{e}.w3.weight")]) for e in range(count)])
        arrays[prefix + "down_proj"] = np.stack([arrays.pop(f"{prefix}{e}.w2.weight") for e in range(count)])
    arrays["model.hc_head.hc_fn"] = arrays.pop("model.hc_head.hc_fn")


def test_transformers_module_names_and_fused_experts_load_the_same_arrays(tmp_path):
    original, _ = _converted(A)
    renamed, tensors = _converted(_copy(A, tmp_path / "deepseek-v4-a", tensors=_module_names))
    assert "model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight" in tensors
    assert tensors.unread() == [] and set(renamed) == set(original)
    for name, array in original.items():
        np.testing.assert_array_equal(renamed[name], array, err_msg=name)


def test_a_hash_table_outside_the_experts_is_named(tmp_path):
    def corrupt(arrays):
        arrays["model.layers.0.ffn.gate.tid2eid"][5, 1] = 8  # 8 experts: ids 0..7

    directory = _copy(A, tmp_path / "bad", tensors=corrupt)
    with pytest.raises(TensorMismatchError, match=r"model\.layers\.0\.ffn\.gate\.tid2eid.*\[0, 8\)"):
        _converted(directory)


def test_missing_mtp_tensors_name_the_config_field_and_zero_mtp_layers_drop_them(tmp_path):
    def drop_mtp(arrays):
        for name in [n for n in arrays if n.startswith("mtp.")]:
            del arrays[name]

    directory = _copy(A, tmp_path / "no-mtp", tensors=drop_mtp)
    with pytest.raises(ModelConfigError, match="'num_nextn_predict_layers' is 1 but the checkpoint has no mtp.0"):
        _converted(directory)
    arrays, tensors = _converted(_copy(A, tmp_path / "zero", config=lambda r: r.update(num_nextn_predict_layers=0)))
    assert not any(n.startswith("mtp.") for n in arrays) and tensors.unread() == []


@pytest.mark.parametrize("directory", [A, B])
def test_the_loader_checks_every_parameter_of_the_model(directory):
    cfg, arrays, tokenizer = load_hf(directory, expected_shapes)
    assert tokenizer is None and set(arrays) == set(expected_shapes(cfg))


def test_a_missing_tensor_is_named_in_hf_terms(tmp_path):
    directory = _copy(A, tmp_path / "missing", tensors=lambda arrays: arrays.pop("model.layers.3.attn.indexer.wq_b.weight"))
    with pytest.raises(TensorMismatchError, match=r"model\.layers\.3\.attn\.indexer\.wq_b\.weight"):
        load_hf(directory, expected_shapes)
