"""Where the bytes of each parameter go: its parts, their global shapes and shardings, each device's regions.

A parameter comes from a checkpoint recipe (checkpoints/lazy_tensors.py; a quantised one is a `LazyQuant`)
and is laid out by its `ParamPlan` (sharding/layouts.py) or kept whole on one device. `place_plan`
resolves, before any byte is read, how the device holds it: a plain array (floats in the model's dtype,
or a hash table's integers), or a `StoredWeight` (agentjax/models/quantized.py) of parts kept as the
checkpoint stores them (quantised values, scales, global scale; bfloat16 floats in a float32 model).
Each part is split like the parameter (a scale's rows and columns divided by its block), and
`device_reads` lists what each device reads of each part, so a TP or EP split that cuts a scale block
fails here with a `ParallelLayoutError`. No jax arrays are made here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from agentjax.errors import ParallelLayoutError
from checkpoints.lazy_quant import BlockAlignmentError, LazyQuant
from checkpoints.lazy_tensors import Index, Lazy, Map, as_lazy, region_shape
from checkpoints.quant_codecs import Codec


@dataclass
class Part:
    """One array the device holds for a parameter: its recipe, global (placed) shape, dtype and sharding."""

    name: str  # "array", "values", "scales" or "global"
    recipe: Lazy
    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: jax.sharding.Sharding

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


@dataclass
class ParamPlacement:
    """How one parameter (a model state path) reaches the devices."""

    path: tuple
    name: str
    recipe: object  # Lazy or LazyQuant, in the single-device model's shape
    shape: tuple[int, ...]  # placed (after head repeats), before splitting
    sharding: jax.sharding.Sharding
    parts: list[Part]
    codec: Codec | None = None  # set when the device holds a StoredWeight
    compute_dtype: str = "float32"
    columns: np.ndarray | None = field(default=None, repr=False)  # placed column -> source column

    def local_bytes(self, device) -> int:
        """Bytes this parameter's parts take on `device`."""
        total = 0
        for part in self.parts:
            index = part.sharding.addressable_devices_indices_map(part.shape).get(device)
            if index is not None:
                total += math.prod(region_shape(_normalize(index, part.shape))) * np.dtype(part.dtype).itemsize
        return total

    def device_reads(self, index: Index) -> list[list[tuple[Lazy, Index]]]:
        """For a region of the placed parameter: per part, the `(recipe, region)` reads (one per run of
        source columns) whose concatenation along the last axis is the part's region."""
        runs = _column_runs(self.columns, index[-1]) if self.columns is not None else [index[-1]]
        reads = [[] for _ in self.parts]
        for run in runs:
            source = tuple(index[:-1]) + (run,)
            if self.codec is None or self.codec.values == "float":
                reads[0].append((self.parts[0].recipe, source))
                continue
            try:
                regions = self.recipe.region(source)
            except BlockAlignmentError as exc:
                raise ParallelLayoutError(f"parameter {self.name}: a device's shard does not fall on the scale "
                                          f"blocks of its quantised checkpoint tensor ({exc})") from None
            for k, (part, region) in enumerate(zip(self.parts, (r for r in regions if r is not None))):
                if part.name == "global" and reads[k]:
                    continue  # one global scale per matrix: the same for every run of columns
                reads[k].append((part.recipe, region))
        return reads


def _normalize(index, shape) -> Index:
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))


def _column_runs(columns: np.ndarray, wanted: slice) -> list[slice]:
    """The source columns of placed columns `wanted`, as contiguous runs in placed order."""
    cols = columns[wanted]
    breaks = np.flatnonzero(np.diff(cols) != 1) + 1
    return [slice(int(run[0]), int(run[-1]) + 1) for run in np.split(cols, breaks)]


def _storage(recipe, dtype: np.dtype, compute: str) -> tuple[Codec | None, np.dtype]:
    """(codec of a StoredWeight, or None for a plain array; the dtype the device stores)."""
    compute = np.dtype(compute)
    if isinstance(recipe, LazyQuant):
        return recipe.codec, np.dtype(np.uint8)
    if np.issubdtype(dtype, np.integer) or compute != np.float32:
        return None, dtype if np.issubdtype(dtype, np.integer) else compute
    if dtype.itemsize < 4 and dtype.kind == "f" or dtype.name == "bfloat16":
        return Codec("float"), dtype  # bfloat16 / float16 kept, widened in the step
    return None, np.dtype(np.float32)


