"""The planning simulator: the real engine, scheduler and KV manager on a virtual clock."""
from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from agentjax.bench.agentx import AgentxConfig
from agentjax.bench.cost_terms import Layout
from agentjax.bench.gpus import GPUS
from agentjax.bench.model_shapes import shape_from_model_config
from agentjax.bench.simulator import (LockstepEngines, SimTarget, VirtualClock, VirtualTimeLoop, build_instance,
                                      simulate_agentx)
from agentjax.bench.traces import Session, Turn
from agentjax.config import EngineConfig
from agentjax.errors import InvalidRequestError, OutOfPagesError
from agentjax.models.presets import PRESETS

BLOCK = 8


def synthetic_sessions(count: int = 3, turns: int = 5) -> list[Session]:
    """Sessions whose turns re-send the conversation so far plus a new tool result."""
    sessions = []
    for s in range(count):
        session_turns, blocks = [], []
        for t in range(turns):
            blocks += [1000 * s + len(blocks) + i for i in range(6 if t == 0 else 2)]
            session_turns.append(Turn(index=t, hash_ids=np.asarray(blocks, dtype=np.int64),
                                      input_tokens=len(blocks) * BLOCK, output_tokens=4 + t,
                                      think_time_s=2.0, offset_s=10.0 * t))
        sessions.append(Session(f"s{s}", session_turns, BLOCK, f"test:s{s}"))
    return sessions


def tiny_target(**changes) -> SimTarget:
    engine = EngineConfig(block_size=4, max_num_batched_tokens=24, max_num_seqs=4, long_prefill_token_threshold=16)
    target = SimTarget(shape_from_model_config(PRESETS["tiny-dense"], page_tokens=4), GPUS["H200"],
                       engine=engine, kv_tokens=4096)
    return dataclasses.replace(target, **changes)


CONFIG = AgentxConfig(traces="unused", lanes=2, context_scale=1.0, duration_s=2.0, think_scale=0.0)


def test_virtual_loop_sleeps_without_waiting():
    clock = VirtualClock()
    loop = VirtualTimeLoop(clock)
    try:
        loop.run_until_complete(asyncio.sleep(3600))
    finally:
        loop.close()
    assert 3600 <= clock.now < 3600.01


def test_simulation_is_deterministic_and_reports_agentx_figures():
    first = simulate_agentx(CONFIG, tiny_target(), synthetic_sessions())
    second = simulate_agentx(CONFIG, tiny_target(), synthetic_sessions())
    keys = ("tpgs", "p90_interactivity", "hit_rate", "requests", "ttft_p50_s", "itl_p50_s", "e2e_p90_s", "steps")
    assert {k: first[k] for k in keys} == {k: second[k] for k in keys}
    assert first["requests"] > 0 and first["errors"] == 0
    assert first["hit_rate"] > 0.3  # later turns reuse the earlier turns' pages
    assert first["label"].startswith("projection")
    assert first["busy_s"] <= first["simulated_s"]
    assert "gpu_cost_per_million_tokens" not in first  # the H200 entry has no price
    priced = simulate_agentx(CONFIG, tiny_target(), synthetic_sessions(), gpu_price_per_hour=2.0)
    tokens = priced["input_tokens"] + priced["output_tokens"]
    per_million = 2.0 / (tokens / priced["wall_time_s"] * 3600 / 1e6)
    assert priced["gpu_cost_per_million_tokens"] == pytest.approx(per_million)
    assert priced["api_cost_per_million_tokens"] > 0 and priced["cost_advantage"] > 0


def test_the_scheduler_budget_and_prefill_cap_hold_every_step():
    log: list = []
    simulate_agentx(CONFIG, tiny_target(), synthetic_sessions(), step_log=log)
    assert log
    for seconds, (rows,) in log:
        assert seconds > 0
        assert sum(n for n, _ in rows) <= 24 and len(rows) <= 4
        assert all(n <= 16 for n, _ in rows)


def test_a_step_advances_the_clock_by_the_cost_model_time():
    clock = VirtualClock()
    engine, timer = build_instance(tiny_target(), clock)
    from agentjax.sampling_params import SamplingParams

    engine.add_request(list(range(300, 340)), SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    (rows,) = [[(16, 0)]]
    assert clock.now == pytest.approx(timer.model.step_time([rows], new_shape=True))


def test_think_time_stretches_the_run():
    quick = simulate_agentx(CONFIG, tiny_target(), synthetic_sessions())
    slow = simulate_agentx(dataclasses.replace(CONFIG, think_scale=1.0), tiny_target(), synthetic_sessions())
    assert slow["e2e_p50_s"] == pytest.approx(quick["e2e_p50_s"], rel=0.5)
    assert slow["requests"] < quick["requests"]


def test_prefill_role_cuts_outputs_and_decode_role_charges_no_prefill():
    prefill = simulate_agentx(CONFIG, tiny_target(role="prefill"), synthetic_sessions())
    assert prefill["output_tokens"] == prefill["requests"]
    log: list = []
    simulate_agentx(CONFIG, tiny_target(role="decode"), synthetic_sessions(), step_log=log)
    assert all(n == 1 for _, (rows,) in log for n, _ in rows)


def test_dep_ranks_step_in_lockstep_with_sticky_sessions():
    clock = VirtualClock()
    target = tiny_target(layout=Layout.parse("dep2"))
    group, timer = build_instance(target, clock)
    assert isinstance(group, LockstepEngines) and len(group.engines) == 2
    log: list = []
    summary = simulate_agentx(CONFIG, target, synthetic_sessions(), step_log=log)
    assert summary["errors"] == 0 and summary["num_gpus"] == 2
    assert all(len(ranks) == 2 for _, ranks in log)


def test_a_model_that_does_not_fit_is_refused():
    from agentjax.bench.model_shapes import FULL_SIZE_SHAPES

    target = SimTarget(FULL_SIZE_SHAPES["kimi-k3"](), GPUS["H200"], Layout(tp=1))
    with pytest.raises(OutOfPagesError, match="does not fit"):
        build_instance(target, VirtualClock())
    with pytest.raises(InvalidRequestError, match="role"):
        SimTarget(target.shape, GPUS["H200"], role="both")


def test_the_padding_figure_counts_the_engines_padded_shapes():
    """`padding_fraction`: the share of the steps' token slots (the runner's buckets) that were padding,
    recomputed here from the step log; 0 with exact shapes."""
    from agentjax.buckets import lockstep_buckets

    log: list = []
    summary = simulate_agentx(CONFIG, tiny_target(), synthetic_sessions(), step_log=log)
    real = sum(n for _, ranks in log for rows in ranks for n, _ in rows)
    slots = sum(lockstep_buckets([sum(n for n, _ in rows) for rows in ranks], [len(r) for r in ranks])[0] * len(ranks)
                for _, ranks in log)
    assert 0 < summary["padding_fraction"] < 1
    assert summary["padding_fraction"] == pytest.approx(1 - real / slots)
    exact = simulate_agentx(CONFIG, tiny_target(pad_batches=False), synthetic_sessions())
    assert exact["padding_fraction"] == 0.0
