"""The device KV memory and how one layer's mixer reaches its pages in it.

`KVPool` is a "pool" layout's memory (agentjax/kv/layout.py): one array of slabs; each KV kind's pages
are a reshape of the whole array into cells (one layer's share of one page), so nothing is copied and no
view aliases another. A tuple of per-kind buffers `[slots, pages, ...]` (`ModelConfig.new_kv_pages`, the
"shared" layout) is the other form. `LayerKV` hands a mixer its kind's buffer, the layer argument, and
the batch's page table and slot numbers for that buffer: for a tuple exactly what they were, for a pool
a one-layer buffer of cells with tables and slots in cells, so every kernel and reference runs unchanged.
Imports no model and no kernel.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from agentjax.errors import InvalidRequestError


@dataclass(frozen=True)
class DeviceKind:
    """Where one kind's cells lie in the pool array (see `KVMemoryLayout`), in cells of its own size."""

    table: int  # its page group's index among the batch's page tables
    cell_shape: tuple[int, ...]  # in the pool's words
    cells_per_slab: int
    plane: int  # first cell of the kind's plane in a slab
    slots: int
    pages_per_slab: int
    id_base: int
    tokens_per_page: int
    value_dtype: str  # what the mixer reads and writes (float32 pairs of 16-bit words: see `words_per_value`)
    words_per_value: int

    def cells(self, pages: jax.Array, slot) -> jax.Array:
        """Cell of layer slot `slot` of each page id (page 0, the null page, maps to the null slab)."""
        local = jnp.where(pages == 0, 0, pages - self.id_base)
        k = self.pages_per_slab
        return (local // k) * self.cells_per_slab + self.plane + (local % k) * self.slots + slot

    def rows(self, slot_mapping: jax.Array, slot) -> jax.Array:
        """`page * tokens_per_page + offset` slot numbers as the same numbers over cells."""
        size = self.tokens_per_page
        return self.cells(slot_mapping // size, slot) * size + slot_mapping % size


@dataclass(frozen=True)
class DeviceLayout:
    """The static part of a `KVPool`: its kinds (from `first_kind` on: a draft model's part of the pool
    numbers its kinds and tables from 0), the pool's word dtype."""

    kinds: tuple[DeviceKind, ...]
    dtype: str
    first_kind: int = 0
    first_table: int = 0
    num_kinds: int | None = None  # None: every kind from `first_kind` on

    def kind(self, index: int) -> DeviceKind:
        return self.kinds[self.first_kind + index]

    @property
    def visible(self) -> tuple[DeviceKind, ...]:
        end = None if self.num_kinds is None else self.first_kind + self.num_kinds
        return self.kinds[self.first_kind:end]

    @property
    def num_tables(self) -> int:
        return 1 + max(k.table for k in self.visible) - self.first_table

    @classmethod
    def of(cls, layout) -> "DeviceLayout":
        """The device description of a "pool" `KVMemoryLayout`."""
        if layout.mode != "pool":
            raise InvalidRequestError(f"a KVPool needs a 'pool' KV layout, got {layout.mode!r}")
        kinds = []
        for k in layout.kinds:
            if k.cell_shape is None:
                raise InvalidRequestError(f"the {k.role} kind is sized only (kv_format fp8_ds_mla); it has no "
                                          "device format yet: use kv_format='model_dtype'")
            group = layout.groups[k.group]
            words = k.words_per_value
            shape = k.cell_shape if words == 1 else (*k.cell_shape, words)
            kinds.append(DeviceKind(k.group, shape, k.cells_per_slab, k.plane_offset // k.cell_words, k.slots,
                                    group.pages_per_slab, group.id_base, group.tokens_per_page, k.dtype, words))
        return cls(tuple(kinds), layout.dtype)

    def owner_part(self, first_kind: int, first_table: int, num_kinds: int | None = None) -> "DeviceLayout":
        return DeviceLayout(self.kinds, self.dtype, first_kind, first_table, num_kinds)


@jax.tree_util.register_pytree_node_class
class KVPool:
    """The pool array `[slabs, slab words]` and its static `DeviceLayout`."""

    def __init__(self, array: jax.Array, layout: DeviceLayout):
        self.array = array
        self.layout = layout

    def tree_flatten(self):
        return (self.array,), self.layout

    @classmethod
    def tree_unflatten(cls, layout, children):
        return cls(children[0], layout)

    def view(self, kind: int) -> jax.Array:
        """Every cell of `kind`: `[cells, *cell_shape]` (a reshape of the whole array)."""
        cell = self.layout.kind(kind).cell_shape
        return self.array.reshape(-1, *cell)

    def with_view(self, kind: int, cells: jax.Array) -> "KVPool":
        return KVPool(cells.reshape(self.array.shape), self.layout)

    def part(self, first_kind: int, first_table: int, num_kinds: int | None = None) -> "KVPool":
        """The same array seen by one model of a pool that holds two (a draft model's kinds and tables
        numbered from 0)."""
        return KVPool(self.array, self.layout.owner_part(first_kind, first_table, num_kinds))


def new_pool(layout, sharding=None) -> KVPool:
    """A zeroed `KVPool` of a "pool" `KVMemoryLayout`."""
    shape, dtype = (layout.num_slabs, layout.slab_words), layout.dtype
    zeros = jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=sharding)
    return KVPool(zeros(), DeviceLayout.of(layout))


def num_page_tables(kv) -> int | None:
    """Page tables a batch needs for `kv` (a pool: its page groups), or None for a tuple (one per buffer)."""
    return kv.layout.num_tables if isinstance(kv, KVPool) else None


def model_part(kv, num_target_kinds: int, num_target_tables: int, draft: bool):
    """The part of the KV memory one of two models reads: the target's kinds, or the draft model's."""
    if isinstance(kv, KVPool):
        if draft:
            return kv.part(num_target_kinds, num_target_tables)
        return kv.part(0, 0, num_target_kinds)
    return tuple(kv[num_target_kinds:]) if draft else tuple(kv[:num_target_kinds])


def join_part(kv, part, num_target_kinds: int, draft: bool):
    """The whole KV memory after one model updated its `part`."""
    if isinstance(kv, KVPool):
        return KVPool(part.array, kv.layout)
    return tuple(kv[:num_target_kinds]) + tuple(part) if draft else tuple(part) + tuple(kv[num_target_kinds:])


class LayerKV:
    """One layer's access to its KV kinds: `slots` (role -> traced slot) and `kinds` (role -> kind)
    as the decoder passes them (agentjax/models/layer_plan.py).

    A kind stored wider than the pool's words (float32 states in a 16-bit pool, as bit-exact pairs) is
    handed to its op as a dense buffer of the cells the batch's table names, in its own dtype, with a
    table and slot numbers over that buffer (plus one cell for the writes of padding tokens); `store`
    writes those cells back. A bitcast of the whole array would make XLA copy it."""

    def __init__(self, kv, batch, slots: dict, kinds: dict[str, int]):
        self.kv, self.batch, self.slots, self.kinds = kv, batch, slots, kinds
        self.pooled = isinstance(kv, KVPool)
        self._dense: dict[str, tuple] = {}

    def _kind(self, role: str) -> DeviceKind:
        return self.kv.layout.kind(self.kinds[role])

    def _widened(self, role: str) -> bool:
        return self.pooled and self._kind(role).words_per_value > 1

    def table_index(self, role: str) -> int:
        if not self.pooled:
            return self.kinds[role]
        return self._kind(role).table - self.kv.layout.first_table

    def pages(self, role: str) -> jax.Array:
        """The buffer the op reads and writes: the kind's `[slots, pages, ...]` buffer, or every cell of
        the kind as one layer `[1, cells, ...]` (or the dense buffer of a widened kind)."""
        if not self.pooled:
            return self.kv[self.kinds[role]]
        if self._widened(role):
            return self._dense_pages(role)[1][None]
        return self.kv.view(self.kinds[role])[None]

    def layer(self, role: str):
        """The op's layer argument: the layer's slot, or 0 for cells."""
        return 0 if self.pooled else self.slots[role]

    def table(self, role: str) -> jax.Array:
        tables = self.batch.page_indices[self.table_index(role)]
        if not self.pooled:
            return tables
        if self._widened(role):
            rows, width = tables.shape
            return jnp.arange(rows * width, dtype=jnp.int32).reshape(rows, width)
        return self._kind(role).cells(tables, self.slots[role])

    def slot_mapping(self, role: str) -> jax.Array:
        slots = self.batch.slot_mapping[self.table_index(role)]
        if not self.pooled:
            return slots
        kind = self._kind(role)
        if not self._widened(role):
            return kind.rows(slots, self.slots[role])
        size, width = kind.tokens_per_page, self.batch.page_indices[self.table_index(role)].shape[1]
        dense = self.batch.seq_ids * width + self.batch.positions // size
        padding = slots // size == 0  # the null page: the padding cell after the batch's cells
        dense = jnp.where(padding, self._dense_pages(role)[1].shape[0] - 1, dense)
        return dense * size + slots % size

    def token_fields(self, role: str) -> dict:
        """The per-token fields an op that writes the role's rows takes: each token's row, position and
        destination slot."""
        return dict(token_seq_ids=self.batch.seq_ids, token_positions=self.batch.positions,
                    slot_mapping=self.slot_mapping(role))

    def store(self, role: str, pages: jax.Array) -> None:
        """Put back the op's updated buffer."""
        kind = self.kinds[role]
        if not self.pooled:
            self.kv = self.kv[:kind] + (pages,) + self.kv[kind + 1:]
        elif self._widened(role):
            cells, _ = self._dense_pages(role)
            words = jax.lax.bitcast_convert_type(pages[0][:-1], jnp.dtype(self.kv.layout.dtype))
            self.kv = self.kv.with_view(kind, self.kv.view(kind).at[cells].set(words))
            del self._dense[role]
        else:
            self.kv = self.kv.with_view(kind, pages[0])

    def _dense_pages(self, role: str) -> tuple[jax.Array, jax.Array]:
        """(cells the table names, flat; their values in the kind's dtype plus one zero cell)."""
        if role not in self._dense:
            kind = self._kind(role)
            tables = self.batch.page_indices[self.table_index(role)]
            cells = kind.cells(tables, self.slots[role]).reshape(-1)
            values = jax.lax.bitcast_convert_type(self.kv.view(self.kinds[role])[cells], jnp.dtype(kind.value_dtype))
            values = jnp.concatenate([values, jnp.zeros((1, *values.shape[1:]), values.dtype)])
            self._dense[role] = (cells, values)
        return self._dense[role]


# ---- page moves: state checkpoints, the offload tiers ----------------------------------------------
def group_kinds(kv: KVPool, group: int) -> list[int]:
    return [i for i, k in enumerate(kv.layout.kinds) if k.table == group]


def page_first_cells(kind: DeviceKind, pages: jax.Array) -> jax.Array:
    return kind.cells(pages, 0)


def move_pool_pages(kv: KVPool, sources: jax.Array, destinations: jax.Array, *, group: int) -> KVPool:
    """Copy page `sources[i]` of `group` onto `destinations[i]`, in order, every kind of the group (a
    page's cells of one kind are consecutive: its slots)."""
    for index in group_kinds(kv, group):
        kind = kv.layout.kinds[index]
        cells = kv.view(index)
        src, dst = page_first_cells(kind, sources), page_first_cells(kind, destinations)

        def copy_one(i, buf, src=src, dst=dst, slots=kind.slots):
            block = jax.lax.dynamic_slice_in_dim(buf, src[i], slots, axis=0)
            return jax.lax.dynamic_update_slice_in_dim(buf, block, dst[i], axis=0)

        kv = kv.with_view(index, jax.lax.fori_loop(0, sources.shape[0], copy_one, cells))
    return kv


copy_pool_pages = jax.jit(move_pool_pages, donate_argnums=(0,), static_argnames=("group",))


def gather_group_pages(kv: KVPool, group: int, pages: jax.Array) -> jax.Array:
    """`[len(pages), page words]`: every kind's cells of each page, kinds in layout order, flattened."""
    parts = []
    for index in group_kinds(kv, group):
        kind = kv.layout.kinds[index]
        cells = kv.view(index)
        first = page_first_cells(kind, pages)
        rows = first[:, None] + jnp.arange(kind.slots)[None, :]
        parts.append(cells[rows].reshape(pages.shape[0], -1))
    return jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]


def scatter_group_pages(kv: KVPool, group: int, values: jax.Array, pages: jax.Array) -> KVPool:
    """Write `values` (`gather_group_pages`'s rows) into `pages` of `group`, one page at a time."""
    start = 0
    for index in group_kinds(kv, group):
        kind = kv.layout.kinds[index]
        width = kind.slots * int(np.prod(kind.cell_shape))
        part = values[:, start:start + width].reshape(values.shape[0], kind.slots, *kind.cell_shape)
        start += width
        first = page_first_cells(kind, pages)

        def write_one(i, buf, part=part, first=first):
            return jax.lax.dynamic_update_slice_in_dim(buf, part[i], first[i], axis=0)

        kv = kv.with_view(index, jax.lax.fori_loop(0, pages.shape[0], write_one, kv.view(index)))
    return kv


def page_words(kv: KVPool, group: int) -> int:
    return sum(kv.layout.kinds[i].slots * int(np.prod(kv.layout.kinds[i].cell_shape)) for i in group_kinds(kv, group))
