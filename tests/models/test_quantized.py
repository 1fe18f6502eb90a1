"""agentjax/models/quantized.py through the loader: every family in every published format, kept in its format
on the device, decodes inside a step to exactly the float32 checkpoint of its decoded weights, takes at most
1.1x the checkpoint's bytes, and generates that checkpoint's greedy tokens (batch-invariant) with prompt
logits within 1e-5.

The checkpoints are written here with numpy (checkpoints/quant_writer.py) from the committed tiny fixtures,
their non-quantised tensors in bfloat16 as the published checkpoints keep them.
"""
from __future__ import annotations

from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from agentjax.models import load_model
from agentjax.models.quantized import StoredWeight, stored_bytes
from checkpoints.quant_writer import dequantize_checkpoint, quantize_checkpoint

DATA = Path(__file__).parent / "data"
FAMILIES = ("minimax-m3-a", "kimi-linear-a", "deepseek-v4-a")
FORMATS = ("fp8", "fp8_ds", "mxfp8", "nvfp4", "mxfp4")
# the formats each family's weights are published in (../shared/ARCHITECTURES.md)
PUBLISHED = {("deepseek-v4-a", "fp8_ds"), ("kimi-linear-a", "mxfp4"), ("minimax-m3-a", "mxfp8"),
             ("minimax-m3-a", "nvfp4")}
VALUE_KIND = {"fp8": "e4m3", "fp8_ds": "e2m1", "mxfp8": "e4m3", "nvfp4": "e2m1", "mxfp4": "e2m1"}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root, made = tmp_path_factory.mktemp("quantized"), {}

    def pair(family: str, fmt: str) -> tuple[Path, Path]:
        if (family, fmt) not in made:
            quantized = quantize_checkpoint(DATA / family, root / f"{family}-{fmt}", fmt, block=(16, 16), shards=3,
                                            source_dtype=ml_dtypes.bfloat16)
            made[family, fmt] = quantized, dequantize_checkpoint(quantized, root / f"{family}-{fmt}-float32")
        return made[family, fmt]

    return pair


def _checkpoint_bytes(directory: Path) -> int:
    """Bytes of the checkpoint tensors the model is made from (not the files' headers or unused tensors)."""
    from agentjax.models.params import expected_shapes
    from checkpoints.hf import load_hf

    _, recipes, _ = load_hf(directory, expected_shapes, lazy=True)
    entries = {e.name: e for recipe in recipes.values() if hasattr(recipe, "entries") for e in recipe.entries()}
    return sum(e.nbytes for e in entries.values())


@pytest.mark.parametrize("family, fmt", [pytest.param(f, m, marks=() if (f, m) in PUBLISHED else pytest.mark.slow)
                                         for f in FAMILIES for m in FORMATS])
def test_stored_weights_decode_in_a_step_to_the_float32_checkpoint_in_checkpoint_bytes(written, family, fmt):
    quantized, reference = written(family, fmt)
    _, params, _ = load_model(str(quantized))
    _, float_params, _ = load_model(str(reference))
    stored = [v for v in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, StoredWeight))
              if isinstance(v, StoredWeight)]
    assert any(w.codec.values == VALUE_KIND[fmt] for w in stored), "no matrix stayed quantised"
    decoded = jax.jit(lambda p: jax.tree.map(lambda v: v[...] if isinstance(v, StoredWeight) else v, p,
                                             is_leaf=lambda x: isinstance(x, StoredWeight)))(params)
    got, want = dict(nnx.to_flat_state(decoded)), dict(nnx.to_flat_state(float_params))
    assert got.keys() == want.keys()
    for path, variable in want.items():
        ours, theirs = np.asarray(got[path].get_value()), np.asarray(variable.get_value())
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, path
        assert np.array_equal(ours.view(np.uint8), theirs.view(np.uint8)), f"{path} differs bitwise"
    held, checkpoint = stored_bytes(params), _checkpoint_bytes(quantized)
    assert held <= 1.1 * checkpoint, (held, checkpoint)
    assert stored_bytes(float_params) > 1.5 * held  # the float32 twin really is bigger: quantised bytes stayed


def _prompt_logits(cfg, params, ids: list[int]) -> np.ndarray:
    from agentjax.runner import RaggedBatch, make_step

    step = make_step(cfg, all_positions=True, numerics="batch_invariant")
    kv = cfg.new_kv_pages(2 + len(ids) // 16 + 1, 16)
    logits, _ = step(params, kv, RaggedBatch.from_prompts([ids], 16))
    return np.asarray(logits)[: len(ids)]


PROMPTS = [[1, 5, 9, 200, 31, 77, 100, 4, 8, 15, 3, 3, 3, 3, 3, 3, 3, 3, 3, 90, 44, 12], [7, 7, 7, 300, 12]]


def _generate(directory: Path) -> tuple[list, np.ndarray]:
    from agentjax import LLM, SamplingParams

    llm = LLM(str(directory), numerics="batch_invariant", block_size=16, num_kv_blocks=64)
    tokens = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0,
                                                                        ignore_eos=True))]
    return tokens, _prompt_logits(llm.model_config, llm.params, PROMPTS[0])


@pytest.mark.slow  # two to three minutes a case on a 2-core CPU: four step compilations
@pytest.mark.parametrize("family, fmt", sorted(PUBLISHED))  # every format decodes exactly: the test above
def test_greedy_tokens_and_prompt_logits_equal_the_float32_checkpoint(written, family, fmt):
    quantized, reference = written(family, fmt)
    tokens, logits = _generate(quantized)
    want_tokens, want_logits = _generate(reference)
    assert tokens == want_tokens
    assert np.abs(logits - want_logits).max() <= 1e-5


def test_fp8_experts_reach_the_moe_kernel_undecoded_and_give_the_decoded_product():
    import jax.numpy as jnp

    from agentjax import kernels
    from agentjax.models.quantized import grouped_operand
    from checkpoints.quant_codecs import E4M3, Codec
    from pallas_kernels.moe_grouped_matmul import Fp8Experts

    rng = np.random.default_rng(3)
    values = (rng.standard_normal((4, 64, 32)) * 8).astype(E4M3)
    scales = rng.uniform(0.01, 0.1, (4, 4, 2)).astype(np.float32)
    weight = StoredWeight(jnp.asarray(values), jnp.asarray(scales), codec=Codec("e4m3", "f32", (16, 16)))
    operand = grouped_operand(weight)
    assert isinstance(operand, Fp8Experts) and operand.values.dtype == E4M3
    lhs = jnp.asarray(rng.standard_normal((24, 64)).astype(np.float32))
    sizes = jnp.asarray([5, 0, 11, 8], jnp.int32)
    got = kernels.grouped_matmul(lhs, operand, sizes, impl="kernel")  # interpret mode on a CPU
    want = jax.lax.ragged_dot(lhs, weight[...], sizes)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
