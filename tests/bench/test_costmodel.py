"""The roofline cost model against hand-computed FLOPs and bytes, and ARCHITECTURES.md section 6."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from agentjax.bench.cost_terms import Layout
from agentjax.bench.costmodel import CostModel, fit_efficiency, scale_efficiency
from agentjax.bench.gpus import CPU, GPUS, Efficiency, get_device
from agentjax.bench.model_shapes import (FULL_SIZE_SHAPES, KeyStream, Mixer, ModelShape, MoEShape, gqa,
                                         shape_from_model_config)
from agentjax.errors import InvalidRequestError
from agentjax.models.presets import PRESETS

# A toy model: one GQA layer (2 heads, 1 KV head, head dim 4, 2-byte KV), 100 dense parameters,
# a 16 x 8 LM head, 1-byte weights.
TOY = ModelShape(name="toy", hidden=8, vocab=16, mixers=((gqa(2, 1, 4, 2.0), 1),), dense_params=100,
                 dense_bytes_per_param=1.0, lm_head_params=128, lm_head_bytes_per_param=1.0,
                 embedding_params=0, moe=None, page_tokens=16, max_context=1024)


def toy_model(**options) -> CostModel:
    return CostModel(TOY, GPUS["H200"], pad_batches=False, **options)


def test_decode_row_flops_and_bytes_by_hand():
    q = toy_model()._rank_quantities([(1, 9)])  # one query at position 9: it sees 10 keys
    assert q["attn_flops"] == 4 * 2 * 4 * 10  # QK and PV, 2 FLOPs per multiply-add, per head and channel
    assert q["kv_bytes"] == 10 * (2 * 1 * 4 * 2) + 1 * 16  # read 10 K/V entries, write the new one
    assert q["dense_flops"] == 2 * 100 and q["lm_flops"] == 2 * 128


def test_prefill_chunk_with_cached_context_by_hand():
    q = toy_model()._rank_quantities([(3, 2)])  # positions 2, 3, 4 see 3, 4 and 5 keys
    assert q["attn_flops"] == 4 * 2 * 4 * (3 + 4 + 5)
    assert q["kv_bytes"] == 5 * 16 + 3 * 16  # one query tile reads the 5 keys once, writes 3 entries
    assert q["dense_flops"] == 2 * 100 * 3


def test_key_stream_window_ratio_and_topk():
    window = KeyStream(1.0, 1.0, window=4)
    compressed = KeyStream(1.0, 1.0, ratio=4, topk=2)
    assert window.entries(np.array([2, 10])).tolist() == [2, 4]
    assert compressed.entries(np.array([3, 10, 13, 100])).tolist() == [0, 2, 2, 2]
    assert compressed.stored_bytes_per_token == 0.25 and window.stored_bytes_per_token == 0.0
    assert window.bounded_bytes == 4.0


def test_mla_rows_take_the_cheaper_of_absorbed_and_expanded():
    stream = KeyStream(flops_per_entry=100.0, bytes_per_entry=1.0, expand_flops_per_entry=1000.0,
                       expanded_flops_per_entry=10.0)
    shape = dataclasses.replace(TOY, mixers=((Mixer("mla", (stream,)), 1),))
    model = CostModel(shape, GPUS["H200"], pad_batches=False)
    decode = model._rank_quantities([(1, 999)])["attn_flops"]
    assert decode == 100.0 * 1000  # absorbed: 1000 keys x 100 < expanding 1000 entries x 1000
    prefill = model._rank_quantities([(100, 900)])["attn_flops"]
    seen = sum(range(901, 1001))
    assert prefill == min(100.0 * seen, 1000 * 1000.0 + 10.0 * seen)
    assert prefill < 100.0 * seen


@pytest.mark.parametrize("name, length, attention_gflop, read_mb", [
    ("deepseek-v4-pro", 8192, 11.6, 31.8), ("deepseek-v4-pro", 131072, 34.5, 171),
    ("deepseek-v4-pro", 1 << 20, 205.5, 1209),
    ("kimi-k3", 8192, 41.9, 113), ("kimi-k3", 131072, 658, 1812), ("kimi-k3", 1 << 20, 5258, 14496),
    ("minimax-m3", 8192, 5.1, 204), ("minimax-m3", 131072, 24.4, 1479), ("minimax-m3", 1 << 20, 168.1, 10991),
])
def test_full_size_decode_matches_architectures_section_6(name, length, attention_gflop, read_mb):
    model = CostModel(FULL_SIZE_SHAPES[name](), GPUS["B300"], pad_batches=False)
    q = model._rank_quantities([(1, length - 1)])
    assert q["attn_flops"] / 1e9 == pytest.approx(attention_gflop, rel=0.01)
    assert q["kv_bytes"] / 1e6 == pytest.approx(read_mb, rel=0.01)


@pytest.mark.parametrize("name, active_b, total_b, kv_bytes", [
    ("deepseek-v4-pro", 49.8, 1573.0, 5511), ("kimi-k3", 105.4, 2779.5, 13824), ("minimax-m3", 26.0, 426.2, 68736)])
def test_full_size_parameter_counts_match_architectures(name, active_b, total_b, kv_bytes):
    shape = FULL_SIZE_SHAPES[name]()
    assert shape.active_params / 1e9 == pytest.approx(active_b, rel=0.01)
    assert shape.total_params / 1e9 == pytest.approx(total_b, rel=0.01)
    assert shape.kv_bytes_per_token == pytest.approx(kv_bytes, rel=0.001)


def test_kimi_state_is_read_and_written_every_step_per_row():
    model = CostModel(FULL_SIZE_SHAPES["kimi-k3"](), GPUS["GB300"], pad_batches=False)
    one, four = (model._rank_quantities([(1, 1000)] * rows)["state_bytes"] for rows in (1, 4))
    assert four == 4 * one and one == pytest.approx(2 * 449.4e6, rel=0.01)


def test_layout_parse_and_names():
    assert Layout.parse("tp8") == Layout(tp=8)
    assert Layout.parse("dep8") == Layout(dp=8, ep=8)
    assert Layout.parse("tp8-dcp8") == Layout(tp=8, dcp=8)
    assert Layout.parse("pcp2-tp4").gpus == 8
    assert [Layout.parse(t).name for t in ("tp8", "dep8", "tp8-dcp8", "pcp2-tp4")] == ["tp8", "dep8", "tp8-dcp8", "tp4-pcp2"]
    with pytest.raises(InvalidRequestError, match="dcp=3 must divide tp=4"):
        Layout(tp=4, dcp=3)
    with pytest.raises(InvalidRequestError, match="tq2"):
        Layout.parse("tq2")


def test_tensor_parallel_splits_compute_and_adds_all_reduces():
    shape = dataclasses.replace(TOY, activation_bytes=2.0)
    one = CostModel(shape, GPUS["H200"], Layout(tp=1), pad_batches=False).step_cost([[(64, 0)]])
    two = CostModel(shape, GPUS["H200"], Layout(tp=2), pad_batches=False).step_cost([[(64, 0)]])
    assert one.quantities["comm_bytes"] == 0
    # one layer, two all-reduces of 64 tokens x 8 x 2 bytes, ring: 2 (t - 1) / t of it each
    assert two.quantities["comm_bytes"] == 2 * 2 * (1 / 2) * 64 * 8 * 2
    assert two.seconds["dense"] < one.seconds["dense"]


def test_expert_reads_follow_the_distinct_experts_touched():
    moe = MoEShape(layers=1, experts=8, top_k=2, params_per_expert=1e6, bytes_per_param=1.0)
    shape = dataclasses.replace(TOY, moe=moe)
    device = dataclasses.replace(GPUS["H200"], efficiency=Efficiency(memory=1.0, compute=1.0, step_overhead_s=0,
                                                                     layer_overhead_s=0))
    for tokens in (1, 3):
        cost = CostModel(shape, device, pad_batches=False).step_cost([[(tokens, 0)]])
        touched = 8 * (1 - (1 - 2 / 8) ** tokens)
        assert cost.seconds["experts"] == pytest.approx(max(touched * 1e6 / device.hbm_bw,
                                                            2 * 2 * 1e6 * tokens / device.fp8_flops))


def test_roofline_takes_the_max_and_the_cpu_adds():
    roof = dataclasses.replace(GPUS["H200"], efficiency=Efficiency(compute=1, memory=1, step_overhead_s=0,
                                                                   layer_overhead_s=0))
    added = roof.with_efficiency(dataclasses.replace(roof.efficiency, overlap=False))
    a = CostModel(TOY, roof, pad_batches=False).step_cost([[(1, 9)]]).seconds["dense"]
    b = CostModel(TOY, added, pad_batches=False).step_cost([[(1, 9)]]).seconds["dense"]
    flops_s, bytes_s = 200 / roof.fp8_flops, 100 / roof.hbm_bw
    assert a == pytest.approx(max(flops_s, bytes_s)) and b == pytest.approx(flops_s + bytes_s)


def test_reference_kernel_mixed_tile_reads_per_slot():
    model = CostModel(TOY, CPU, kernel="reference")  # padded: 4 decode rows -> 8 tokens, one tile
    q = model._rank_quantities([(1, 100)] * 4)
    keys = 128  # max position 100 -> two 64-key blocks
    assert q["kv_bytes"] == 8 * keys * 16
    alone = model._rank_quantities([(16, 100)])  # one row fills the tile: keys gathered once
    assert alone["kv_bytes"] == 1 * keys * 16


def test_capacity_counts_weights_and_kv_per_gpu():
    shape = FULL_SIZE_SHAPES["minimax-m3"]()
    cap = CostModel(shape, GPUS["B300"], Layout(tp=2)).capacity()
    weights = shape.weight_bytes()
    assert cap.weight_bytes_per_gpu == pytest.approx(sum(weights.values()) / 2)
    assert cap.kv_bytes_per_token_per_gpu == pytest.approx(3 * 1024 / 2 + 57 * (1024 / 2 + 128))
    assert cap.feasible
    assert not CostModel(FULL_SIZE_SHAPES["kimi-k3"](), GPUS["B300"], Layout(tp=1)).capacity().feasible


def test_fit_efficiency_recovers_known_factors():
    truth = Efficiency(compute=0.3, attention_compute=0.05, kv_memory=0.2, memory=1e9, step_overhead_s=0.01,
                       loop_overhead_s=2e-4, layer_overhead_s=0.0, collective_latency_s=0.0, overlap=False)
    model = CostModel(shape_from_model_config(PRESETS["tiny-dense"]), CPU.with_efficiency(truth), kernel="reference")
    shapes = [[(16, 0)], [(512, 0)], [(64, 2000)], [(1, 500)] * 4, [(1, 3000)] * 8, [(200, 100), (1, 900)],
              [(40, 5000)], [(2048, 1000)]]
    samples = [(rows, model.step_time([rows])) for rows in shapes]
    fitted = fit_efficiency(model, samples)
    assert fitted.compute == pytest.approx(0.3, rel=1e-3)
    assert fitted.attention_compute == pytest.approx(0.05, rel=1e-3)
    assert fitted.kv_memory == pytest.approx(0.2, rel=1e-3)
    assert fitted.step_overhead_s == pytest.approx(0.01, rel=1e-3)
    assert fitted.loop_overhead_s == pytest.approx(2e-4, rel=1e-3)
    slower = scale_efficiency(fitted, 2.0)
    model.efficiency = fitted
    fast = model.step_time([shapes[2]])
    model.efficiency = slower
    assert model.step_time([shapes[2]]) == pytest.approx(2 * fast)


def test_shape_from_a_preset_counts_its_parameters():
    cfg = PRESETS["tiny-dense"]
    shape = shape_from_model_config(cfg)
    per_layer = 64 * 16 * (2 * 4 + 2 * 2) + 3 * 64 * 128
    assert shape.dense_params == 2 * per_layer
    assert shape.kv_bytes_per_token == 2 * (2 * 2 * 16 * 4)  # 2 layers, K and V, 2 heads x 16, float32


def test_get_device_reads_an_efficiency_file(tmp_path):
    path = tmp_path / "eff.json"
    path.write_text('{"efficiency": {"compute": 0.25, "overlap": false}}')
    device = get_device("b300", path)
    assert device.name == "B300" and device.efficiency.compute == 0.25 and not device.efficiency.overlap
    with pytest.raises(InvalidRequestError, match="unknown device"):
        get_device("A100")


def test_the_minimax_m3_table_agrees_with_the_full_size_preset():
    from agentjax.models.presets import preset_config

    table = FULL_SIZE_SHAPES["minimax-m3"]()
    derived = shape_from_model_config(preset_config("minimax-m3", abstract=True), page_tokens=128)
    assert derived.dense_params == table.dense_params
    assert derived.routed_params == table.routed_params
    assert derived.lm_head_params == table.lm_head_params
    # the preset is BF16 (2 bytes a value); the table assumes fp8 KV and index (1 byte)
    assert derived.kv_bytes_per_token == 2 * table.kv_bytes_per_token


@pytest.mark.parametrize("rows", [1, 3, 5, 8, 9, 17, 24, 33, 100, 200, 256])
def test_the_planner_pads_a_decode_step_as_the_engine_pads_it(rows):
    """The cost model's padded shape of a decode step is the (tokens, rows) shape `RaggedBatch.build`
    gives the runner: the planner reads the engine's buckets."""
    from agentjax.ragged_batch import RaggedBatch

    decodes = [(1, 100 + row) for row in range(rows)]
    batch = RaggedBatch.build([([7], 100 + row, list(range(1, 1 + 8 + row // 16))) for row in range(rows)], 16)
    model = CostModel(TOY, GPUS["H200"])
    assert model.padded_shape([decodes]) == (batch.num_tokens, batch.num_seqs)
    assert model.step_cost([decodes]).quantities["tokens"] == batch.num_tokens
    assert CostModel(TOY, GPUS["H200"], pad_batches=False).padded_shape([decodes]) is None


def test_lockstep_ranks_are_charged_the_common_padded_shape():
    """DEP ranks run one shape, the largest rank's bucketed (the runners' `lockstep_buckets`): a rank with
    3 decode rows next to one with 24 runs 32 token slots, an idle rank a dummy row padded as far."""
    model = CostModel(TOY, GPUS["H200"], Layout.parse("dep2"))
    busy, light = [(1, 50)] * 24, [(1, 50)] * 3
    assert model.padded_shape([busy, light]) == (32, 32)
    cost = model.step_cost([busy, light])
    assert len(cost.rank_times_s) == 2
    assert model._rank_quantities(light, model.padded_shape([busy, light]))["tokens"] == 32
    assert model._rank_quantities([], model.padded_shape([busy, []]))["dense_flops"] == 2 * 100 * 32
    assert model.padded_shape([[], []]) is None
