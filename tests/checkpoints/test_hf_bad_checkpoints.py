"""Bad HF directories fail with an error that names the problem, before any weight reaches the device.

Each test writes a tiny llama checkpoint (numpy + safetensors, as transformers lays it out), breaks
one thing, and loads it through `load_model`, the path `LLM(model=dir)` takes.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

import agentjax.models
from agentjax.errors import (
    CorruptCheckpointError,
    InvalidRequestError,
    ModelConfigError,
    ModelLoadError,
    TensorMismatchError,
    UnsupportedModelError,
)
from agentjax.models import load_model

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, VOCAB, LAYERS = 32, 64, 4, 2, 8, 96, 2


def tiny_llama_config(**changes):
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
        "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "hidden_act": "silu",
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
    }
    config.update(changes)
    return config


def tiny_llama_tensors(seed=0):
    """HF names and [out, in] layouts, as `LlamaForCausalLM.save_pretrained` writes them."""
    rng = np.random.default_rng(seed)

    def randn(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    tensors = {"model.embed_tokens.weight": randn(VOCAB, HIDDEN), "model.norm.weight": np.ones(HIDDEN, np.float32)}
    for i in range(LAYERS):
        layer = f"model.layers.{i}."
        tensors.update({
            layer + "input_layernorm.weight": np.ones(HIDDEN, np.float32),
            layer + "post_attention_layernorm.weight": np.ones(HIDDEN, np.float32),
            layer + "self_attn.q_proj.weight": randn(HEADS * HEAD_DIM, HIDDEN),
            layer + "self_attn.k_proj.weight": randn(KV_HEADS * HEAD_DIM, HIDDEN),
            layer + "self_attn.v_proj.weight": randn(KV_HEADS * HEAD_DIM, HIDDEN),
            layer + "self_attn.o_proj.weight": randn(HIDDEN, HEADS * HEAD_DIM),
            layer + "mlp.gate_proj.weight": randn(INTERMEDIATE, HIDDEN),
            layer + "mlp.up_proj.weight": randn(INTERMEDIATE, HIDDEN),
            layer + "mlp.down_proj.weight": randn(HIDDEN, INTERMEDIATE),
        })
    return tensors


def write_dir(directory, config=None, tensors=None):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config or tiny_llama_config()))
    save_file(tensors if tensors is not None else tiny_llama_tensors(), str(directory / "model.safetensors"))
    return directory


@pytest.fixture
def no_device_placement(monkeypatch):
    """Fails the test if the loader gets as far as building device parameters."""
    calls = []
    monkeypatch.setattr(agentjax.models, "params_from_arrays", lambda *args: calls.append(args))
    yield
    assert not calls, "the loader placed weights before it found the problem"


def test_good_tiny_directory_loads(tmp_path):
    cfg, params, tokenizer = load_model(str(write_dir(tmp_path / "m")))
    assert (cfg.architecture, cfg.num_layers, cfg.num_kv_heads, cfg.tie_word_embeddings) == ("llama", 2, 2, True)
    assert tokenizer is None


def test_unknown_model_type_is_named_with_the_supported_ones(tmp_path, no_device_placement):
    directory = write_dir(tmp_path / "m", tiny_llama_config(model_type="mamba", architectures=["MambaForCausalLM"]))
    with pytest.raises(UnsupportedModelError, match=r"model_type 'mamba'.*supported: .*gemma3_text.*llama"):
        load_model(str(directory))


def test_unknown_architecture_of_a_known_model_type_is_named(tmp_path, no_device_placement):
    directory = write_dir(tmp_path / "m", tiny_llama_config(architectures=["LlamaForSequenceClassification"]))
    with pytest.raises(UnsupportedModelError, match=r"LlamaForSequenceClassification.*LlamaForCausalLM"):
        load_model(str(directory))


def test_missing_config_field_is_named(tmp_path, no_device_placement):
    config = tiny_llama_config()
    del config["num_hidden_layers"]
    with pytest.raises(ModelConfigError, match=r"'num_hidden_layers' is missing; expected an integer >= 1"):
        load_model(str(write_dir(tmp_path / "m", config)))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": "32"}, r"'hidden_size' is '32'; expected an integer >= 1"),
        ({"num_attention_heads": 0}, r"'num_attention_heads' is 0; expected an integer >= 1"),
        ({"num_key_value_heads": 3}, r"'num_key_value_heads' is 3; expected a divisor of num_attention_heads=4"),
        ({"hidden_act": "gelu"}, r"'hidden_act' is 'gelu'; expected one of 'silu'"),
        ({"rms_norm_eps": -1}, r"'rms_norm_eps' is -1; expected a number > 0"),
        ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0}},
         r"'rope_parameters.rope_type' is 'longrope'; expected one of 'default', 'linear', 'llama3', 'yarn'"),
        ({"attention_bias": True}, r"'attention_bias' is True; expected false"),
    ],
)
def test_invalid_config_field_is_named_with_what_is_allowed(tmp_path, no_device_placement, change, message):
    with pytest.raises(ModelConfigError, match=message):
        load_model(str(write_dir(tmp_path / "m", tiny_llama_config(**change))))


def test_missing_tensor_is_named_by_its_hf_name(tmp_path, no_device_placement):
    tensors = tiny_llama_tensors()
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(TensorMismatchError, match=r"1 missing: layers\.1\.attn\.k_proj\.kernel "
                                                  r"\(HF tensor model\.layers\.1\.self_attn\.k_proj\.weight\)"):
        load_model(str(write_dir(tmp_path / "m", tensors=tensors)))


def test_untied_config_without_lm_head_names_the_head(tmp_path, no_device_placement):
    directory = write_dir(tmp_path / "m", tiny_llama_config(tie_word_embeddings=False))
    with pytest.raises(TensorMismatchError, match=r"missing: lm_head \(HF tensor lm_head\.weight\)"):
        load_model(str(directory))


def test_wrongly_shaped_tensor_is_named_with_both_shapes(tmp_path, no_device_placement):
    tensors = tiny_llama_tensors()
    tensors["model.layers.0.mlp.up_proj.weight"] = np.zeros((INTERMEDIATE + 1, HIDDEN), np.float32)
    with pytest.raises(TensorMismatchError,
                       match=r"layers\.0\.mlp\.up_proj\.kernel \(from HF tensor model\.layers\.0\.mlp\.up_proj\.weight "
                             r"of shape \(65, 32\)\) has shape \(32, 65\), expected \(32, 64\)"):
        load_model(str(write_dir(tmp_path / "m", tensors=tensors)))


def test_unexpected_tensors_are_named(tmp_path, no_device_placement):
    tensors = tiny_llama_tensors()
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(HEADS * HEAD_DIM, np.float32)
    with pytest.raises(TensorMismatchError, match=r"1 unexpected: model\.layers\.0\.self_attn\.q_proj\.bias"):
        load_model(str(write_dir(tmp_path / "m", tensors=tensors)))


def test_every_problem_is_reported_at_once(tmp_path, no_device_placement):
    tensors = tiny_llama_tensors()
    tensors["model.layers.0.self_attn.query.weight"] = tensors.pop("model.layers.0.self_attn.q_proj.weight")
    with pytest.raises(TensorMismatchError, match=r"1 missing: .*q_proj.*; 1 unexpected: .*self_attn\.query\.weight"):
        load_model(str(write_dir(tmp_path / "m", tensors=tensors)))


def test_truncated_safetensors_file_is_named(tmp_path, no_device_placement):
    directory = write_dir(tmp_path / "m")
    path = directory / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors is truncated or corrupt: tensor "):
        load_model(str(directory))


def test_file_cut_inside_its_header_is_named(tmp_path, no_device_placement):
    directory = write_dir(tmp_path / "m")
    path = directory / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors is truncated or corrupt: its header claims"):
        load_model(str(directory))


def test_garbled_header_is_named(tmp_path, no_device_placement):
    directory = write_dir(tmp_path / "m")
    path = directory / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:24] = b"\xff" * 16
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError,
                       match=r"model\.safetensors is truncated or corrupt: its header is not valid JSON"):
        load_model(str(directory))


def write_two_shards(directory, tensors):
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(tiny_llama_config()))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:10], "model-00002-of-00002.safetensors": names[10:]}
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(directory / file))
    weight_map = {n: file for file, shard_names in shards.items() for n in shard_names}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory


def test_sharded_directory_loads_through_its_index(tmp_path):
    cfg, _, _ = load_model(str(write_two_shards(tmp_path / "m", tiny_llama_tensors())))
    assert cfg.num_layers == LAYERS


def test_index_naming_an_absent_shard_is_named(tmp_path, no_device_placement):
    directory = write_two_shards(tmp_path / "m", tiny_llama_tensors())
    (directory / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"lacks: model-00002-of-00002\.safetensors"):
        load_model(str(directory))


def test_directory_without_tokenizer_generates_from_token_ids(tmp_path):
    from agentjax import LLM, SamplingParams

    llm = LLM(str(write_dir(tmp_path / "m")), num_kv_blocks=32, block_size=4)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first, second = llm.generate([[1, 5, 9, 13], [1, 5, 9, 13, 40]], greedy)
    assert len(first.token_ids) == 6 and all(0 <= t < VOCAB for t in first.token_ids)
    assert first.text == "" and first.prompt_token_ids == [1, 5, 9, 13]
    assert llm.generate([[1, 5, 9, 13]], greedy)[0].token_ids == first.token_ids  # deterministic
    assert len(second.token_ids) == 6
    with pytest.raises(InvalidRequestError, match="has none .*give prompts as lists of token ids"):
        llm.generate(["a text prompt"], greedy)
