"""Tests of agentjax/kv/layout.py: packed views per group and the per-tensor padding comparison."""
from agentjax.kv import FullAttentionSpec, RecurrentStateSpec, SlidingWindowSpec, plan_groups
from agentjax.kv.layout import packed_layout, padding_report, preset_padding_reports

FULL = FullAttentionSpec(num_kv_heads=1, head_dim=8, dtype_bytes=2)  # 32 bytes per token


def test_each_group_packs_its_layers_back_to_back_in_one_page():
    sliding = SlidingWindowSpec(num_kv_heads=1, head_dim=8, dtype_bytes=2, sliding_window=32)
    plan = plan_groups([FULL, sliding, FULL, sliding], block_size=16)
    layout = packed_layout(plan, num_pages=10)
    assert layout.pool_shape == (10, 1024)
    full, window = layout.buffers
    assert [(v.layer, v.byte_offset, v.num_bytes) for v in full.views] == [(0, 0, 512), (2, 512, 512)]
    assert [v.layer for v in window.views] == [1, 3] and full.padding_bytes == window.padding_bytes == 0


def test_packing_saves_the_unification_padding_of_a_per_tensor_layout():
    state = RecurrentStateSpec(bytes_per_state=1588, checkpoint_interval=64)
    plan = plan_groups([FULL, FULL, FULL, state], block_size=16)
    assert plan.page_bytes == 3072 and plan.groups[0].tokens_per_page == 32  # 3 layers x 32 tokens x 32 B
    report = padding_report("toy", plan)
    assert report.payload_bytes == 3072 + 1588
    assert report.per_tensor_bytes == 4 * 1588  # every layer's 1024-byte page padded to the 1588-byte state
    assert report.packed_bytes == 2 * 3072
    assert round(report.saving, 4) == round(1 - 6144 / 6352, 4)


def test_every_preset_gets_a_padding_report():
    reports = {r.preset: r for r in preset_padding_reports()}
    assert set(reports) == {"DeepSeek-V4-Pro", "Kimi-K3", "MiniMax-M3"}
    assert all(r.payload_bytes <= min(r.packed_bytes, r.per_tensor_bytes) for r in reports.values())
