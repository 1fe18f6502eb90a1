"""Kimi-K3's additions (block attention residuals, gated MLA, latent MoE with its norm, SiTU, KDA's
full-rank gate and gate lower bound) through the whole decoder, against a float64 numpy forward
written from their formulas (transformers has no Kimi-K3), and the presets' sizes."""
from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from kimi_numpy_reference import kimi_logits  # noqa: E402

from agentjax.config import EngineConfig  # noqa: E402
from agentjax.engine import Engine  # noqa: E402
from agentjax.models.model_size import model_size  # noqa: E402
from agentjax.models.params import expected_shapes, params_from_arrays  # noqa: E402
from agentjax.models.presets import PRESETS, preset_config  # noqa: E402
from agentjax.models.residual import AttentionResidualMix  # noqa: E402
from agentjax.ragged_batch import RaggedBatch  # noqa: E402
from agentjax.runner import make_step  # noqa: E402
from agentjax.sampling_params import SamplingParams  # noqa: E402

PAGE = 16


def _within(value: float, target: float, tolerance: float = 0.01) -> bool:
    return abs(value - target) <= tolerance * target


def _arrays(cfg, seed: int) -> dict[str, np.ndarray]:
    """Random float32 weights for every parameter, drawn in numpy (no per-shape compile): projections
    N(0, 1/fan_in), norm weights 1 + N(0, 0.2^2), AttnRes pseudo-queries and routing biases N(0, 0.5^2),
    KDA decay rates in [1, 16] and step biases near -2.5, so every term of the formulas shows."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith(("norm.weight", "latent_norm", ".norm")):
            value = 1 + 0.2 * rng.standard_normal(shape)
        elif name.endswith((".query", "selection_bias")):
            value = 0.5 * rng.standard_normal(shape)
        elif name.endswith("A_log"):
            value = np.log(rng.uniform(1.0, 16.0, shape))
        elif name.endswith("dt_bias"):
            value = rng.normal(-2.5, 0.5, shape)
        elif name == "embed" or name.endswith("conv1d.weight"):
            value = 0.5 * rng.standard_normal(shape)
        else:  # [in, out] kernels, [E, in, out] experts
            value = rng.standard_normal(shape) / np.sqrt(shape[-2])
        arrays[name] = value.astype(np.float32)
    return arrays


def _logits(cfg, arrays, ids, numerics="fast") -> np.ndarray:
    step = make_step(cfg, numerics, all_positions=True)
    kv = cfg.new_kv_pages(2 + len(ids) // PAGE + 1, PAGE)
    logits, _ = step(params_from_arrays(cfg, arrays), kv, RaggedBatch.from_prompts([ids], PAGE))
    return np.asarray(logits)[: len(ids)]


@pytest.mark.parametrize("variant", [pytest.param("tiny-kimi-k3", marks=pytest.mark.slow), "six-layers-blocks-of-3"])
def test_k3_additions_match_the_numpy_formulas(variant):
    cfg = PRESETS["tiny-kimi-k3"]
    if variant == "six-layers-blocks-of-3":  # blocks start at layers 0 and 3: across segment boundaries
        from agentjax.models.presets import _kimi_k3_layers

        cfg = cfg.replace(num_layers=6, attn_res_block_size=3, **_kimi_k3_layers(6))
    arrays = _arrays(cfg, seed=4)
    ids = [int(t) for t in np.random.default_rng(5).integers(0, cfg.vocab_size, 21)]
    ours = _logits(cfg, arrays, ids)
    reference = kimi_logits(cfg, arrays, ids)
    assert np.abs(ours - reference).max() < 1e-4 * max(1.0, np.abs(reference).max())
    assert (ours.argmax(-1) == reference.argmax(-1)).all()


def test_attention_residual_mix_ignores_unfinished_block_slots():
    mix = AttentionResidualMix(4, eps=1e-5, dtype="float32")
    mix.query[...] = jax.numpy.asarray([0.3, -1.0, 0.5, 2.0])
    rng = np.random.default_rng(0)
    partial = rng.standard_normal((3, 4)).astype(np.float32)
    blocks = rng.standard_normal((3, 5, 4)).astype(np.float32)
    two = np.asarray(mix(partial, blocks, np.int32(2), "fast"))
    garbage = blocks.copy()
    garbage[:, 2:] = 1e6  # slots past the finished blocks never count
    assert np.array_equal(np.asarray(mix(partial, garbage, np.int32(2), "fast")), two)
    # with no finished block the mix is the running sum itself
    assert np.array_equal(np.asarray(mix(partial, blocks, np.int32(0), "batch_invariant")), partial)


def test_full_size_kimi_k3_matches_architectures_md():
    size = model_size(preset_config("kimi-k3", abstract=True))
    # ARCHITECTURES.md section 0: 2,779.5B total / 105.4B active; 27,648 B KV per token (24 MLA layers, bf16)
    assert _within(size.total_params, 2779.5e9), size.total_params
    assert _within(size.active_params, 105.4e9), size.active_params
    assert _within(size.kv_bytes_per_token, 27_648), size.kv_bytes_per_token
    cfg = preset_config("kimi-k3", abstract=True)
    assert cfg.layer_types.count("kda") == 69 and cfg.layer_types.count("mla") == 24


def test_tiny_kimi_k3_is_small_and_keeps_every_structural_feature():
    cfg = PRESETS["tiny-kimi-k3"]
    size = model_size(cfg)
    assert 1e6 <= size.total_params <= 4e6 and size.active_params < size.total_params
    assert cfg.vocab_size == 49152 and not cfg.tie_word_embeddings
    assert set(cfg.layer_types) == {"kda", "mla"} and cfg.mla.output_gate and not cfg.mla.use_rope
    assert cfg.kda.full_rank_gate and cfg.kda.gate_lower_bound == -5.0
    assert cfg.mlp_layer_types[0] == "dense" and set(cfg.mlp_layer_types[1:]) == {"moe"}
    # AttnRes: blocks start at layers 0 and 2, both KDA layers
    assert [i for i in range(cfg.num_layers) if i % cfg.attn_res_block_size == 0] == [0, 2]
    assert all(cfg.layer_types[i] == "kda" for i in (0, 2))
    moe = cfg.moe
    assert moe.latent_size < cfg.hidden_size and moe.latent_norm and moe.num_shared_experts == 2
    assert moe.scoring == "sigmoid" and moe.use_routing_bias and moe.num_expert_groups == 1
    assert moe.activation == cfg.hidden_activation == "situ"
    assert size.state_bytes_per_sequence > 0  # the KDA layers' recurrent states
    assert size.kv_bytes_per_token == cfg.mla.latent_width * 4  # one MLA layer, float32


@pytest.mark.slow
def test_tiny_kimi_k3_tokens_are_exact_alone_chunked_and_beside_others():
    """numerics="batch_invariant" on the whole K3 stack (AttnRes, gated MLA, bounded KDA, latent MoE)."""
    cfg = PRESETS["tiny-kimi-k3"]
    params = params_from_arrays(cfg, _arrays(cfg, seed=6))
    rng = np.random.default_rng(6)
    prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, n)] for n in (70, 75, 81)]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def run(rows: list[int], **settings) -> dict[int, list[int]]:
        base = dict(numerics="batch_invariant", num_kv_blocks=128, max_num_batched_tokens=128)
        engine = Engine(cfg, params, EngineConfig(**{**base, **settings}))
        ids = {engine.add_request(prompts[r], greedy): r for r in rows}
        tokens = {r: [] for r in rows}
        for out in engine.run_until_done():
            tokens[ids[out.request_id]].extend(out.new_token_ids)
        return tokens

    alone = {r: run([r], enable_prefix_caching=False)[r] for r in range(3)}
    assert len({tuple(t) for t in alone.values()}) == 3
    assert run([0, 1, 2]) == alone
    assert run([0, 1, 2], long_prefill_token_threshold=16) == alone
