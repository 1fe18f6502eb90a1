"""One KV spec per attention kind, and the plan that gives every group the same page size in bytes.

A spec says how many bytes one layer stores per token (or per sequence, for a recurrent state) and
which prefix-hit rule its group follows: "prefix" (all earlier tokens), "window" (only the last
`window` tokens) or "checkpoint" (a fixed state saved at chosen block boundaries). A new model adds
a spec here, never a branch in the manager. Host only: never imports jax.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

from agentjax.errors import InvalidRequestError

HitRule = Literal["prefix", "window", "checkpoint"]

# An FP8 KV row (`kv_cache_dtype="fp8"`): its float8_e4m3fn values, then the row's float32 scale.
FP8_SCALE_BYTES = 4


def fp8_row_bytes(width: int, word_bytes: int) -> int:
    """Stored bytes of one FP8 row of `width` values (one token's K or V head, or one MLA latent row):
    a byte per value and the 4-byte scale, padded to whole words of the KV memory (at least 4 bytes)."""
    unit = max(FP8_SCALE_BYTES, word_bytes)
    return -(-(width + FP8_SCALE_BYTES) // unit) * unit


@dataclass(frozen=True)
class KVSpec:
    """Base of all specs; subclasses are frozen, so equal specs put layers in one group."""

    kind: ClassVar[str] = "abstract"
    hit_rule: ClassVar[HitRule] = "prefix"
    token_granular: ClassVar[bool] = True  # any token count can be a hit (not only whole entries)
    required_page_tokens: int | None = None  # a kernel demands exactly this many tokens per page
    # Which model stores it: 0 the served model, 1 a speculative-decoding draft model (specs of two
    # models never share a group, so each model's groups keep their own buffers and tables).
    owner: int = 0

    @property
    def tokens_per_entry(self) -> int:
        return 1

    @property
    def window(self) -> int | None:
        return None

    def bytes_for_tokens(self, num_tokens: int) -> int:
        """Bytes one layer stores for `num_tokens` tokens (a multiple of tokens_per_entry)."""
        raise NotImplementedError

    @property
    def state_bytes(self) -> int:
        """Bytes of one fixed-size per-sequence state of one layer ("checkpoint" specs only)."""
        raise NotImplementedError


@dataclass(frozen=True)
class FullAttentionSpec(KVSpec):
    """K and V of every token (GQA/MHA/MQA); `fp8`: each head's row as FP8 values and a scale
    (`fp8_row_bytes`, padded to `dtype_bytes` words)."""

    kind: ClassVar[str] = "full_attention"
    num_kv_heads: int = 1
    head_dim: int = 64
    dtype_bytes: int = 2
    fp8: bool = False

    def bytes_for_tokens(self, num_tokens: int) -> int:
        row = fp8_row_bytes(self.head_dim, self.dtype_bytes) if self.fp8 else self.head_dim * self.dtype_bytes
        return 2 * self.num_kv_heads * row * num_tokens


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """K and V of the last `sliding_window` tokens only."""

    kind: ClassVar[str] = "sliding_window"
    hit_rule: ClassVar[HitRule] = "window"
    sliding_window: int = 128

    @property
    def window(self) -> int | None:
        return self.sliding_window


@dataclass(frozen=True)
class MLALatentSpec(KVSpec):
    """One shared latent (K = V) per token, as in MLA: `latent_dim + rope_dim` values (`fp8`: as FP8
    values and a scale, `fp8_row_bytes`)."""

    kind: ClassVar[str] = "mla_latent"
    latent_dim: int = 512
    rope_dim: int = 64
    dtype_bytes: int = 2
    fp8: bool = False

    def bytes_for_tokens(self, num_tokens: int) -> int:
        width = self.latent_dim + self.rope_dim
        row = fp8_row_bytes(width, self.dtype_bytes) if self.fp8 else width * self.dtype_bytes
        return row * num_tokens


@dataclass(frozen=True)
class CompressedLatentSpec(KVSpec):
    """One stored entry per `ratio` tokens (DeepSeek-V4 CSA 4:1, HCA 128:1); hits are whole pages."""

    kind: ClassVar[str] = "compressed_latent"
    token_granular: ClassVar[bool] = False
    ratio: int = 4
    entry_bytes: int = 584

    @property
    def tokens_per_entry(self) -> int:
        return self.ratio

    def bytes_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.ratio) * self.entry_bytes


@dataclass(frozen=True)
class IndexerKeySpec(CompressedLatentSpec):
    """Keys of a sparse-attention indexer (DeepSeek-V4 at ratio 4, MiniMax-M3 at ratio 1)."""

    kind: ClassVar[str] = "indexer_keys"
    ratio: int = 1
    entry_bytes: int = 256

    @property
    def token_granular(self) -> bool:  # one key per token: a hit may end anywhere, like full attention
        return self.ratio == 1


@dataclass(frozen=True)
class RollingStateSpec(CompressedLatentSpec):
    """A compressor's bounded state: entries for the last `state_window` tokens, like a window."""

    kind: ClassVar[str] = "rolling_state"
    hit_rule: ClassVar[HitRule] = "window"
    state_window: int = 128

    @property
    def window(self) -> int | None:
        return self.state_window


@dataclass(frozen=True)
class SlidingLatentSpec(RollingStateSpec):
    """One shared K=V row per token for the last `state_window` tokens (DeepSeek-V4's sliding-window
    MQA rows, vLLM's SlidingWindowMLASpec); like a sliding window, a hit may end on any token."""

    kind: ClassVar[str] = "sliding_latent"
    token_granular: ClassVar[bool] = True


@dataclass(frozen=True)
class RecurrentStateSpec(KVSpec):
    """A fixed-size state per sequence (linear attention, KDA, Mamba), saved every
    `checkpoint_interval` tokens when the engine asks; a hit must land on a saved checkpoint."""

    kind: ClassVar[str] = "recurrent_state"
    hit_rule: ClassVar[HitRule] = "checkpoint"
    token_granular: ClassVar[bool] = False
    bytes_per_state: int = 4096
    checkpoint_interval: int = 64

    @property
    def state_bytes(self) -> int:
        return self.bytes_per_state


@dataclass(frozen=True)
class PackedSpec(KVSpec):
    """Several "prefix" kinds that grow together, packed in one page group ("pool" layouts,
    agentjax/kv/layout.py): a page holds its tokens of every layer of every member; a hit must end on
    whole entries of every member."""

    kind: ClassVar[str] = "packed"
    members: tuple[tuple[KVSpec, int], ...] = ()  # (spec, layers)

    @property
    def token_granular(self) -> bool:  # type: ignore[override]
        return all(spec.token_granular for spec, _ in self.members)

    @property
    def tokens_per_entry(self) -> int:
        return math.lcm(*(spec.tokens_per_entry for spec, _ in self.members))

    def bytes_for_tokens(self, num_tokens: int) -> int:
        return sum(layers * spec.bytes_for_tokens(num_tokens) for spec, layers in self.members)


@dataclass(frozen=True)
class KVGroup:
    """Layers that share one spec; each of their pages holds `tokens_per_page` tokens of all of them."""

    group_id: int
    spec: KVSpec
    layer_indices: tuple[int, ...]
    tokens_per_page: int  # for "checkpoint" groups: the checkpoint interval
    used_bytes_per_page: int

    @property
    def num_layers(self) -> int:
        return len(self.layer_indices)


@dataclass(frozen=True)
class KVGroupPlan:
    """Every group of a model, the common page size in bytes and the base hash block size."""

    groups: tuple[KVGroup, ...]
    page_bytes: int
    hash_block_size: int

    def padding_bytes_per_page(self, group_id: int) -> int:
        return self.page_bytes - self.groups[group_id].used_bytes_per_page


def group_layers(layer_specs: Sequence[KVSpec]) -> list[tuple[KVSpec, tuple[int, ...]]]:
    """Layers of equal spec form a group; groups keep the order in which their spec first appears."""
    order: dict[KVSpec, list[int]] = {}
    for index, spec in enumerate(layer_specs):
        order.setdefault(spec, []).append(index)
    return [(spec, tuple(layers)) for spec, layers in order.items()]


def plan_groups(layer_specs: Sequence[KVSpec], block_size: int, scale_tokens_per_page: bool = True) -> KVGroupPlan:
    """Unify page sizes: attention groups scale their tokens per page, state pages are padded.

    The page size is the largest attention group's bytes for `block_size` tokens (or its required
    page tokens), multiplied up until the largest state fits. Every token-scaled group then takes
    the most tokens (a multiple of `block_size` and of its entry ratio) that fit in one page; with
    `scale_tokens_per_page=False` each takes only its smallest unit and pads the rest of the page.
    """
    if block_size < 1:
        raise InvalidRequestError(f"block_size must be >= 1, got {block_size}")
    if not layer_specs:
        raise InvalidRequestError("a KV plan needs at least one layer spec")
    grouped = group_layers(layer_specs)
    scaled = [(spec, layers) for spec, layers in grouped if spec.hit_rule != "checkpoint"]
    states = [(spec, layers) for spec, layers in grouped if spec.hit_rule == "checkpoint"]
    for spec, _ in states:
        if spec.checkpoint_interval % block_size:
            raise InvalidRequestError(
                f"checkpoint_interval={spec.checkpoint_interval} must be a multiple of block_size={block_size}")

    def unit(spec: KVSpec) -> int:
        return math.lcm(block_size, spec.tokens_per_entry)

    required = {spec.required_page_tokens for spec, _ in scaled if spec.required_page_tokens}
    page_bytes = 0
    for spec, layers in scaled:
        if spec.required_page_tokens:
            if spec.required_page_tokens % unit(spec):
                raise InvalidRequestError(
                    f"{spec.kind} requires {spec.required_page_tokens} tokens per page, which is not a "
                    f"multiple of block_size={block_size} and ratio={spec.tokens_per_entry}")
            # Several required sizes: the largest page wins and the other groups pad theirs.
            page_bytes = max(page_bytes, len(layers) * spec.bytes_for_tokens(spec.required_page_tokens))
    if not required:
        page_bytes = max((len(layers) * spec.bytes_for_tokens(unit(spec)) for spec, layers in scaled), default=0)
    largest_state = max((len(layers) * spec.state_bytes for spec, layers in states), default=0)
    if largest_state > page_bytes:
        if required and page_bytes:
            raise InvalidRequestError(
                f"a {largest_state}-byte state does not fit the required {page_bytes}-byte page")
        page_bytes = page_bytes * -(-largest_state // page_bytes) if page_bytes else largest_state

    groups = []
    for group_id, (spec, layers) in enumerate(grouped):
        if spec.hit_rule == "checkpoint":
            tokens, used = spec.checkpoint_interval, len(layers) * spec.state_bytes
        elif spec.required_page_tokens:
            tokens = spec.required_page_tokens
            used = len(layers) * spec.bytes_for_tokens(tokens)
            if used > page_bytes:
                raise InvalidRequestError(f"{spec.kind} needs {used} bytes per page, the page has {page_bytes}")
        else:
            step = unit(spec)
            tokens = step * (page_bytes // (len(layers) * spec.bytes_for_tokens(step)))
            if not scale_tokens_per_page:
                tokens = min(tokens, step)
            while tokens > step and len(layers) * spec.bytes_for_tokens(tokens) > page_bytes:
                tokens -= step
            if tokens == 0:
                raise InvalidRequestError(f"{spec.kind} group cannot fit {step} tokens in {page_bytes} bytes")
            used = len(layers) * spec.bytes_for_tokens(tokens)
        groups.append(KVGroup(group_id, spec, layers, tokens, used))
    return KVGroupPlan(tuple(groups), page_bytes, block_size)
