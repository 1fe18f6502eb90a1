"""The static plan of a decoder's layers: each layer's kind, and the scanned segments they form.

Layers of the same kind (token mixer, feed-forward kind, window, RoPE, KV groups) share a body. The
layer sequence is cut into segments, each a short period of layers repeated several times (SmolLM2:
one layer x 30; Gemma-3: 5 sliding + 1 full, x 3; Kimi: 3 KDA + 1 MLA, ...), and a segment runs
under `lax.scan` over its repeats, so a step compiles one body per period position, never a
Python branch per model. Host only: plain Python, no jax.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from agentjax.kv.cache_layout import kv_slots

# Longest period the segment planner looks for (DeepSeek-V4 alternates 2, Kimi 4, Gemma-3 6).
MAX_PERIOD = 8


@dataclass(frozen=True)
class LayerKind:
    """Everything static that distinguishes a layer's body; equal kinds share compiled code."""

    mixer: str  # the layer type: full_attention, sliding_attention, block_sparse_attention, mla, kda
    mlp: str  # dense or moe
    window: int | None
    rope: tuple  # (theta, scaling) of the layer's RoPE
    kv_groups: tuple[tuple[str, int], ...]  # (role, KV group id) of each KV tensor the layer owns


@dataclass(frozen=True)
class Segment:
    """Layers `start + rep * period + j` for `rep < repeats`, `j < period`, run as one scan."""

    start: int
    period: int
    repeats: int

    def layer(self, rep: int, position: int) -> int:
        return self.start + rep * self.period + position

    @property
    def end(self) -> int:
        return self.start + self.period * self.repeats


def layer_kinds(cfg) -> list[LayerKind]:
    slots = kv_slots(cfg)
    kinds = []
    for layer in range(cfg.num_layers):
        groups = tuple(sorted((role, group) for (owner, role), (group, _) in slots.items() if owner == layer))
        kinds.append(LayerKind(cfg.layer_types[layer], cfg.mlp_layer_types[layer], cfg.layer_window(layer),
                               (cfg.layer_rope_theta(layer), cfg.layer_rope_scaling(layer)), groups))
    return kinds


def plan_segments(kinds: list[LayerKind], max_period: int = MAX_PERIOD) -> list[Segment]:
    """Greedy cover of the layers by repeated periods: at each point take the period that covers the
    most layers (the shortest on ties)."""
    segments, start, n = [], 0, len(kinds)
    while start < n:
        best = (1, 1)
        for period in range(1, min(max_period, n - start) + 1):
            pattern = kinds[start:start + period]
            repeats = 1
            while kinds[start + repeats * period:start + (repeats + 1) * period] == pattern:
                repeats += 1
            if period * repeats > best[0] * best[1]:
                best = (period, repeats)
        segments.append(Segment(start, *best))
        start += best[0] * best[1]
    return segments


@functools.lru_cache(maxsize=64)
def segments_of(cfg) -> list[Segment]:
    return plan_segments(layer_kinds(cfg))


def segment_slot_table(cfg, segment: Segment, position: int) -> dict[str, np.ndarray]:
    """Role -> int32 `[repeats]` slot of that period position's KV tensor in each repeat."""
    slots = kv_slots(cfg)
    roles = sorted(role for (owner, role) in slots if owner == segment.layer(0, position))
    return {role: np.asarray([slots[(segment.layer(rep, position), role)][1] for rep in range(segment.repeats)],
                             np.int32) for role in roles}


def per_layer_names(cfg, name: str) -> list[str]:
    """Checkpoint names behind one model parameter: `segments.{k}.blocks.{j}.X` (stacked over repeats)
    is `layers.{i}.X` for each layer i it holds; other names map to themselves."""
    parts = name.split(".", 4)
    if parts[0] != "segments":
        return [name]
    segment = segments_of(cfg)[int(parts[1])]
    return [f"layers.{segment.layer(rep, int(parts[3]))}.{parts[4]}" for rep in range(segment.repeats)]
