"""Tests of agentjax/bench/model_shapes.py: the planner's KV capacity follows the engine's FP8 KV layout."""
from __future__ import annotations

import pytest

from agentjax.bench.costmodel import CostModel, Layout
from agentjax.bench.gpus import get_device
from agentjax.bench.model_shapes import engine_kv_terms, get_shape
from agentjax.errors import InvalidRequestError
from agentjax.models import preset_config


def _attention_bytes_per_token(shape) -> float:
    return sum(t.bytes_per_token for t in shape.kv_terms if t.role in ("kv", "latent"))


@pytest.mark.parametrize("name", ["minimax-m3", "kimi-k3"])
def test_fp8_kv_about_doubles_the_full_size_attention_kinds_tokens_per_gb_in_the_planner(name):
    bf16, fp8 = get_shape(name), get_shape(name, kv_cache_dtype="fp8")
    assert fp8.kv_dtype == "fp8 (attention kinds)" and bf16.kv_dtype == "bfloat16"
    assert 1.9 < _attention_bytes_per_token(bf16) / _attention_bytes_per_token(fp8) < 2.0
    device = get_device("B300")
    tokens = {dtype: CostModel(shape, device, Layout(tp=8)).capacity().kv_tokens_per_engine for dtype, shape in
              (("bf16", bf16), ("fp8", fp8))}
    assert tokens["fp8"] > 1.4 * tokens["bf16"] > 0


def test_fp8_kv_for_deepseek_v4_is_refused_in_the_planner_as_in_the_engine():
    with pytest.raises(InvalidRequestError, match="deepseek-v4-pro"):
        get_shape("deepseek-v4-pro", kv_cache_dtype="fp8")


def test_a_preset_shape_takes_its_capacity_from_the_fp8_layout():
    """tiny-dense's float32 K/V head rows of 16 values (64 B) become 20 B of FP8 and scale."""
    shape = get_shape("preset:tiny-dense", kv_cache_dtype="fp8")
    float_terms = engine_kv_terms(preset_config("tiny-dense", abstract=True))
    assert _attention_bytes_per_token(shape) * 64 == pytest.approx(sum(t.bytes_per_token for t in float_terms) * 20)
