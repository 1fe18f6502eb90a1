"""How a `KVMemoryLayout` (agentjax/kv/layout.py) is built: the model's kinds, their page groups and tokens
per page, each kind's cell, and the slab size and planes that carve slabs into pages with the least
padding; a parallel layout's per-device part (`local_layout`). Host only: never imports jax.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from agentjax.errors import InvalidRequestError
from agentjax.kv.cache_layout import (DEFAULT_CHECKPOINT_TOKENS, checkpoint_tokens, cost_aware_checkpoint_tokens,
                                      dtype_bytes, kind_cell, kv_tensors)
from agentjax.kv.layout import (LAYOUT_MODES, MIN_SLABS, REFERENCE_CONTEXT, GroupLayout, KindLayout,
                                KVMemoryLayout)
from agentjax.kv.specs import KVSpec, PackedSpec, group_layers


def build_layout(cfg, block_size: int, *, memory_bytes: int | None = None, num_pages: int | None = None,
                 mode: str = "pool", draft_cfg=None, checkpoint_interval: int | None = None,
                 device_part: tuple | None = None) -> KVMemoryLayout:
    """The layout of `cfg` (and a speculative-decoding `draft_cfg`) with `block_size`-token hash blocks,
    sized by `memory_bytes`, or by `num_pages`: the bytes of that many page ids of the "shared" layout
    (the old meaning of `num_kv_blocks`). Recurrent states are saved every `checkpoint_interval` tokens
    (None: `cost_aware_checkpoint_tokens`).

    `device_part=(local_cfg, dcp)`: a parallel layout's device holds `local_cfg`'s share of each kind (its
    heads; 1/`dcp` of each page's tokens). Then the sizes are one device's: `memory_bytes` is each device's
    KV memory, `num_pages` that many shared-layout pages of a device's share, and the pages per slab are
    chosen on the device's page sizes (tensor and context parallelism shrink the groups unequally, so a
    geometry chosen on the whole model's pages would leave a device's slabs part empty)."""
    if mode not in LAYOUT_MODES:
        raise InvalidRequestError(f"kv_layout must be one of {LAYOUT_MODES}, got {mode!r}")
    if block_size < 1:
        raise InvalidRequestError(f"block_size must be >= 1, got {block_size}")
    interval = (checkpoint_tokens(block_size, checkpoint_interval) if checkpoint_interval
                else cost_aware_checkpoint_tokens(cfg, block_size))
    kinds, tensor_kinds = _kinds(cfg, draft_cfg, interval)
    shared = _shared_layout(cfg, kinds, tensor_kinds, block_size, interval, num_pages or 2)
    page_bytes = shared.slab_bytes
    if device_part is not None and mode == "pool":
        if draft_cfg is not None:
            raise InvalidRequestError("a parallel layout's device part of a pool with a draft model is not built yet")
        _, cells = _device_cells(kinds, device_part, lambda index: block_size, interval)
        page_bytes = sum(cells[i][2] * len(kind.layers) for i, kind in enumerate(kinds)) * shared.word_bytes
    if num_pages is not None:
        memory_bytes = num_pages * page_bytes
    if memory_bytes is None:
        raise InvalidRequestError("a KV layout needs memory_bytes or num_pages")
    if mode == "shared":
        return shared.with_slabs(num_pages if num_pages is not None else max(16, memory_bytes // shared.slab_bytes))
    return _pool_layout(cfg, kinds, tensor_kinds, block_size, interval, memory_bytes, device_part)


@dataclass
class _Kind:
    cfg: object
    role: str
    spec: KVSpec
    owner: int
    layers: tuple[int, ...]
    tensors: tuple[int, ...]


def _kinds(cfg, draft_cfg, interval: int) -> tuple[list[_Kind], tuple[int, ...]]:
    """Every kind of the model then of the draft model, in the manager's group order (`group_layers`)."""
    import dataclasses

    tensors = [(cfg, t, 0) for t in kv_tensors(cfg, interval)]
    if draft_cfg is not None:
        tensors += [(draft_cfg, dataclasses.replace(t, spec=dataclasses.replace(t.spec, owner=1)), 1)
                    for t in kv_tensors(draft_cfg, interval)]
    kinds, tensor_kinds = [], [0] * len(tensors)
    for index, (spec, members) in enumerate(group_layers([t.spec for _, t, _ in tensors])):
        owner_cfg, first, owner = tensors[members[0]]
        kinds.append(_Kind(owner_cfg, first.role, spec, owner, tuple(tensors[m][1].layer for m in members), members))
        for m in members:
            tensor_kinds[m] = index
    return kinds, tuple(tensor_kinds)


