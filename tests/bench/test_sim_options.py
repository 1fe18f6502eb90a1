"""The planning simulator's options: pipeline stages in the cost model, speculative decoding through the
engine's own drafts, the KV offload connector over virtual-time tiers, and the router's real policies
placing requests; plus the GPU table that BENCHMARKS.md carries."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from agentjax.bench.cost_terms import Layout
from agentjax.bench.costmodel import CostModel
from agentjax.bench.gpus import GPUS, Efficiency, spec_table
from agentjax.bench.model_shapes import FULL_SIZE_SHAPES, ModelShape, gqa
from agentjax.bench.pipeline import split_microbatches
from agentjax.bench.sim_offload import OffloadPlan
from agentjax.bench.simulator import LockstepEngines, VirtualClock, build_instance, simulate_agentx
from agentjax.bench.speculation import AcceptanceSampler, Speculation, default_speculation, mtp_module_shape
from agentjax.config import EngineConfig
from agentjax.errors import InvalidRequestError
from agentjax.router.policies import QueueDepthPolicy, StickyPolicy

from tests.bench.test_simulator import CONFIG, synthetic_sessions, tiny_target

ROOT = Path(__file__).resolve().parents[2]
FOUR_LANES = dataclasses.replace(CONFIG, lanes=4)
SHORT = dataclasses.replace(CONFIG, duration_s=1.0)
TOY = ModelShape(name="toy", hidden=8, vocab=16, mixers=((gqa(2, 1, 4, 2.0), 1),), dense_params=1e9,
                 dense_bytes_per_param=1.0, lm_head_params=128, lm_head_bytes_per_param=1.0,
                 embedding_params=0, moe=None, page_tokens=16, max_context=1 << 20)


# ------------------------------------------------------------------ pipeline parallelism

def test_microbatches_keep_short_rows_whole_and_split_long_chunks_in_order():
    assert split_microbatches([(1, 10)] * 6, 4) == [[(1, 10)] * 2, [(1, 10)] * 2, [(1, 10)] * 2]
    pieces = split_microbatches([(1000, 500), (1, 7)], 4)
    assert pieces == [[(251, 500)], [(251, 751)], [(251, 1002)], [(247, 1253), (1, 7)]]
    assert split_microbatches([(100, 0), (100, 0)], 8) == [[(100, 0)], [(100, 0)]]  # rows of <= 128 stay whole


def test_pipeline_step_is_the_pieces_plus_the_fill_and_drain_bubble():
    device = dataclasses.replace(GPUS["H200"], efficiency=Efficiency(step_overhead_s=0.0, layer_overhead_s=0.0,
                                                                     collective_latency_s=0.0))
    stage = CostModel(TOY, device, Layout(tp=1), pad_batches=False)
    rows = [(1, 100)] * 8
    for pp, microbatches in ((2, 0), (4, 0), (4, 8)):
        layout = Layout(pp=pp, microbatches=microbatches)
        cost = CostModel(TOY, device, layout, pad_batches=False).step_cost([rows])
        m = layout.num_microbatches
        piece = stage.step_time([rows[: len(rows) // m]]) / pp  # equal pieces of a weight-bound decode batch
        assert cost.quantities["microbatches"] == m
        assert cost.quantities["bubble_fraction"] == pytest.approx((pp - 1) / (m + pp - 1), rel=1e-3)
        assert cost.time_s == pytest.approx((m + pp - 1) * piece, rel=1e-3)
    assert Layout.parse("pp4-mb8-tp2") == Layout(tp=2, pp=4, microbatches=8)
    assert Layout.parse("pp4-mb8-tp2").name == "pp4-mb8-tp2" and Layout.parse("pp2").gpus == 2
    with pytest.raises(InvalidRequestError, match="tp only"):
        Layout(pp=2, dp=2)


def test_pipeline_suits_cold_long_prefills_and_adds_bubbles_on_warm_turns():
    """DeepSeek-V4-Pro on 16 H200 (two 8-GPU NVLink domains): TP16 all-reduces cross the scale-out
    network; two TP8 stages only pass activations across it."""
    shape, device = FULL_SIZE_SHAPES["deepseek-v4-pro"](), GPUS["H200"]
    tp16 = CostModel(shape, device, Layout(tp=16), pad_batches=False)
    pp2 = CostModel(shape, device, Layout.parse("pp2-tp8"), pad_batches=False)
    cold = [[(8192, 64_000)]]  # a long prompt's chunk
    warm = [[(1, 100_000)] * 32]  # decodes between short cached turns
    assert pp2.step_time(cold) < tp16.step_time(cold) / 3
    assert pp2.step_time(warm) > tp16.step_time(warm)
    assert pp2.step_cost(warm).quantities["bubble_fraction"] == pytest.approx(1 / 3, rel=0.05)
    assert pp2.capacity().weight_bytes_per_gpu == pytest.approx(tp16.capacity().weight_bytes_per_gpu)


# ------------------------------------------------------------------ speculative decoding

def toy_speculation(rates, k=2) -> Speculation:
    shape = tiny_target().shape
    return Speculation("mtp", k, tuple(rates), mtp_module_shape(shape, shape.mixers[0][0], "tiny-mtp"), "test")


def test_acceptance_assumptions_and_the_drafter_cost():
    spec = Speculation("mtp", 3, (0.8, 0.5), mtp_module_shape(TOY, TOY.mixers[0][0], "toy-mtp"), "test")
    assert spec.expected_accepted == pytest.approx(0.8 + 0.8 * 0.5 + 0.8 * 0.5 * 0.5)
    sampler = AcceptanceSampler(spec, seed=1)
    draws = [sampler.accepted(3) for _ in range(4000)]
    assert sum(draws) / len(draws) == pytest.approx(spec.expected_accepted, rel=0.05)
    plain = CostModel(TOY, GPUS["H200"], pad_batches=False)
    drafting = CostModel(TOY, GPUS["H200"], pad_batches=False, speculation=spec)
    rows = [[(4, 1000)] * 8]
    cost = drafting.step_cost(rows, sampled=[[1004] * 8])
    assert cost.seconds["drafter"] > 0 and cost.time_s == pytest.approx(plain.step_time(rows) + cost.seconds["drafter"])
    assert drafting.capacity().kv_tokens_per_engine < plain.capacity().kv_tokens_per_engine  # the MTP layer's KV
    for name in ("deepseek-v4-pro", "minimax-m3", "kimi-k3"):
        stated = default_speculation(FULL_SIZE_SHAPES[name]())
        assert stated.source and stated.method == ("draft_model" if name == "kimi-k3" else "mtp")
    m3 = default_speculation(FULL_SIZE_SHAPES["minimax-m3"]()).draft_shape
    assert m3.total_params - m3.lm_head_params == pytest.approx(7.5e9, rel=0.03)  # ARCHITECTURES.md: +7.5B


def test_the_engine_verifies_drafts_as_extra_decode_tokens():
    log: list = []
    sure = simulate_agentx(SHORT, tiny_target(speculation=toy_speculation((1.0,))), synthetic_sessions(), step_log=log)
    assert sure["speculation"]["acceptance_rate"] == 1.0 and sure["errors"] == 0
    widths = {n for _, (rows,) in log for n, _ in rows}
    assert 3 in widths  # a decode row with its 2 drafts
    assert all(sum(n for n, _ in rows) <= 24 for _, (rows,) in log)  # the budget counts drafts
    never = simulate_agentx(SHORT, tiny_target(speculation=toy_speculation((0.0,))), synthetic_sessions())
    assert never["speculation"]["accepted_tokens"] == 0 and never["speculation"]["draft_tokens"] > 0
    assert sure["itl_p50_s"] < never["itl_p50_s"]  # accepted drafts arrive with their step's token


# ------------------------------------------------------------------ KV offload tiers

def test_an_offload_tier_keeps_kv_one_tier_away():
    small = tiny_target(kv_tokens=200)  # holds about one session of four
    plain = simulate_agentx(FOUR_LANES, small, synthetic_sessions(4))
    tiered = simulate_agentx(FOUR_LANES, dataclasses.replace(small, offload=OffloadPlan(host_gb=0.001)),
                             synthetic_sessions(4))
    assert tiered["hit_rate"] > plain["hit_rate"] + 0.2 and tiered["errors"] == 0
    offload = tiered["offload"]
    assert offload["pages_loaded"]["host"] > 0 and offload["pages_stored"]["host"] > 0
    model = small.cost_model()
    page_bytes = model.capacity().kv_bytes_per_token_per_gpu * small.engine.block_size
    rate = GPUS["H200"].host_link_bw * GPUS["H200"].efficiency.offload
    assert offload["link_busy_s"]["to_device"] == pytest.approx(offload["pages_loaded"]["host"] * page_bytes / rate)
    with pytest.raises(InvalidRequestError, match="host_gb or disk_gb"):
        OffloadPlan()


def test_a_disk_tier_serves_pages_the_host_tier_evicted():
    target = tiny_target(kv_tokens=200, offload=OffloadPlan(host_gb=0.0001, disk_gb=0.01))
    summary = simulate_agentx(FOUR_LANES, target, synthetic_sessions(4))
    assert summary["offload"]["pages_loaded"]["disk"] > 0 and summary["offload"]["link_busy_s"]["disk"] > 0


# ------------------------------------------------------------------ routing

def test_instances_and_dep_ranks_are_placed_by_the_router_policies():
    sessions = synthetic_sessions(4)
    config = dataclasses.replace(FOUR_LANES, duration_s=1.0)
    sticky = simulate_agentx(config, tiny_target(instances=2), sessions)
    queue = simulate_agentx(config, tiny_target(instances=2, router="queue"), sessions)
    assert sticky["num_gpus"] == 2 and sticky["errors"] == queue["errors"] == 0
    (placed,) = sticky["routing"]
    assert placed["policy"] == "sticky" and placed["decisions"]["session"] > 0
    assert sum(placed["requests_per_replica"]) == sum(placed["decisions"].values())
    assert queue["routing"][0]["decisions"] == {"least_loaded": sum(queue["routing"][0]["requests_per_replica"])}
    group, _ = build_instance(tiny_target(layout=Layout.parse("dep2")), VirtualClock())
    assert isinstance(group, LockstepEngines) and isinstance(group.placement.policy, StickyPolicy)
    queued, _ = build_instance(tiny_target(layout=Layout.parse("dep2"), router="queue"), VirtualClock())
    assert isinstance(queued.placement.policy, QueueDepthPolicy)
    with pytest.raises(InvalidRequestError, match="router"):
        tiny_target(router="pools")


# ------------------------------------------------------------------ the GPU table

def test_benchmarks_md_carries_the_generated_gpu_table():
    table = spec_table()
    assert table in (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    for device in GPUS.values():
        for name in ("host_memory_bytes", "host_link_bw", "disk_bytes", "disk_read_bw", "disk_write_bw"):
            assert getattr(device, name) > 0 and device.sources[name]


def test_sweep_flags_turn_the_options_on():
    from agentjax.bench.gpus import get_device
    from agentjax.bench.model_shapes import get_shape
    from agentjax.bench.sweep_cli import assumptions, options_from_args
    from agentjax.cli import build_parser

    args = build_parser().parse_args(["sweep", "simulate", "--model", "minimax-m3", "--gpu", "B300", "--spec-decode",
                                      "--spec-acceptance", "0.9,0.8", "--offload", "--instances", "2"])
    shape, device = get_shape(args.model), get_device(args.gpu)
    speculation, offload = options_from_args(args, shape, device)
    assert speculation.method == "mtp" and speculation.acceptance == (0.9, 0.8) and args.instances == 2
    assert offload.host_gb == pytest.approx(400) and offload.disk_gb == pytest.approx(3456)
    plain = build_parser().parse_args(["sweep", "simulate"])
    assert options_from_args(plain, shape, device) == (None, None)  # off by default
    notes = assumptions(shape, device, EngineConfig(), dataclasses.replace(CONFIG, traces="t"), True,
                        speculation, offload)
    assert any("0.9, 0.8" in note for note in notes) and any("host tier 400 GB" in note for note in notes)
