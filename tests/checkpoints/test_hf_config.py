"""config.json fields are read as transformers writes them, and a bad field is named."""
from __future__ import annotations

import pytest

from agentjax.errors import ModelConfigError, UnsupportedModelError
from checkpoints.hf_config import ConfigFields, rope_settings
from checkpoints.hf_families import family_for, registered_families

# Gemma3TextConfig(...).to_dict() under transformers 5.24 (rope_parameters keyed by layer type)
GEMMA3_TEXT = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 100,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-06, "bos_token_id": 2, "eos_token_id": [1, 106],
    "query_pre_attn_scalar": 256, "sliding_window": 512, "final_logit_softcapping": None,
    "attn_logit_softcapping": None, "tie_word_embeddings": True, "use_bidirectional_attention": False,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    "rope_parameters": {
        "full_attention": {"rope_theta": 1000000.0, "rope_type": "linear", "factor": 8.0},
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
    },
}


def test_families_are_found_by_model_type_then_architectures():
    names = {f.name for f in registered_families()}
    assert {"llama", "gemma3"} <= names
    assert family_for({"model_type": "gemma3_text"}).name == "gemma3"
    assert family_for({"architectures": ["LlamaForCausalLM"]}).name == "llama"
    with pytest.raises(UnsupportedModelError, match=r"unsupported architectures \['MambaForCausalLM'\]"):
        family_for({"architectures": ["MambaForCausalLM"]})


def test_gemma3_config_reads_per_layer_type_rope_parameters():
    cfg = family_for(GEMMA3_TEXT).model_config(ConfigFields(GEMMA3_TEXT))
    assert cfg.architecture == "gemma3"
    assert cfg.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert (cfg.rope_theta, cfg.rope_scaling.kind, cfg.rope_scaling.factor) == (1e6, "linear", 8.0)
    assert (cfg.local_rope_theta, cfg.layer_rope_scaling(0)) == (10_000.0, None)
    assert cfg.eos_token_ids == (1, 106) and cfg.sliding_window == 512
    assert cfg.query_scale == 256 ** -0.5 and cfg.embedding_multiplier == 8.0


def test_gemma3_config_of_older_transformers_uses_rope_local_base_freq():
    old = {k: v for k, v in GEMMA3_TEXT.items() if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=1e6, rope_local_base_freq=10_000.0, sliding_window_pattern=3)
    cfg = family_for(old).model_config(ConfigFields(old))
    assert cfg.layer_types == ("sliding_attention", "sliding_attention", "full_attention") * 2
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling) == (1e6, 10_000.0, None)


def test_gemma3_bad_layer_types_are_named():
    bad = dict(GEMMA3_TEXT, layer_types=["sliding_attention"] * 5)
    with pytest.raises(ModelConfigError, match=r"'layer_types' is .*expected a list of 6 entries"):
        family_for(bad).model_config(ConfigFields(bad))


def test_llama_rope_from_rope_parameters_and_from_legacy_fields():
    new = ConfigFields({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                            "original_max_position_embeddings": 8192}})
    theta, scaling = rope_settings(new)
    assert theta == 500000.0 and (scaling.kind, scaling.factor, scaling.high_freq_factor) == ("llama3", 8.0, 4.0)
    legacy = ConfigFields({"rope_theta": 100.0, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert rope_settings(legacy)[0] == 100.0 and rope_settings(legacy)[1].factor == 2.0
    assert rope_settings(ConfigFields({})) == (10_000.0, None)


def test_yarn_rope_as_transformers_reads_it():
    """transformers' _compute_yarn_parameters: beta defaults 32 / 1, truncate by default, the cos/sin factor
    `attention_factor` or, with mscale and mscale_all_dim both set, their ratio of `0.1 m ln(factor) + 1`."""
    import math

    from agentjax.models.layers import yarn_attention_factor

    plain = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
    theta, scaling = rope_settings(ConfigFields({"rope_parameters": plain}))
    assert theta == 10000.0 and (scaling.kind, scaling.factor, scaling.original_max_position_embeddings) == ("yarn", 4.0, 64)
    assert (scaling.beta_fast, scaling.beta_slow, scaling.truncate) == (32.0, 1.0, True)
    assert yarn_attention_factor(scaling) == 0.1 * math.log(4.0) + 1.0
    mscaled = rope_settings(ConfigFields({"rope_parameters": {**plain, "mscale": 2.0, "mscale_all_dim": 1.0}}))[1]
    assert math.isclose(yarn_attention_factor(mscaled), (0.2 * math.log(4.0) + 1) / (0.1 * math.log(4.0) + 1))
    given = rope_settings(ConfigFields({"rope_parameters": {**plain, "attention_factor": 1.0, "truncate": False,
                                                            "beta_fast": 16.0}}))[1]
    assert (yarn_attention_factor(given), given.truncate, given.beta_fast) == (1.0, False, 16.0)
    with pytest.raises(ModelConfigError, match=r"'rope_parameters.original_max_position_embeddings' is missing"):
        rope_settings(ConfigFields({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}))


def test_nested_section_fields_are_named_with_their_path():
    wrapper = ConfigFields({"text_config": {"hidden_size": -4}}, source="dir/config.json")
    with pytest.raises(ModelConfigError, match=r"dir/config.json: field 'text_config.hidden_size' is -4"):
        wrapper.section("text_config").integer("hidden_size")
    with pytest.raises(ModelConfigError, match=r"field 'vision_config' is missing; expected a JSON object"):
        wrapper.section("vision_config")


def test_booleans_are_not_integers():
    with pytest.raises(ModelConfigError, match=r"'num_hidden_layers' is True; expected an integer"):
        ConfigFields({"num_hidden_layers": True}).integer("num_hidden_layers")
