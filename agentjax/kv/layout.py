"""The KV memory layout: which page groups the manager tracks, where their pages live in device memory,
and what each costs in bytes. It is the one source of truth for the device allocation, the engine's
sizing from `kv_cache_memory_gb`, the KV metrics, the offload tiers' page bytes and the planner's capacity.

"pool" (the engine's default, docs/design/kv_memory.md): the prefix kinds of a model are packed into
one page group, every window and state kind is a group of its own; device memory is one array of
slabs, each owned by one group at a time and carved into its pages. "shared": one group per kind and
every page id spans a page of every kind (the layout of `ModelConfig.new_kv_pages`).
`build_layout` and a device's part, `local_layout`, are in agentjax/kv/layout_build.py. Host only: never
imports jax.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from agentjax.errors import InvalidRequestError
from agentjax.kv.cache_layout import dtype_bytes
from agentjax.kv.specs import KVGroup, KVGroupPlan, KVSpec, plan_groups

LAYOUT_MODES = ("pool", "shared")
# A slab may grow past the smallest size that fits every group page while the pool keeps this many slabs.
MIN_SLABS = 64
# Requests are assumed this long when padding is weighed across groups (the choice of the slab size).
REFERENCE_CONTEXT = 32_768
# Cells and flat rows are addressed with int32 on the device.
INT32_LIMIT = 2**31 - 1


@dataclass(frozen=True)
class KindLayout:
    """One KV kind (layers of equal spec) in the layout. Sizes are in pool words (values of the pool's
    dtype); a cell is one layer's share of one page."""

    kind: int
    group: int
    role: str
    spec: KVSpec
    owner: int
    layers: tuple[int, ...]  # the model layer of each slot (MTP layers after the main ones)
    cell_shape: tuple[int, ...] | None  # in `dtype` values; None: sized only (no device format yet)
    dtype: str
    cell_words: int
    plane_offset: int = 0  # "pool": words from a slab's start to this kind's plane
    cells_per_slab: int = 0  # "pool": slab words // cell words

    @property
    def slots(self) -> int:
        return len(self.layers)

    @property
    def words_per_value(self) -> int:
        """Pool words per value: 1, or 2 for a float32 kind in a 16-bit pool (bit-exact pairs)."""
        return max(1, self.cell_words // math.prod(self.cell_shape)) if self.cell_shape else 1


@dataclass(frozen=True)
class GroupLayout:
    """One page group: its kinds, tokens per page, page size, pages per slab and page-id range."""

    group: int
    kinds: tuple[int, ...]
    hit_spec: KVSpec
    owner: int
    tokens_per_page: int
    page_words: int
    pages_per_slab: int
    id_base: int
    num_ids: int

    @property
    def hit_rule(self) -> str:
        return self.hit_spec.hit_rule


@dataclass(frozen=True)
class KVMemoryLayout:
    """Page groups, kinds and slab geometry of one engine's KV memory (see the module docstring)."""

    mode: str
    dtype: str  # the pool's word
    block_size: int  # tokens per hash block
    num_slabs: int  # "shared": pages
    slab_words: int  # "shared": words behind one page id
    kinds: tuple[KindLayout, ...]
    groups: tuple[GroupLayout, ...]
    tensor_kinds: tuple[int, ...] = field(default=(), repr=False)  # kind of every tensor, in tensor order

    # -- sizes ---------------------------------------------------------------------------------------
    @property
    def word_bytes(self) -> int:
        return dtype_bytes(self.dtype)

    @property
    def slab_bytes(self) -> int:
        return self.slab_words * self.word_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_slabs * self.slab_bytes

    @property
    def num_ids(self) -> int:
        """Page ids of the manager's pool (page 0 is the null page)."""
        return self.num_slabs if self.mode == "shared" else sum(g.num_ids for g in self.groups)

    def page_bytes(self, group: int) -> int:
        return self.groups[group].page_words * self.word_bytes

    @property
    def units_per_slab(self) -> int:
        """Capacity unit: a page of the group with the most pages per slab (see `units_per_page`)."""
        return math.lcm(*(g.pages_per_slab for g in self.groups))

    def units_per_page(self, group: int) -> int:
        return self.units_per_slab // self.groups[group].pages_per_slab

    def tokens_per_page(self) -> tuple[int, ...]:
        return tuple(g.tokens_per_page for g in self.groups)

    def state_groups(self) -> tuple[int, ...]:
        """Groups whose batch table is a request's running state page (and its draft states)."""
        return tuple(g.group for g in self.groups if g.hit_rule == "checkpoint")

    def state_interval(self) -> int:
        """Tokens between saved recurrent states (0: the model keeps none)."""
        return min((g.tokens_per_page for g in self.groups if g.hit_rule == "checkpoint"), default=0)

    def group_of_kind(self, kind: int) -> int:
        return self.kinds[kind].group

    def with_slabs(self, num_slabs: int) -> "KVMemoryLayout":
        """The same geometry over `num_slabs` slabs (the id ranges follow)."""
        if self.mode == "shared":
            groups = tuple(dataclasses.replace(g, num_ids=num_slabs) for g in self.groups)
            return dataclasses.replace(self, num_slabs=num_slabs, groups=groups)
        groups, base = [], 0
        for g in self.groups:
            groups.append(dataclasses.replace(g, id_base=base, num_ids=num_slabs * g.pages_per_slab))
            base += num_slabs * g.pages_per_slab
        result = dataclasses.replace(self, num_slabs=num_slabs, groups=tuple(groups))
        result._check_int32()
        return result

    def _check_int32(self) -> None:
        """Cells, the flat rows kernels index and the batch's slot numbers (page id x tokens per page) must
        stay within int32 (no byte offsets ever exist)."""
        for g in self.groups:
            if (g.id_base + g.num_ids) * g.tokens_per_page > INT32_LIMIT:
                raise InvalidRequestError(f"a KV pool of {self.total_bytes / 2**30:.1f} GiB has {g.id_base + g.num_ids} "
                                          "page ids, past int32 slot numbers; use a larger block_size or less memory")
        total_words = self.num_slabs * self.slab_words
        for k in self.kinds:
            cells = total_words // k.cell_words
            rows = cells * (k.cell_shape[0] if k.cell_shape and len(k.cell_shape) > 1 else 1)
            if rows > INT32_LIMIT:
                raise InvalidRequestError(
                    f"a KV pool of {self.total_bytes / 2**30:.1f} GiB has {rows} rows of its {k.role} kind, past "
                    "int32 indexing; use several devices (tensor or decode context parallelism) or a smaller "
                    "kv_cache_memory_gb")

    # -- the manager's plan ----------------------------------------------------------------------------
    def manager_plan(self) -> KVGroupPlan:
        """The KV manager's groups ("shared": `plan_groups` of every tensor's spec, as before this layout)."""
        if self.mode == "shared":
            return plan_groups([self.kinds[kind].spec for kind in self.tensor_kinds], self.block_size,
                               scale_tokens_per_page=False)
        groups = []
        for g in self.groups:
            tensors = tuple(i for i, kind in enumerate(self.tensor_kinds) if kind in g.kinds)
            groups.append(KVGroup(g.group, g.hit_spec, tensors, g.tokens_per_page, g.page_words * self.word_bytes))
        return KVGroupPlan(tuple(groups), max(g.page_words for g in self.groups) * self.word_bytes, self.block_size)

    # -- accounting --------------------------------------------------------------------------------------
    def pages_per_request(self, context: int, chunk: int = 0) -> tuple[int, ...]:
        """Pages each group holds for one request of `context` tokens between steps (window groups: the
        pages under the window, plus a chunk's while it prefills; state groups: the running state)."""
        pages = []
        for g in self.groups:
            size = g.tokens_per_page
            if g.hit_rule == "checkpoint":
                pages.append(1)
            elif g.hit_rule == "window":
                window = g.hit_spec.window
                pages.append(min(-(-context // size), -(-(window + chunk) // size) + 1))
            else:
                pages.append(-(-context // size))
        return tuple(pages)

    def bytes_per_request(self, context: int, chunk: int = 0) -> float:
        """Device bytes one request of `context` tokens costs: its pages, each with its share of the
        slab padding of its group ("shared": every page id costs every group's page)."""
        pages = self.pages_per_request(context, chunk)
        if self.mode == "shared":
            return sum(pages) * self.slab_bytes
        return sum(n * self.slab_bytes / g.pages_per_slab for n, g in zip(pages, self.groups))

    def ideal_bytes_per_request(self, context: int) -> float:
        """What the model must store for one request of `context` tokens: every kind's bytes, windows
        limited to their window, one state per state kind; no page rounding and no padding."""
        total = 0
        for k in self.kinds:
            spec = k.spec
            if spec.hit_rule == "checkpoint":
                total += k.slots * spec.state_bytes
            else:
                total += k.slots * spec.bytes_for_tokens(context if spec.window is None else min(context, spec.window))
        return float(total)

    def tokens_per_gb(self, context: int) -> float:
        """Tokens of requests of `context` tokens one GiB of this layout holds."""
        return context * 2**30 / self.bytes_per_request(context)

    def ideal_tokens_per_gb(self, context: int) -> float:
        return context * 2**30 / self.ideal_bytes_per_request(context)

    def group_names(self) -> tuple[str, ...]:
        """A label per group: its kinds' roles (`kv+index`, `latent`, `window`, ...), with the owner for
        a draft model's."""
        names = []
        for g in self.groups:
            roles = "+".join(dict.fromkeys(self.kinds[k].role for k in g.kinds))
            names.append(f"{roles}@draft" if g.owner else roles)
        seen: dict[str, int] = {}
        unique = []
        for name in names:  # DeepSeek-V4 has several kinds of one role (its compressors' inputs)
            seen[name] = seen.get(name, 0) + 1
            unique.append(name if names.count(name) == 1 else f"{name}.{seen[name] - 1}")
        return tuple(unique)
