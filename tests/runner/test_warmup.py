"""agentjax/runner/warmup.py: the step shapes an engine can reach, and a warm-up after which a replay of
the dev traces builds no executable (counted from JAX's compile events, agentjax/runner/compile_counter.py)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentjax.runner.warmup import WARMUP_LEVELS, _rows_for, context_buckets, step_shapes, token_row_buckets

REPO = Path(__file__).resolve().parents[2]
TRACES = Path(os.environ.get("AGENTJAX_TRACES", REPO.parent / "shared" / "traces")) / "agentx-dev"
# A small engine: tokens 8/16/32, rows 8, contexts of 8 or 32 pages: 6 step shapes, 12 executables.
SMALL = dict(max_num_batched_tokens=32, max_num_seqs=8, max_model_len=256, num_kv_blocks=160)


def _engine(preset: str = "tiny-dense", **settings):
    from agentjax.config import EngineConfig
    from agentjax.engine import Engine
    from agentjax.models import load_model

    cfg, params, tokenizer = load_model(f"preset:{preset}")
    return Engine(cfg, params, EngineConfig(**{**SMALL, **settings}), tokenizer)


def test_token_and_row_buckets_never_have_more_rows_than_tokens():
    assert token_row_buckets(32, 8) == [(8, 8), (16, 8), (32, 8)]
    assert token_row_buckets(64, 64) == [(8, 8), (16, 8), (16, 16), (32, 8), (32, 16), (32, 32),
                                         (64, 8), (64, 16), (64, 32), (64, 64)]
    # one token per row: the row count sets both buckets
    assert token_row_buckets(2048, 64, decode_only=True) == [(8, 8), (16, 16), (32, 32), (64, 64)]
    assert token_row_buckets(2048, 20, decode_only=True) == [(8, 8), (16, 16), (32, 32)]


def test_contexts_give_each_distinct_tuple_of_page_table_widths_once():
    engine = _engine()
    assert context_buckets(engine.kv, 256) == [8 * 16, 256]  # up to 8 pages, then 16 pages (a width of 32)
    shapes = step_shapes(engine, "steps")
    assert len(shapes) == 6 and len(step_shapes(engine, "decode")) == 2 and step_shapes(engine, "none") == []
    for shape in shapes:  # each shape's null-page rows pad to exactly that shape
        from agentjax.ragged_batch import RaggedBatch

        batch = RaggedBatch.build(_rows_for(engine, shape), engine.runner.page_size)
        assert batch.num_tokens == shape.tokens and batch.num_seqs == shape.rows


def test_serve_offers_the_warm_up_levels():
    from agentjax.server.launcher import WARMUP_LEVELS as SERVE_LEVELS

    assert SERVE_LEVELS == WARMUP_LEVELS


@pytest.mark.slow
@pytest.mark.skipif(not TRACES.is_dir(), reason=f"no dev traces at {TRACES} (set AGENTJAX_TRACES)")
def test_a_dev_trace_replay_after_warm_up_builds_no_executable():
    from agentjax.bench.agentx import AgentxConfig, run_agentx
    from agentjax.bench.backends import EngineBackend
    from agentjax.runner.warmup import warm_up

    engine = _engine()
    report = warm_up(engine, "steps")
    assert report.shapes == 6 and report.skipped == 0
    assert report.executables >= 12  # greedy and sampled per shape (more: the first steps' small helpers)
    assert engine.stats()["compiled_executables"] == report.executables
    shapes = set(engine.runner.compiled_shapes)
    steps_before = engine.num_steps

    config = AgentxConfig(traces=str(TRACES), lanes=6, context_scale=0.01, duration_s=15.0, max_context=160,
                          warmup_requests_per_lane=0)
    summary = run_agentx(config, EngineBackend(engine))
    assert summary["requests"] - summary["errors"] >= 6, summary
    assert engine.num_steps - steps_before >= 50
    assert engine.stats()["compiled_executables"] == report.executables  # serving built nothing
    assert engine.runner.compiled_shapes == shapes


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{}, dict(tensor_parallel_size=2)], ids=["one-device", "tp2"])
def test_page_mover_warm_up_builds_every_move_once_over_the_byte_pool_and_changes_no_page(layout):
    """The offload page movers over the byte pool (one device's, or each device's part of it under TP2):
    warmed on the null page, they leave the KV memory as it was, a second warm-up builds nothing, and the
    steps warmed before them still run on the KV memory they return without a new executable."""
    import jax
    import numpy as np

    from agentjax.runner.warmup import warm_page_movers, warm_up
    from tests.sharding.parity import need_devices

    if layout:
        need_devices()
    engine = _engine(host_cache_gb=0.01, **layout)
    assert engine.kv_layout.mode == "pool" and type(engine.offload_worker.mover).__name__.endswith("PoolPageMover")
    engine.runner.kv_pages = jax.tree.map(lambda a: a + 1, engine.runner.kv_pages)  # no page is all zeros
    warm_up(engine, "decode")  # the decode steps, on the KV memory as the runner made it (or from the cache)
    before = np.asarray(engine.runner.kv_pages.array)
    with engine.compiles.counting():
        first = engine.compiles.executables
        warm_page_movers(engine)
        built = engine.compiles.executables - first
        warm_page_movers(engine)
        again = engine.compiles.executables - first - built
    assert built > 0 and again == 0
    assert warm_up(engine, "decode").executables == 0  # the movers kept the KV memory's placement
    np.testing.assert_array_equal(np.asarray(engine.runner.kv_pages.array), before)
    engine.offload_worker.close()