def place_plan(path: tuple, name: str, recipe, abstract_dtype, compute_dtype: str, *, plan=None, mesh=None,
               device=None) -> ParamPlacement:
    """The placement of one parameter: over `mesh` by its `ParamPlan`, or whole on `device`."""
    recipe = recipe if isinstance(recipe, LazyQuant) else as_lazy(recipe)
    integer = np.issubdtype(np.dtype(abstract_dtype), np.integer)
    dtype = np.dtype(abstract_dtype) if integer else np.dtype(recipe.dtype)
    codec, store = _storage(recipe, dtype, compute_dtype)
    if plan is None:
        shape, spec, columns = tuple(recipe.shape), (None,) * len(recipe.shape), None
        make = lambda spec: jax.sharding.SingleDeviceSharding(device)  # noqa: E731
    else:
        shape, spec = tuple(plan.placed_shape), tuple(plan.spec)
        columns = None
        if plan.layout.dim == -1 and (plan.repeat > 1 or plan.layout.fused > 1):
            columns = np.asarray(plan.column_index).reshape(-1)
        make = lambda spec: NamedSharding(mesh, PartitionSpec(*spec))  # noqa: E731
    placement = ParamPlacement(path, name, recipe, shape, make(spec), [], codec, compute_dtype, columns)
    if codec is None or codec.values == "float":
        source = recipe if recipe.dtype == store else Map(recipe, lambda a, t=store: a.astype(t), store)
        placement.parts = [Part("array" if codec is None else "values", source, shape, store, make(spec))]
        return placement
    values, scales, glob = recipe.parts
    value_shape = list(shape)
    if codec.packed:
        value_shape[codec.packed_axis] //= 2
    parts = [Part("values", values, tuple(value_shape), np.dtype(values.dtype), make(spec))]
    if scales is not None:
        parts.append(Part("scales", scales, codec.scale_shape(shape), np.dtype(scales.dtype), make(spec)))
    if glob is not None:
        parts.append(Part("global", glob, (*shape[:-2], 1, 1), np.dtype(np.float32), make(spec[:-2] + (None, None))))
    placement.parts = parts
    _check_blocks(placement, plan)
    return placement


def _check_blocks(placement: ParamPlacement, plan) -> None:
    """A split of a blocked axis must leave whole blocks (and whole E2M1 pairs) on every rank."""
    if plan is None:
        return
    codec, n = placement.codec, len(placement.shape)
    for axis, block in ((n - 2, codec.block[0]), (n - 1, codec.block[1])):
        if plan.spec[axis] is None:
            continue
        ranks = placement.shape[axis] // plan.local_shape[axis]
        local = plan.local_shape[axis]
        pair = 2 if codec.packed and axis == n + codec.packed_axis else 1
        if local % math.lcm(block, pair):
            raise ParallelLayoutError(
                f"parameter {placement.name}: splitting axis {axis - n} ({placement.shape[axis]}) over {ranks} ranks "
                f"leaves {local} per rank, which cuts the checkpoint's scale blocks of {block} "
                f"({placement.recipe.origin}); choose a layout whose ranks divide it into whole blocks")
    values = placement.parts[0]  # every device's regions (column runs under fused / repeated heads) too
    for index in values.sharding.addressable_devices_indices_map(values.shape).values():
        placement.device_reads(_logical_index(placement, _normalize(index, values.shape)))


def _logical_index(placement: ParamPlacement, values_index: Index) -> Index:
    """The logical region behind a region of the values part (packed axis doubled)."""
    codec, n = placement.codec, len(placement.shape)
    if not codec.packed:
        return values_index
    axis = n + codec.packed_axis
    index = list(values_index)
    index[axis] = slice(index[axis].start * 2, index[axis].stop * 2)
    return tuple(index)


def logical_device_index(placement: ParamPlacement, device) -> Index | None:
    """The region of the placed parameter `device` holds (None: the device holds none of it)."""
    first = placement.parts[0]
    index = first.sharding.addressable_devices_indices_map(first.shape).get(device)
    if index is None:
        return None
    index = _normalize(index, first.shape)
    return _logical_index(placement, index) if placement.codec is not None and first.name == "values" else index
