"""Each gated activation against its formula in float64 numpy, over values inside and past the clamps."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from agentjax.errors import ModelLoadError, UnsupportedModelError
from agentjax.models.activations import GatedActivation


def _sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


GATE = np.linspace(-12.0, 12.0, 97)
UP = np.linspace(9.0, -9.0, 97)


@pytest.mark.parametrize("activation, expected", [
    (GatedActivation("silu"), GATE * _sigmoid(GATE) * UP),
    (GatedActivation("gelu_tanh"),
     0.5 * GATE * (1 + np.tanh(np.sqrt(2 / np.pi) * (GATE + 0.044715 * GATE**3))) * UP),
    (GatedActivation("swigluoai", swiglu_alpha=1.702, swiglu_limit=7.0),
     (np.clip(UP, -7, 7) + 1) * np.minimum(GATE, 7) * _sigmoid(1.702 * np.minimum(GATE, 7))),
    (GatedActivation("situ", situ_beta=4.0, situ_linear_beta=25.0),
     4.0 * np.tanh(GATE / 4.0) * _sigmoid(GATE) * 25.0 * np.tanh(UP / 25.0)),
    (GatedActivation("situ", situ_beta=4.0, situ_linear_beta=None), 4.0 * np.tanh(GATE / 4.0) * _sigmoid(GATE) * UP),
    (GatedActivation("clamped_swiglu", swiglu_limit=10.0),
     np.minimum(GATE, 10) * _sigmoid(np.minimum(GATE, 10)) * np.clip(UP, -10, 10)),
], ids=["silu", "gelu_tanh", "swigluoai", "situ", "situ_without_linear_beta", "clamped_swiglu"])
def test_activation_matches_its_formula(activation, expected):
    ours = activation(jnp.asarray(GATE, jnp.float32), jnp.asarray(UP, jnp.float32))
    np.testing.assert_allclose(np.asarray(ours), expected, rtol=2e-6, atol=2e-6)


def test_swigluoai_clamps_gate_above_only_and_up_both_ways():
    act = GatedActivation("swigluoai", swiglu_limit=1.0)
    big, small = act(jnp.array([50.0]), jnp.array([50.0])), act(jnp.array([1.0]), jnp.array([1.0]))
    assert float(big[0]) == float(small[0])  # gate and up both clamped to the limit
    negative = act(jnp.array([-3.0]), jnp.array([-50.0]))
    np.testing.assert_allclose(float(negative[0]), (-1.0 + 1.0) * -3.0 * _sigmoid(-3.0 * 1.702), atol=1e-7)


def test_clamped_swiglu_clamps_gate_above_only_and_up_both_ways():
    act = GatedActivation("clamped_swiglu", swiglu_limit=1.0)
    assert float(act(jnp.array([50.0]), jnp.array([50.0]))[0]) == float(act(jnp.array([1.0]), jnp.array([1.0]))[0])
    negative = act(jnp.array([-3.0]), jnp.array([-50.0]))  # gate unclamped below, up clamped to -1
    np.testing.assert_allclose(float(negative[0]), -3.0 * _sigmoid(-3.0) * -1.0, rtol=1e-6)


def test_fused_input_splits_gate_first():
    act = GatedActivation("silu")
    gate, up = jnp.array([[1.0, -2.0]]), jnp.array([[3.0, 0.5]])
    assert np.array_equal(np.asarray(act.on_fused(jnp.concatenate([gate, up], axis=-1))), np.asarray(act(gate, up)))


@pytest.mark.parametrize("kind", ["silu", "gelu_tanh", "swigluoai", "situ", "clamped_swiglu"])
def test_output_keeps_the_input_dtype(kind):
    out = GatedActivation(kind)(jnp.ones((2, 3), jnp.bfloat16), jnp.ones((2, 3), jnp.bfloat16))
    assert out.dtype == jnp.bfloat16


def test_unknown_kind_and_bad_constants_are_named():
    with pytest.raises(UnsupportedModelError, match="'relu'"):
        GatedActivation("relu")
    with pytest.raises(ModelLoadError, match="situ_linear_beta must be > 0, got -1"):
        GatedActivation("situ", situ_linear_beta=-1.0)
