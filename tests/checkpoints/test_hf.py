"""HF directories load into the same model as the GGUF file they were written from."""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from agentjax.errors import ModelLoadError, UnsupportedModelError
from checkpoints.gguf import load_gguf
from checkpoints.hf import load_hf


def _write_hf_dir(directory, cfg, arrays, tokenizer):
    """An HF-layout checkpoint of a llama GGUF model (what transformers would save)."""
    tensors = {"model.embed_tokens.weight": arrays["embed"], "model.norm.weight": arrays["final_norm.weight"]}
    hf_names = {
        "input_norm.weight": "input_layernorm.weight",
        "pre_mlp_norm.weight": "post_attention_layernorm.weight",
        "attn.q_proj.kernel": "self_attn.q_proj.weight",
        "attn.k_proj.kernel": "self_attn.k_proj.weight",
        "attn.v_proj.kernel": "self_attn.v_proj.weight",
        "attn.o_proj.kernel": "self_attn.o_proj.weight",
        "mlp.gate_proj.kernel": "mlp.gate_proj.weight",
        "mlp.up_proj.kernel": "mlp.up_proj.weight",
        "mlp.down_proj.kernel": "mlp.down_proj.weight",
    }
    for i in range(cfg.num_layers):
        for ours, theirs in hf_names.items():
            value = arrays[f"layers.{i}.{ours}"]
            tensors[f"model.layers.{i}.{theirs}"] = np.ascontiguousarray(value.T if ours.endswith("kernel") else value)
    save_file(tensors, str(directory / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": True,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids),
    }
    (directory / "config.json").write_text(json.dumps(config))
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": tokenizer.chat_template.source}))


@pytest.fixture(scope="module")
def smollm2_hf_dir(tmp_path_factory):
    from checkpoints.embedded import smollm2_path
    from checkpoints.tokenizer import Tokenizer

    cfg, arrays, _ = load_gguf(smollm2_path())
    directory = tmp_path_factory.mktemp("smollm2-hf")
    _write_hf_dir(directory, cfg, arrays, Tokenizer.from_gguf(smollm2_path()))
    return directory, cfg, arrays


def test_hf_directory_gives_the_gguf_parameters(smollm2_hf_dir):
    directory, cfg, arrays = smollm2_hf_dir
    hf_cfg, hf_arrays, tokenizer = load_hf(directory)
    assert hf_cfg.replace(name=cfg.name) == cfg
    assert hf_arrays.keys() == arrays.keys()
    for name, value in arrays.items():
        np.testing.assert_array_equal(hf_arrays[name], value)
    assert tokenizer.encode("Hello world") == [19556, 905]


def test_llm_generates_from_hf_directory(smollm2_hf_dir):
    from agentjax import LLM, SamplingParams

    llm = LLM(str(smollm2_hf_dir[0]))
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=6, temperature=0))[0]
    assert "Paris" in out.text


def test_unsupported_hf_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"]}))
    with pytest.raises(UnsupportedModelError, match="MambaForCausalLM"):
        load_hf(tmp_path)


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_hf(tmp_path)