def _cell(kind: _Kind, tokens: int, pool_dtype: str, strict: bool = True) -> tuple[tuple[int, ...] | None, str, int]:
    """(device cell shape or None, value dtype, pool words) of one cell of `kind` at `tokens` per page;
    `strict`: the kind must be storable in the pool's words (a "pool" layout)."""
    spec = kind.spec
    cell_bytes = spec.state_bytes if spec.hit_rule == "checkpoint" else spec.bytes_for_tokens(tokens)
    word = dtype_bytes(pool_dtype)
    words = -(-cell_bytes // word)
    attention = getattr(kind.cfg, "compressed_attention", None)
    if attention is not None and attention.kv_format != "model_dtype" and kind.role in ("window", "entries",
                                                                                         "index_entries"):
        return None, pool_dtype, words  # fp8_ds_mla rows: sized for plans, no device format yet
    shape, dtype = kind_cell(kind.cfg, kind.role, spec, tokens)
    if strict and dtype_bytes(dtype) < word:
        raise InvalidRequestError(f"a {dtype} KV kind cannot live in a {pool_dtype} pool (narrower than its word)")
    return shape, dtype, words


def _group_tokens(kinds: list[_Kind], block_size: int, interval: int) -> int:
    """Tokens per page of a group of `kinds`: whole hash blocks and whole entries of every kind, or
    exactly what a kernel demands; a state group's page is one state (saved every `interval` tokens)."""
    specs = [k.spec for k in kinds]
    if specs[0].hit_rule == "checkpoint":
        return interval
    tokens = math.lcm(block_size, *(s.tokens_per_entry for s in specs))
    demanded = {s.required_page_tokens for s in specs if s.required_page_tokens}
    if len(demanded) > 1:
        raise InvalidRequestError(f"kinds of one page group demand different page sizes: {sorted(demanded)}")
    if demanded:
        required = demanded.pop()
        if required % tokens:
            raise InvalidRequestError(
                f"{specs[0].kind} requires {required} tokens per page, which is not a multiple of "
                f"block_size={block_size} and of the entry ratios {sorted({s.tokens_per_entry for s in specs})}")
        tokens = required
    return tokens


def _pool_groups(kinds: list[_Kind]) -> list[list[int]]:
    """Kind indices of each page group: every prefix kind of one owner together, the others alone;
    groups in the order of their first kind."""
    groups: list[list[int]] = []
    prefix_group: dict[int, list[int]] = {}
    for index, kind in enumerate(kinds):
        if kind.spec.hit_rule == "prefix":
            if kind.owner in prefix_group:
                prefix_group[kind.owner].append(index)
                continue
            prefix_group[kind.owner] = [index]
            groups.append(prefix_group[kind.owner])
        else:
            groups.append([index])
    return groups


def _hit_spec(kinds: list[_Kind]) -> KVSpec:
    if len(kinds) == 1:
        return kinds[0].spec
    return PackedSpec(members=tuple((k.spec, len(k.layers)) for k in kinds), owner=kinds[0].owner)


def _shared_layout(cfg, kinds: list[_Kind], tensor_kinds, block_size: int, interval: int,
                   num_pages: int) -> KVMemoryLayout:
    """One group per kind, `block_size` tokens per page (a state: one per page), one id space."""
    layouts, groups = [], []
    for index, kind in enumerate(kinds):
        tokens = interval if kind.spec.hit_rule == "checkpoint" else block_size
        shape, dtype, words = _cell(kind, block_size, cfg.dtype, strict=False)
        layouts.append(KindLayout(index, index, kind.role, kind.spec, kind.owner, kind.layers, shape, dtype, words))
        groups.append(GroupLayout(index, (index,), kind.spec, kind.owner, tokens, words * len(kind.layers), 1, 0,
                                  num_pages))
    slab = sum(g.page_words for g in groups)
    return KVMemoryLayout("shared", cfg.dtype, block_size, num_pages, slab, tuple(layouts), tuple(groups),
                          tensor_kinds)


def _pool_layout(cfg, kinds: list[_Kind], tensor_kinds, block_size: int, interval: int,
                 memory_bytes: int, device_part: tuple | None = None) -> KVMemoryLayout:
    word = dtype_bytes(cfg.dtype)
    members = _pool_groups(kinds)
    tokens = [_group_tokens([kinds[i] for i in group], block_size, interval) for group in members]
    cells = {}
    for group, token_count in zip(members, tokens):
        for i in group:
            cells[i] = _cell(kinds[i], token_count, cfg.dtype)
    pages = [sum(cells[i][2] * len(kinds[i].layers) for i in group) for group in members]
    if device_part is None:
        weights = _reference_weights(kinds, members, tokens, pages)
        slab, per_slab, planes = _slab_geometry(kinds, members, cells, pages, weights, memory_bytes // word)
        sized_slab, where = slab, ""
    else:  # the device's page sizes choose the geometry and count the slabs; the whole-model slab follows
        group_of = {i: g for g, group in enumerate(members) for i in group}
        _, local_cells = _device_cells(kinds, device_part, lambda i: tokens[group_of[i]], interval)
        local_pages = [sum(local_cells[i][2] * len(kinds[i].layers) for i in group) for group in members]
        weights = _reference_weights(kinds, members, tokens, local_pages)
        sized_slab, per_slab, _ = _slab_geometry(kinds, members, local_cells, local_pages, weights,
                                                 memory_bytes // word)
        planes, slab = _planes_for_counts(kinds, members, cells, per_slab)
        where = " per device"
    num_slabs = memory_bytes // (sized_slab * word)
    if num_slabs < len(members) + 1:
        raise InvalidRequestError(
            f"kv_cache_memory_gb={memory_bytes / 2**30:.4g} holds {num_slabs} slabs of {sized_slab * word} bytes"
            f"{where}; this model's KV pool needs at least {len(members) + 1} (one per page group and the null slab)")
    kind_layouts = [None] * len(kinds)
    group_layouts = []
    for g, (group, token_count) in enumerate(zip(members, tokens)):
        for i in group:
            shape, dtype, words = cells[i]
            kind_layouts[i] = KindLayout(i, g, kinds[i].role, kinds[i].spec, kinds[i].owner, kinds[i].layers,
                                         shape, dtype, words, planes[i], slab // words)
        group_layouts.append(GroupLayout(g, tuple(group), _hit_spec([kinds[i] for i in group]), kinds[group[0]].owner,
                                         token_count, pages[g], per_slab[g], 0, 0))
    layout = KVMemoryLayout("pool", cfg.dtype, block_size, num_slabs, slab, tuple(kind_layouts),
                            tuple(group_layouts), tensor_kinds)
    return layout.with_slabs(num_slabs)


def local_layout(layout: KVMemoryLayout, local_cfg, dcp: int = 1) -> KVMemoryLayout:
    """The part of a "pool" `layout` one device of a parallel layout holds: the same page groups, pages
    per slab, slabs and page ids, each kind's cells the device's share (`local_cfg`: its heads; with
    `dcp` decode-context ranks, its 1/dcp of each page's tokens). Its slab is the longest any group's
    planes need, rounded to every local cell."""
    import dataclasses

    interval = next((g.tokens_per_page for g in layout.groups if g.hit_rule == "checkpoint"), DEFAULT_CHECKPOINT_TOKENS)
    kinds, cells = _device_cells(layout.kinds, (local_cfg, dcp),
                                 lambda index: layout.groups[layout.kinds[index].group].tokens_per_page, interval)
    tensor_kinds = _kinds(local_cfg, None, interval)[1]
    members = [list(g.kinds) for g in layout.groups]
    planes, slab = _planes_for_counts(kinds, members, cells, [g.pages_per_slab for g in layout.groups])
    local_kinds = tuple(dataclasses.replace(layout.kinds[i], spec=kinds[i].spec, cell_shape=cells[i][0],
                                            dtype=cells[i][1], cell_words=cells[i][2], plane_offset=planes[i],
                                            cells_per_slab=slab // cells[i][2]) for i in range(len(kinds)))
    groups = tuple(dataclasses.replace(g, page_words=sum(cells[i][2] * len(kinds[i].layers) for i in g.kinds))
                   for g in layout.groups)
    return dataclasses.replace(layout, slab_words=slab, kinds=local_kinds, groups=groups, tensor_kinds=tensor_kinds)


def _device_cells(whole_kinds, device_part: tuple, page_tokens, interval: int) -> tuple[list[_Kind], dict]:
    """(the device's kinds, {kind index: (cell shape, dtype, pool words)}) of `device_part=(local_cfg, dcp)`:
    its heads of each kind, 1/dcp of a page's `page_tokens(kind index)` tokens (a state is whole)."""
    local_cfg, dcp = device_part
    kinds, _ = _kinds(local_cfg, None, interval)
    if len(kinds) != len(whole_kinds):
        raise InvalidRequestError(f"the local model has {len(kinds)} KV kinds, the layout {len(whole_kinds)}")
    word = dtype_bytes(local_cfg.dtype)
    cells = {}
    for index, kind in enumerate(kinds):
        tokens = page_tokens(index) if kind.spec.hit_rule == "checkpoint" else page_tokens(index) // dcp
        shape, dtype = kind_cell(local_cfg, kind.role, kind.spec, tokens)
        cells[index] = (shape, dtype, math.prod(shape) * dtype_bytes(dtype) // word)
    return kinds, cells


def _planes_for_counts(kinds, members: list[list[int]], cells, counts: list[int]) -> tuple[dict[int, int], int]:
    """(plane offset of each kind, slab words) for `counts` pages of each group: the longest group's
    planes, rounded up to a multiple of every cell."""
    planes, end = {}, 0
    for group, count in zip(members, counts):
        offsets = _planes(kinds, group, cells, count, 1 << 62)
        planes.update(offsets)
        end = max(end, max(offsets[i] + count * len(kinds[i].layers) * cells[i][2] for i in group))
    unit = math.lcm(*(c[2] for c in cells.values()))
    return planes, -(-end // unit) * unit


def _reference_weights(kinds, members, tokens, pages) -> list[float]:
    """The share of a reference request's bytes each group holds (what its padding is weighed by)."""
    held = []
    for group, token_count, page in zip(members, tokens, pages):
        spec = kinds[group[0]].spec
        if spec.hit_rule == "checkpoint":
            count = 1
        elif spec.hit_rule == "window":
            count = -(-spec.window // token_count) + 1
        else:
            count = -(-REFERENCE_CONTEXT // token_count)
        held.append(count * page)
    total = sum(held)
    return [h / total for h in held]


def _planes(kinds, group: list[int], cells, count: int, slab: int) -> dict[int, int] | None:
    """Plane offsets of `count` pages of a group in a slab of `slab` words (widest cells first, each
    plane aligned to its cell), or None if they do not fit."""
    offsets, offset = {}, 0
    for i in sorted(group, key=lambda i: -cells[i][2]):
        words = cells[i][2]
        offset = -(-offset // words) * words
        offsets[i] = offset
        offset += count * len(kinds[i].layers) * words
    return offsets if offset <= slab else None


def _slab_geometry(kinds, members, cells, pages, weights, memory_words: int):
    """(slab words, pages per slab of each group, plane offset of each kind): the slab size, a multiple
    of every cell and at least the largest page, whose padding costs the least weighted by `weights`."""
    unit = math.lcm(*(c[2] for c in cells.values()))
    smallest = -(-max(pages) // unit)
    largest = max(smallest, min(16 * smallest, memory_words // (MIN_SLABS * unit)))
    best = None
    for multiple in range(smallest, largest + 1):
        slab = multiple * unit
        counts, planes, waste = [], {}, 0.0
        for g, group in enumerate(members):
            count = slab // pages[g]
            offsets = _planes(kinds, group, cells, count, slab)
            while count and offsets is None:
                count -= 1
                offsets = _planes(kinds, group, cells, count, slab)
            if not count:
                break
            counts.append(count)
            planes.update(offsets)
            waste += weights[g] * (1 - count * pages[g] / slab)
        else:
            if best is None or waste < best[0] - 1e-9:
                best = (waste, slab, counts, planes)
    if best is None:
        raise InvalidRequestError("no slab size holds a page of every KV page group")
    return best[1], best[2], best[3]
