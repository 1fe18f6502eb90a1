"""The engine with an FP8 KV cache (`kv_cache_dtype="fp8"`): greedy tokens in batch-invariant numerics are
exact within the configuration (plain, prefix-cached, chunked and batched runs agree), the layout stores
the attention kinds as packed FP8 rows, and the paths without FP8 KV refuse it by name.

Tiny presets with random weights; one LLM per preset, engines over its parameters.
"""
from __future__ import annotations

import pytest

from agentjax import LLM, SamplingParams
from agentjax.config import EngineConfig
from agentjax.engine import Engine
from agentjax.errors import InvalidRequestError
from agentjax.kv.specs import fp8_row_bytes
from agentjax.models import preset_config

from tests.step_buckets import pinned_buckets

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PREFIX = [(j * 29 + 7) % 400 + 5 for j in range(40)]  # 2 whole 16-token pages are shared
PROMPTS = [PREFIX + [(i * 53 + j * 13) % 400 + 5 for j in range(9 + 7 * i)] for i in range(4)]


def _engine(llm: LLM, **settings) -> Engine:
    base = dict(numerics="batch_invariant", kv_cache_dtype="fp8", kv_cache_memory_gb=0.01,
                max_num_batched_tokens=256, enable_prefix_caching=False, state_checkpoint_tokens=16,
                step_buckets=pinned_buckets(256))  # one step shape: the 4 prompts batched are 238 tokens
    return Engine(llm.model_config, llm.params, EngineConfig(**{**base, **settings}), llm.tokenizer)


def _run(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """All `prompts` submitted together: (tokens of each, cached prompt tokens of each)."""
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    tokens, cached = {i: [] for i in ids}, {}
    for output in engine.run_until_done():
        tokens[output.request_id].extend(output.new_token_ids)
        cached[output.request_id] = output.num_cached_tokens
    return [tokens[i] for i in ids], [cached[i] for i in ids]


def _alone(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    runs = [_run(engine, [p]) for p in prompts]
    return [r[0][0] for r in runs], [r[1][0] for r in runs]


@pytest.mark.parametrize("preset", [
    "tiny-dense",
    "tiny-sliding",
    pytest.param("tiny-minimax-m3", marks=pytest.mark.slow),
    pytest.param("tiny-kimi-k3", marks=pytest.mark.slow),
])
def test_fp8_tokens_equal_across_plain_cached_chunked_and_batched_runs(preset):
    llm = LLM(f"preset:{preset}", numerics="batch_invariant", kv_cache_memory_gb=0.002)
    plain_engine = _engine(llm)
    roles = {k.role: k for k in plain_engine.kv.layout.kinds}
    attention = roles.get("kv") or roles["latent"]
    cfg = plain_engine.model_cfg
    width = cfg.head_dim if "kv" in roles else cfg.mla.latent_width
    assert cfg.kv_cache_dtype == "fp8" and cfg.attention_impl == "reference"
    assert attention.cell_shape[-1] * 4 == fp8_row_bytes(width, 4)  # float32 words of packed FP8 rows

    plain = _alone(plain_engine, PROMPTS)[0]
    cached_tokens, cached_counts = _alone(_engine(llm, enable_prefix_caching=True), PROMPTS)
    assert cached_tokens == plain
    assert all(count >= 32 for count in cached_counts[1:])  # the shared prefix's pages were hits
    chunked = _run(_engine(llm, long_prefill_token_threshold=16, max_num_batched_tokens=48), PROMPTS)[0]
    assert chunked == plain
    batched = _run(_engine(llm), PROMPTS)[0]
    assert batched == plain


def test_fp8_and_float_caches_each_keep_their_own_exact_tokens_and_fp8_pages_are_smaller():
    """Engines over one model's weights: the FP8 cache's batched tokens equal its plain ones, the float
    cache's its own, and an FP8 page holds a 16-value head row in 20 bytes instead of 64."""
    llm = LLM("preset:tiny-dense", numerics="batch_invariant", kv_cache_memory_gb=0.002)
    fp8 = _run(_engine(llm), PROMPTS)[0]
    exact = _run(_engine(llm, kv_cache_dtype="auto"), PROMPTS)[0]
    assert fp8 == _alone(_engine(llm), PROMPTS)[0]
    assert exact == _alone(_engine(llm, kv_cache_dtype="auto"), PROMPTS)[0]
    fp8_layout = _engine(llm).kv.layout
    float_layout = _engine(llm, kv_cache_dtype="auto").kv.layout
    assert fp8_layout.page_bytes(0) * 16 == float_layout.page_bytes(0) * 5  # 16 float32 values -> 20 bytes


def test_paths_without_fp8_kv_refuse_it_by_name():
    with pytest.raises(InvalidRequestError, match="attention_impl='kernel'"):
        EngineConfig(kv_cache_dtype="fp8", attention_impl="kernel")
    with pytest.raises(InvalidRequestError, match="decode context parallelism"):
        EngineConfig(kv_cache_dtype="fp8", tensor_parallel_size=2, decode_context_parallel_size=2)
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype must be"):
        EngineConfig(kv_cache_dtype="fp4")
    dsv4 = preset_config("tiny-dsv4")
    with pytest.raises(InvalidRequestError, match="window, entries, index_entries"):
        EngineConfig(kv_cache_dtype="fp8").model_config_for(dsv4)
    kernel_model = preset_config("tiny-dense").replace(attention_impl="kernel")
    with pytest.raises(NotImplementedError, match="attention_impl='kernel'"):
        EngineConfig(kv_cache_dtype="fp8").model_config_for(kernel_model)
