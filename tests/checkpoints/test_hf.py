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


@pytest.mark.slow
def test_directory_without_tokenizer_serves_token_ids(smollm2_hf_dir, tmp_path):
    from agentjax import LLM, SamplingParams
    from checkpoints.embedded import smollm2_path
    from checkpoints.tokenizer import Tokenizer

    source = smollm2_hf_dir[0]
    bare = tmp_path / "no-tokenizer"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).symlink_to(source / name)
    llm = LLM(str(bare), num_kv_blocks=64)
    assert llm.tokenizer is None
    tokenizer = Tokenizer.from_gguf(smollm2_path())
    out = llm.generate([tokenizer.encode("The capital of France is")], SamplingParams(max_tokens=4, temperature=0))[0]
    assert tokenizer.decode(out.token_ids).startswith(" Paris") and out.text == ""


def test_gemma3_directory_folds_the_norm_offset_into_the_model_shapes(tmp_path):
    from agentjax.models.params import expected_shapes

    config = {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 100,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 512,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"full_attention": {"rope_theta": 1e6, "rope_type": "default"},
                            "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}},
    }
    rng = np.random.default_rng(0)
    hidden, heads, kv_heads, head_dim, inter = 64, 4, 2, 16, 128
    tensors = {"model.embed_tokens.weight": rng.standard_normal((100, hidden), np.float32),
               "model.norm.weight": np.full(hidden, 0.5, np.float32)}
    for i in range(2):
        layer = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            tensors[layer + norm + ".weight"] = np.zeros(hidden, np.float32)
        tensors[layer + "self_attn.q_norm.weight"] = np.zeros(head_dim, np.float32)
        tensors[layer + "self_attn.k_norm.weight"] = np.zeros(head_dim, np.float32)
        for proj, rows in (("q_proj", heads * head_dim), ("k_proj", kv_heads * head_dim),
                           ("v_proj", kv_heads * head_dim)):
            tensors[layer + f"self_attn.{proj}.weight"] = rng.standard_normal((rows, hidden), np.float32)
        tensors[layer + "self_attn.o_proj.weight"] = rng.standard_normal((hidden, heads * head_dim), np.float32)
        for proj in ("gate_proj", "up_proj"):
            tensors[layer + f"mlp.{proj}.weight"] = rng.standard_normal((inter, hidden), np.float32)
        tensors[layer + "mlp.down_proj.weight"] = rng.standard_normal((hidden, inter), np.float32)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]  # tied: saved but not read
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))

    cfg, arrays, tokenizer = load_hf(tmp_path, expected_shapes)
    assert cfg.architecture == "gemma3" and tokenizer is None
    assert set(arrays) == set(expected_shapes(cfg))
    np.testing.assert_array_equal(arrays["final_norm.weight"], 1.5)
    np.testing.assert_array_equal(arrays["layers.1.post_mlp_norm.weight"], 1.0)
    np.testing.assert_array_equal(arrays["layers.0.attn.k_norm.weight"], 1.0)
    np.testing.assert_array_equal(arrays["layers.1.attn.k_proj.kernel"],
                                  tensors["model.layers.1.self_attn.k_proj.weight"].T)
