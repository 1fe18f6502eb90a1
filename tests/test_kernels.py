"""agentjax.kernels: "kernel" picks the Pallas kernels (interpret mode on this CPU) and they give
the reference's results, op by op and through whole tiny models' greedy decoding; "auto" (the
default) picks the kernels on a GPU and the references on a CPU or under context parallelism, and
the engine setting, the LLM argument and `agentjax serve --attention-impl` override the model's."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from agentjax import kernels
from agentjax.cli import _engine_args, build_parser
from agentjax.config import EngineConfig, MoEConfig
from agentjax.errors import InvalidRequestError
from agentjax.engine import Engine
from agentjax.models import load_model
from agentjax.models.presets import PRESETS
from agentjax.models.moe import MoE
from agentjax.ragged_batch import RaggedBatch
from agentjax.sampling_params import SamplingParams
from pallas_kernels.moe_grouped_matmul import quantize_mxfp4


def test_kernel_impl_of_ragged_paged_attention_matches_the_reference():
    rng = np.random.default_rng(0)
    batch = RaggedBatch.build([([1] * 9, 0, [1, 2, 3]), ([1], 20, [4, 5, 6, 7, 8, 9])], 4)
    kv_pages = jnp.asarray(rng.standard_normal((1, 10, 4, 4, 16)), jnp.float32)
    q, k, v = (jnp.asarray(rng.standard_normal((batch.num_tokens, h, 16)), jnp.float32) for h in (4, 2, 2))
    args = (q, k, v, kv_pages, batch.kv_lens, batch.page_indices[0], batch.cu_q_lens)
    options = dict(layer=0, token_seq_ids=batch.seq_ids, token_positions=batch.positions,
                   slot_mapping=batch.slot_mapping[0], sm_scale=0.25, sliding_window=7)
    want, want_pages = kernels.ragged_paged_attention(*args, impl="reference", **options)
    got, got_pages = kernels.ragged_paged_attention(*args, impl="kernel", **options)
    np.testing.assert_array_equal(np.asarray(got_pages), np.asarray(want_pages))
    np.testing.assert_allclose(np.asarray(got[:10]), np.asarray(want[:10]), atol=2e-5)


def test_kernel_impl_of_grouped_matmul_matches_the_reference_on_mxfp4_experts():
    rng = np.random.default_rng(1)
    lhs = jnp.asarray(rng.standard_normal((40, 64)), jnp.float32)
    rhs = quantize_mxfp4(jnp.asarray(rng.standard_normal((3, 64, 32)), jnp.float32))
    sizes = jnp.asarray([7, 0, 30], jnp.int32)
    want = kernels.grouped_matmul(lhs, rhs, sizes, impl="reference")
    got = kernels.grouped_matmul(lhs, rhs, sizes, impl="kernel", block_m=16, block_n=16, block_k=32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)


def test_moe_routed_experts_through_the_grouped_matmul_kernel_match_ragged_dot():
    config = MoEConfig(num_experts=6, num_experts_per_token=2, expert_intermediate_size=24, num_shared_experts=1,
                       scoring="sigmoid", use_routing_bias=True, activation="swigluoai")
    x = jnp.asarray(np.random.default_rng(2).standard_normal((21, 32)), jnp.float32)
    want = MoE(32, config, rngs=nnx.Rngs(3))(x)
    got = MoE(32, config, rngs=nnx.Rngs(3), impl="kernel")(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)


def test_an_unknown_impl_is_refused_with_the_choices():
    with pytest.raises(NotImplementedError, match="reference"):
        kernels.grouped_matmul(jnp.zeros((2, 2)), jnp.zeros((1, 2, 2)), jnp.asarray([2]), impl="triton")


@pytest.mark.parametrize("impl,backend,context_parallel,want", [
    ("auto", "gpu", False, "kernel"), ("auto", "cpu", False, "reference"), ("auto", "tpu", False, "reference"),
    ("auto", "gpu", True, "reference"), ("kernel", "cpu", False, "kernel"), ("reference", "gpu", False, "reference"),
])
def test_auto_picks_the_kernels_on_a_gpu_and_the_references_elsewhere(impl, backend, context_parallel, want):
    assert kernels.resolve_attention_impl(impl, backend=backend, context_parallel=context_parallel) == want


def test_auto_runs_the_reference_on_this_cpu_op_by_op():
    assert jax.default_backend() == "cpu" and PRESETS["tiny-dense"].attention_impl == "auto"
    lhs = jnp.asarray(np.random.default_rng(4).standard_normal((12, 16)), jnp.float32)
    rhs = jnp.asarray(np.random.default_rng(5).standard_normal((2, 16, 8)), jnp.float32)
    sizes = jnp.asarray([5, 7], jnp.int32)
    np.testing.assert_array_equal(np.asarray(kernels.grouped_matmul(lhs, rhs, sizes, impl="auto")),
                                  np.asarray(kernels.grouped_matmul(lhs, rhs, sizes, impl="reference")))


def test_the_engine_setting_resolves_auto_by_backend_and_overrides_the_model(monkeypatch):
    cfg = PRESETS["tiny-dense"]
    assert EngineConfig().model_config_for(cfg).attention_impl == "reference"  # this CPU
    assert EngineConfig(attention_impl="kernel").model_config_for(cfg).attention_impl == "kernel"
    assert EngineConfig().model_config_for(cfg.replace(attention_impl="kernel")).attention_impl == "kernel"
    kernel_cfg = cfg.replace(attention_impl="kernel")
    assert EngineConfig(attention_impl="reference").model_config_for(kernel_cfg).attention_impl == "reference"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert EngineConfig().model_config_for(cfg).attention_impl == "kernel"
    dcp = EngineConfig(tensor_parallel_size=2, decode_context_parallel_size=2)
    assert dcp.model_config_for(cfg).attention_impl == "reference"  # DCP ranks run the reference only
    with pytest.raises(InvalidRequestError, match="attention_impl"):
        EngineConfig(attention_impl="triton")


def test_agentjax_serve_takes_the_attention_impl_flag():
    args = build_parser().parse_args(["serve", "--attention-impl", "kernel"])
    assert EngineConfig(**_engine_args(args)).attention_impl == "kernel"
    assert _engine_args(build_parser().parse_args(["generate", "--prompt", "x"]))["attention_impl"] == "auto"


def test_an_engine_on_this_cpu_runs_the_reference_unless_told_otherwise():
    cfg, params, tokenizer = load_model("preset:tiny-dense")
    engine = Engine(cfg, params, EngineConfig(block_size=16, num_kv_blocks=16), tokenizer)
    assert engine.model_cfg.attention_impl == "reference" and engine.runner.cfg.attention_impl == "reference"
    engine = Engine(cfg, params, EngineConfig(block_size=16, num_kv_blocks=16, attention_impl="kernel"), tokenizer)
    assert engine.runner.cfg.attention_impl == "kernel"


def _greedy_tokens(cfg, params, tokenizer, prompts, max_tokens):
    engine = Engine(cfg, params, EngineConfig(block_size=16, num_kv_blocks=64), tokenizer)
    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
           for p in prompts]
    tokens = {i: [] for i in ids}
    for out in engine.run_until_done():
        tokens[out.request_id] += out.new_token_ids
    return [tokens[i] for i in ids]


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-sliding", "tiny-minimax-m3", "tiny-kimi-k3", "tiny-dsv4"])
def test_tiny_presets_decode_the_same_tokens_through_the_kernels(preset):
    # tiny-minimax-m3: block indexer and block-sparse attention kernels beside GQA layers; tiny-kimi-k3:
    # KDA's chunked scan (prefill) and decode step, and MLA on the latent; tiny-dsv4: the lightning
    # indexer's score and top-k kernels and the window + compressed attention kernel (swa_mqa, csa and
    # hca layers; the 40-token prompt's 10 CSA entries exceed top-k 8); all but the dense ones: MoE
    # grouped matmuls.
    cfg, params, tokenizer = load_model(f"preset:{preset}")
    prompts = [list(range(10, 50)), [5, 6, 7], list(range(100, 121))]
    want = _greedy_tokens(cfg, params, tokenizer, prompts, 4)
    got = _greedy_tokens(cfg.replace(attention_impl="kernel"), params, tokenizer, prompts, 4)
    assert got == want
