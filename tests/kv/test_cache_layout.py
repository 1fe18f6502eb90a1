"""Tests of agentjax/kv/cache_layout.py: the default interval between saved recurrent states (the fewest
tokens whose prefix KV outweighs one state, so interval states never cost more bytes than the pages they
checkpoint; issue 37 scope 6), and the cells and specs of FP8 KV kinds."""
from __future__ import annotations

import pytest

from agentjax.config import EngineConfig
from agentjax.errors import InvalidRequestError
from agentjax.kv.cache_layout import DEFAULT_CHECKPOINT_TOKENS, cost_aware_checkpoint_tokens, kv_tensors
from agentjax.models import preset_config


def _bytes(cfg, tokens: int) -> tuple[int, int]:
    """(one state of every recurrent layer, the prefix KV of `tokens` tokens) in bytes."""
    tensors = kv_tensors(cfg)
    state = sum(t.spec.state_bytes for t in tensors if t.spec.hit_rule == "checkpoint")
    return state, sum(t.spec.bytes_for_tokens(tokens) for t in tensors if t.spec.hit_rule == "prefix")


@pytest.mark.parametrize("name, expected", [("kimi-k3", 16816), ("tiny-kimi-k3", 112)])
def test_the_interval_is_the_fewest_whole_pages_whose_prefix_kv_outweighs_a_state(name, expected):
    cfg = preset_config(name, abstract=True)
    interval = cost_aware_checkpoint_tokens(cfg, 16)
    assert interval == expected and interval % 16 == 0
    state, prefix = _bytes(cfg, interval)
    assert state <= prefix and _bytes(cfg, interval - 16)[1] < state


def test_kimi_k3_full_size_state_is_465_mb_and_the_latent_of_16_8k_tokens():
    cfg = preset_config("kimi-k3", abstract=True)
    state, prefix = _bytes(cfg, 16816)
    assert round(state / 1e6, 1) == 464.6 and prefix / state < 1.001


def test_models_without_states_and_tiny_states_keep_the_floor():
    assert cost_aware_checkpoint_tokens(preset_config("tiny-minimax-m3", abstract=True), 16) == DEFAULT_CHECKPOINT_TOKENS
    assert cost_aware_checkpoint_tokens(preset_config("tiny-kimi-k3", abstract=True), 128) == 128


def test_an_engine_setting_must_be_whole_pages():
    assert EngineConfig(state_checkpoint_tokens=64).state_checkpoint_tokens == 64
    for bad in (0, 40, -16):
        with pytest.raises(InvalidRequestError, match="state_checkpoint_tokens"):
            EngineConfig(state_checkpoint_tokens=bad)


def test_fp8_kv_cells_are_packed_rows_in_the_models_words_and_their_specs_count_them():
    from agentjax.kv.cache_layout import kind_cell, kv_tensors
    from agentjax.kv.specs import fp8_row_bytes

    for preset, role, width in (("tiny-dense", "kv", 16), ("tiny-kimi-k3", "latent", 24)):
        for dtype, word in (("float32", 4), ("bfloat16", 2)):
            cfg = preset_config(preset).replace(dtype=dtype, kv_cache_dtype="fp8")
            tensor = next(t for t in kv_tensors(cfg) if t.role == role)
            shape, cell_dtype = kind_cell(cfg, role, tensor.spec, 16)
            assert cell_dtype == dtype and shape[-1] * word == fp8_row_bytes(width, word) == width + 4
            values = 1
            for size in shape:
                values *= size
            assert tensor.spec.bytes_for_tokens(16) == values * word
    assert fp8_row_bytes(30, 2) == 36 and fp8_row_bytes(30, 4) == 36 and fp8_row_bytes(29, 4) == 36


def test_an_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype must be one of"):
        preset_config("tiny-dense").replace(kv_cache_dtype="int8")
