"""The MiniMax-M3 HF family (checkpoints/hf_families/minimax_m3.py) on the fixtures: both tensor
spellings and config forms give the same model, the MTP module's tensors load into parameters,
and malformed checkpoints fail with errors that name the tensor or field."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from agentjax.errors import ModelConfigError, TensorMismatchError
from agentjax.models.params import expected_shapes
from checkpoints.hf import family_and_config, load_hf

DATA = Path(__file__).parents[1] / "models" / "data"
A, B = DATA / "minimax-m3-a", DATA / "minimax-m3-b"


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


def _load(directory: Path):
    return load_hf(directory, expected_shapes)


def test_mtp_tensors_load_into_parameters_with_gemma_norms_folded():
    for directory, prefix in ((A, "language_model.model."), (B, "model.")):
        _, arrays, tokenizer = _load(directory)
        hf = load_file(directory / "model.safetensors")
        mtp = prefix + "mtp.layers.0."
        assert tokenizer is None
        np.testing.assert_array_equal(arrays["mtp.0.eh_proj.kernel"], hf[mtp + "eh_proj.weight"].T)
        np.testing.assert_array_equal(arrays["mtp.0.enorm.weight"], hf[mtp + "enorm.weight"] + 1)
        np.testing.assert_array_equal(arrays["mtp.0.final_norm.weight"], hf[mtp + "final_layernorm.weight"] + 1)
        experts = arrays["mtp.0.block.mlp.experts.gate_up_proj"]
        layer = mtp + "transformer_layer.block_sparse_moe."
        np.testing.assert_array_equal(experts[3], np.concatenate([hf[layer + "experts.3.w1.weight"].T,
                                                                  hf[layer + "experts.3.w3.weight"].T], axis=1))
        np.testing.assert_array_equal(arrays["mtp.0.block.mlp.router.selection_bias"],
                                      hf[layer + "e_score_correction_bias"])
        np.testing.assert_array_equal(arrays["mtp.0.block.attn.index_q_proj.kernel"],
                                      hf[mtp + "transformer_layer.self_attn.index_q_proj.weight"].T)


def _to_original_spelling(arrays: dict) -> None:
    """Fixture b's native names (fused experts, gate_up, indexer.*) in the wrapper's original spelling."""
    for name in [n for n in arrays if n.startswith("model.layers.")]:
        value = arrays.pop(name)
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name.replace("mlp.experts.gate_up_proj", "block_sparse_moe.experts.")
            inner = value.shape[1] // 2
            for e in range(value.shape[0]):
                arrays[f"{base}{e}.w1.weight"], arrays[f"{base}{e}.w3.weight"] = value[e, :inner], value[e, inner:]
        elif name.endswith("mlp.experts.down_proj"):
            base = name.replace("mlp.experts.down_proj", "block_sparse_moe.experts.")
            for e in range(value.shape[0]):
                arrays[f"{base}{e}.w2.weight"] = value[e]
        elif ".mlp.shared_experts.gate_up_proj.weight" in name:
            half = value.shape[0] // 2
            base = name.replace("mlp.shared_experts.gate_up_proj.weight", "block_sparse_moe.shared_experts.")
            arrays[base + "gate_proj.weight"], arrays[base + "up_proj.weight"] = value[:half], value[half:]
        elif ".mlp.gate_up_proj.weight" in name:
            half = value.shape[0] // 2
            arrays[name.replace("gate_up_proj", "gate_proj")] = value[:half]
            arrays[name.replace("gate_up_proj", "up_proj")] = value[half:]
        else:
            name = (name.replace(".mlp.gate.e_score_correction_bias", ".block_sparse_moe.e_score_correction_bias")
                    .replace(".mlp.gate.weight", ".block_sparse_moe.gate.weight")
                    .replace(".mlp.shared_experts.", ".block_sparse_moe.shared_experts.")
                    .replace(".self_attn.indexer.", ".self_attn.index_"))
            arrays[name] = value


def test_both_tensor_spellings_give_the_same_parameters(tmp_path):
    original = _copy(B, tmp_path / "original", tensors=_to_original_spelling)
    assert "model.layers.2.block_sparse_moe.experts.7.w2.weight" in load_file(original / "model.safetensors")
    _, native_arrays, _ = _load(B)
    _, original_arrays, _ = _load(original)
    assert native_arrays.keys() == original_arrays.keys()
    for name, value in native_arrays.items():
        np.testing.assert_array_equal(original_arrays[name], value, err_msg=name)


def test_legacy_config_keys_give_the_same_model(tmp_path):
    def legacy(raw):
        text = raw["text_config"]
        text["sparse_attention_config"] = {
            "sparse_num_index_heads": text.pop("index_n_heads"), "sparse_index_dim": text.pop("index_head_dim"),
            "sparse_block_size": text.pop("index_block_size"), "sparse_topk_blocks": text.pop("index_topk_blocks"),
            "sparse_local_block": text.pop("index_local_blocks"), "sparse_init_block": 0,
            "sparse_attention_freq": [0 if t == "full_attention" else 1 for t in text.pop("layer_types")]}
        text["moe_layer_freq"] = [0 if t == "dense" else 1 for t in text.pop("mlp_layer_types")]
        text["hidden_act"] = "swigluoai"

    _, cfg = family_and_config(A)
    _, legacy_cfg = family_and_config(_copy(A, tmp_path / "legacy", config=legacy))
    assert legacy_cfg.replace(name=cfg.name) == cfg
    assert cfg.layer_types[1:] == ("block_sparse_attention",) * 3 and cfg.mlp_layer_types[0] == "dense"


def test_missing_mtp_tensor_is_named(tmp_path):
    directory = _copy(B, tmp_path / "m", tensors=lambda t: t.pop("model.mtp.layers.0.eh_proj.weight"))
    message = r"1 missing: mtp\.0\.eh_proj\.kernel \(HF tensor model\.mtp\.layers\.0\.eh_proj\.weight\)"
    with pytest.raises(TensorMismatchError, match=message):
        _load(directory)


def test_misshapen_mtp_expert_is_named(tmp_path):
    name = "model.mtp.layers.0.transformer_layer.block_sparse_moe.experts.5.w3.weight"

    def shrink(tensors):
        tensors[name] = tensors[name][:-1]

    with pytest.raises(TensorMismatchError, match=rf"{name.replace('.', '[.]')}.*shape \(31, 64\).*\(32, 64\)"):
        _load(_copy(B, tmp_path / "m", tensors=shrink))


def test_misshapen_fused_gate_up_is_named(tmp_path):
    name = "model.layers.0.mlp.gate_up_proj.weight"

    def shrink(tensors):
        tensors[name] = tensors[name][:-2]

    with pytest.raises(TensorMismatchError, match=rf"{name.replace('.', '[.]')}.*\(190, 64\).*\(192, 64\)"):
        _load(_copy(B, tmp_path / "m", tensors=shrink))


def test_mtp_modules_the_config_does_not_declare_are_ignored(tmp_path):
    def no_mtp(raw):
        raw["num_mtp_modules"] = 0

    cfg, arrays, _ = _load(_copy(B, tmp_path / "m", config=no_mtp))
    assert cfg.num_mtp_modules == 0 and not any(n.startswith("mtp.") for n in arrays)


@pytest.mark.parametrize("change,field", [
    (lambda raw: raw.pop("text_config"), "text_config"),
    (lambda raw: raw["text_config"].update(index_topk_blocks=0), "text_config.index_topk_blocks"),
    (lambda raw: raw["text_config"].update(layer_types=["full_attention"] * 3), "text_config.layer_types"),
    (lambda raw: raw["text_config"].update(swiglu_beta=2.0), "text_config.swiglu_beta"),
    (lambda raw: raw["text_config"]["rope_parameters"].update(partial_rotary_factor=0.3),
     "text_config.rope_parameters"),
])
def test_invalid_config_fields_are_named(tmp_path, change, field):
    with pytest.raises(ModelConfigError, match=rf"field '{field.replace('.', '[.]')}'"):
        family_and_config(_copy(A, tmp_path / "c", config=change))
