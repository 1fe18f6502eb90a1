"""Tests of agentjax/kv/cache_layout.py's default interval between saved recurrent states: the fewest
tokens whose prefix KV outweighs one state, so interval states never cost more bytes than the pages they
checkpoint (issue 37 scope 6)."""
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
