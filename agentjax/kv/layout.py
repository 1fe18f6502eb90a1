"""The packed device layout of the KV pool: one byte view per group over one pool of equal pages.

Page ids are shared by all groups, so the device holds one `[num_pages, page_bytes]` uint8 pool and
each group reads it through its own buffer view, in which layer l's slice of a page starts at a
fixed byte offset (not one buffer per layer per tensor type). This module only computes offsets and
byte counts; the runner builds arrays from them. Host only: never imports jax.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agentjax.kv.specs import (CompressedLatentSpec, FullAttentionSpec, IndexerKeySpec, KVGroupPlan, KVSpec,
                               MLALatentSpec, RecurrentStateSpec, RollingStateSpec, SlidingWindowSpec, plan_groups)


@dataclass(frozen=True)
class LayerView:
    """Layer `layer`'s bytes inside a page of its group: [byte_offset, byte_offset + num_bytes)."""

    layer: int
    byte_offset: int
    num_bytes: int


@dataclass(frozen=True)
class GroupBuffer:
    group_id: int
    kind: str
    tokens_per_page: int
    views: tuple[LayerView, ...]
    used_bytes: int  # end of the last view
    padding_bytes: int  # page_bytes - used_bytes


@dataclass(frozen=True)
class PackedLayout:
    page_bytes: int
    num_pages: int
    buffers: tuple[GroupBuffer, ...]

    @property
    def pool_shape(self) -> tuple[int, int]:
        return (self.num_pages, self.page_bytes)

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.page_bytes


def _align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def _layer_page_bytes(spec: KVSpec, tokens_per_page: int) -> int:
    return spec.state_bytes if spec.hit_rule == "checkpoint" else spec.bytes_for_tokens(tokens_per_page)


def packed_layout(plan: KVGroupPlan, num_pages: int, view_alignment: int = 64) -> PackedLayout:
    """Offsets of every layer's view in its group's page; views start on `view_alignment` bytes."""
    buffers, page_bytes = [], plan.page_bytes
    for group in plan.groups:
        offset, views = 0, []
        for layer in group.layer_indices:
            size = _layer_page_bytes(group.spec, group.tokens_per_page)
            offset = _align(offset, view_alignment)
            views.append(LayerView(layer, offset, size))
            offset += size
        buffers.append((group, tuple(views), offset))
        page_bytes = max(page_bytes, offset)
    return PackedLayout(page_bytes, num_pages, tuple(
        GroupBuffer(g.group_id, g.spec.kind, g.tokens_per_page, views, used, page_bytes - used)
        for g, views, used in buffers))


@dataclass(frozen=True)
class PaddingReport:
    """Bytes per page id of the whole model: payload, and what each layout spends on it."""

    preset: str
    payload_bytes: int
    packed_bytes: int
    per_tensor_bytes: int

    @property
    def saving(self) -> float:
        """The share of the per-tensor layout's bytes that packing saves."""
        return 1 - self.packed_bytes / self.per_tensor_bytes


def padding_report(preset: str, plan: KVGroupPlan, tensor_alignment: int = 1, view_alignment: int = 64) -> PaddingReport:
    """Per-tensor layout: every layer's tensor is its own buffer whose page is padded to
    `tensor_alignment` and then to the largest such page of the model, because one page id indexes
    every buffer. Packed: each group's page holds its layers back to back, padded once to the
    pool's page size. Both are counted for one page id of every group."""
    layer_pages = [(g, _layer_page_bytes(g.spec, g.tokens_per_page)) for g in plan.groups]
    payload = sum(g.num_layers * size for g, size in layer_pages)
    largest = max(_align(size, tensor_alignment) for _, size in layer_pages)
    per_tensor = sum(g.num_layers * largest for g, _ in layer_pages)
    packed = packed_layout(plan, 1, view_alignment)
    return PaddingReport(preset, payload, packed.page_bytes * len(plan.groups), per_tensor)


def preset_layer_specs() -> dict[str, list[KVSpec]]:
    """Per-layer KV specs of the three target families (ARCHITECTURES.md), full size."""
    swa = SlidingWindowSpec(num_kv_heads=1, head_dim=292, dtype_bytes=2, sliding_window=128)  # 584 B/token
    c4 = CompressedLatentSpec(ratio=4, entry_bytes=584)
    c128 = CompressedLatentSpec(ratio=128, entry_bytes=584)
    index_c4 = IndexerKeySpec(ratio=4, entry_bytes=132)
    csa_state = RollingStateSpec(ratio=1, entry_bytes=8192, state_window=8)
    hca_state = RollingStateSpec(ratio=1, entry_bytes=4096, state_window=128)
    index_state = RollingStateSpec(ratio=1, entry_bytes=2048, state_window=8)
    dsv4: list[KVSpec] = []
    for layer in range(61):  # layers 0-1 HCA, then CSA at even and HCA at odd layers
        csa = layer >= 2 and layer % 2 == 0
        dsv4 += [swa, c4, index_c4, csa_state, index_state] if csa else [swa, c128, hca_state]
    mla = MLALatentSpec(latent_dim=512, rope_dim=64, dtype_bytes=2)
    kda = RecurrentStateSpec(bytes_per_state=96 * 128 * 128 * 4 + 36864 * 3 * 2, checkpoint_interval=4096)
    kimi = [mla if (i % 4 == 3 or i == 92) else kda for i in range(93)]
    dense = FullAttentionSpec(num_kv_heads=4, head_dim=128, dtype_bytes=2, required_page_tokens=128)
    index_m3 = IndexerKeySpec(ratio=1, entry_bytes=256, required_page_tokens=128)
    minimax = [dense] * 3 + [dense, index_m3] * 57
    return {"DeepSeek-V4-Pro": dsv4, "Kimi-K3": kimi, "MiniMax-M3": minimax}


def preset_padding_reports(block_size: int = 16, tensor_alignments: dict[str, int] | None = None) -> list[PaddingReport]:
    """`padding_report` for every preset; DeepSeek-V4 tensors align to 576 bytes (fp8_ds_mla)."""
    alignments = tensor_alignments or {"DeepSeek-V4-Pro": 576}
    reports = []
    for name, specs in preset_layer_specs().items():
        size = 128 if name == "MiniMax-M3" else (256 if name == "DeepSeek-V4-Pro" else block_size)
        reports.append(padding_report(name, plan_groups(specs, size), alignments.get(name, 1)))
    return reports


def layout_for_specs(layer_specs: Sequence[KVSpec], block_size: int, num_pages: int) -> PackedLayout:
    return packed_layout(plan_groups(layer_specs, block_size), num_pages)
