"""Streaming a checkpoint onto the devices: each process reads only the bytes of the shards its devices hold.

`load_params(cfg, recipes, ...)` takes the converted checkpoint as recipes (checkpoints/hf.py with
`lazy=True`), resolves every parameter's placement (sharding/weight_placement.py: a layout's `ParamPlan`s,
or one device), checks that weights and KV fit (sharding/memory_check.py), then reads in `threads`
threads, device by device, the byte ranges of that device's shard of each part (`os.pread`), puts them
on the device and joins the shards with `jax.make_array_from_single_device_arrays`. A shard larger than
`piece_bytes` is read in slabs of at most that many bytes, written into a zeroed device buffer in place,
so the host holds at most about `threads x 3 x piece_bytes` of checkpoint data at once (a slab, its
transpose and its concatenation) whatever the model's size. Progress goes to stderr.
"""
from __future__ import annotations

import ctypes
import functools
import math
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
from flax import nnx

from agentjax.models.quantized import StoredWeight
from checkpoints.lazy_reads import READS
from checkpoints.lazy_tensors import Index, region_shape
from sharding.memory_check import check_memory
from sharding.weight_placement import ParamPlacement, logical_device_index, place_plan

PIECE_BYTES = 64 * 2**20
THREADS = 4


def placements(cfg, recipes: dict, *, parallel=None, numerics: str = "fast", mesh=None) -> list[ParamPlacement]:
    """Every parameter's placement: over the layout's mesh (MTP modules left out, as the sharded step does),
    or whole on the first device."""
    from agentjax.models.layer_plan import per_layer_names
    from agentjax.models.params import split_model

    sharded = parallel is not None and not parallel.is_single_device
    plans = None
    if sharded:
        from sharding.layouts import plan_parameters

        plans = plan_parameters(cfg, parallel, numerics)
    _, abstract = split_model(cfg.replace(num_mtp_modules=0) if sharded else cfg)
    device = None if sharded else jax.devices()[0]
    out = []
    for path, variable in nnx.to_flat_state(abstract):
        name = ".".join(str(p) for p in path)
        names = per_layer_names(cfg, name)
        recipe = recipes[name] if names == [name] else np.stack([recipes[n] for n in names])
        out.append(place_plan(path, name, recipe, variable.get_value().dtype, cfg.dtype,
                              plan=plans[path] if sharded else None, mesh=mesh, device=device))
    return out


class LoadProgress:
    """Tensors placed, bytes read, rate and time left, on stderr at most once a second."""

    def __init__(self, total_params: int, total_bytes: int, enabled: bool = True):
        self.total_params, self.total_bytes, self.enabled = total_params, total_bytes, enabled
        self.done_params, self.started, self.start_bytes = 0, time.perf_counter(), READS.bytes_read
        self.last = 0.0
        self.lock = threading.Lock()

    @property
    def bytes_read(self) -> int:
        return READS.bytes_read - self.start_bytes

    def line(self) -> str:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        rate = self.bytes_read / elapsed
        left = max(self.total_bytes - self.bytes_read, 0) / rate if rate > 0 else float("inf")
        return (f"[agentjax] weights: {self.done_params}/{self.total_params} tensors, {self.bytes_read / 1e9:.2f}/"
                f"{self.total_bytes / 1e9:.2f} GB read, {rate / 1e9:.2f} GB/s, ETA {left:.0f}s")

    def param_done(self) -> None:
        with self.lock:
            self.done_params += 1
            now = time.perf_counter()
            final = self.done_params == self.total_params
            if self.enabled and (final or now - self.last >= 1.0):
                self.last = now
                print(self.line(), file=sys.stderr, flush=True)


@functools.partial(jax.jit, donate_argnums=(0,))
def _write(buffer, piece, starts):
    return jax.lax.dynamic_update_slice(buffer, piece, tuple(starts[i] for i in range(buffer.ndim)))


def _read(reads: list) -> np.ndarray:
    pieces = [recipe.read(region) for recipe, region in reads]
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=-1)


def _step(placement: ParamPlacement, axis: int, n: int) -> int:
    """Slabs cut axis `axis` in multiples of this (whole scale blocks and E2M1 pairs on a blocked axis)."""
    codec = placement.codec
    if codec is None or codec.values == "float" or axis != n - 2:
        return 1
    return math.lcm(codec.block[0], 2) if codec.packed and codec.packed_axis == -2 else codec.block[0]


def _slabs(placement: ParamPlacement, index: Index, piece_bytes: int) -> list[Index]:
    """The device's region cut into slabs of at most `piece_bytes` (or one step of the last cut axis), along
    the first axes (never the last; a blocked axis on whole blocks)."""
    per_element = sum(p.nbytes for p in placement.parts) / max(math.prod(placement.shape), 1)
    n = len(index)

    def split(region: Index, axis: int) -> list[Index]:
        total = math.prod(region_shape(region)) * per_element
        if total <= piece_bytes or axis >= n - 1:
            return [region]
        extent = region[axis].stop - region[axis].start
        step = _step(placement, axis, n)
        take = int(piece_bytes // (total / extent)) // step * step
        if take < step:  # one step is still too big: cut each step along the next axis
            return [s for start in range(region[axis].start, region[axis].stop, step)
                    for s in split(_cut(region, axis, start, min(start + step, region[axis].stop)), axis + 1)]
        return [_cut(region, axis, start, min(start + take, region[axis].stop))
                for start in range(region[axis].start, region[axis].stop, take)]

    return split(index, 0)


def _cut(region: Index, axis: int, start: int, stop: int) -> Index:
    return region[:axis] + (slice(start, stop),) + region[axis + 1:]


def _part_slice(placement: ParamPlacement, part, sub: Index, outer: Index) -> Index:
    """The slice of a part's array of logical region `outer` that holds logical region `sub` (inside it):
    scaled on the blocked axes (scales by their block, packed E2M1 values by 2, the global scale not there)."""
    n, codec = len(outer), placement.codec
    out = []
    for axis in range(n):
        start, stop = sub[axis].start - outer[axis].start, sub[axis].stop - outer[axis].start
        if axis >= n - 2 and codec is not None and codec.values != "float":
            if part.name == "global":
                start, stop = 0, 1
            elif part.name == "scales":
                block, base = codec.block[axis - (n - 2)], outer[axis].start
                start, stop = start // block, -(-sub[axis].stop // block) - base // block
            elif codec.packed and axis == n + codec.packed_axis:
                start, stop = start // 2, stop // 2
        out.append(slice(start, stop))
    return tuple(out)


def _host_view(array) -> np.ndarray | None:
    """A writable numpy view of a CPU device array's buffer, None on other platforms. A CPU device's memory is
    the host's: a shard is written there slab by slab, with no host copy of it and no compiled update. Only
    for buffers this loader just allocated and nothing has read yet."""
    if next(iter(array.devices())).platform != "cpu" or array.nbytes == 0:
        return None
    raw = (ctypes.c_uint8 * array.nbytes).from_address(array.unsafe_buffer_pointer())
    return np.frombuffer(raw, np.uint8).view(array.dtype).reshape(array.shape)


def _load_group(placement: ParamPlacement, devices: list, piece_bytes: int) -> dict:
    """`{device: [its array of each part]}` for one parameter over this process's `devices`: the bounding box
    of their regions is read once, slab by slab (a TP split's devices share the rows of a tensor, a replicated
    parameter's devices all of it), and each device's region is cut from it."""
    regions = {d: logical_device_index(placement, d) for d in devices}
    regions = {d: r for d, r in regions.items() if r is not None}
    box = tuple(slice(min(r[a].start for r in regions.values()), max(r[a].stop for r in regions.values()))
                for a in range(len(placement.shape)))
    slabs = _slabs(placement, box, piece_bytes)
    parts = placement.parts
    if len(slabs) == 1:
        pieces = [_read(reads) for reads in placement.device_reads(box)]
        return {d: [jax.device_put(np.ascontiguousarray(piece[_part_slice(placement, part, r, box)]), d)
                    for part, piece in zip(parts, pieces)] for d, r in regions.items()}
    held = {d: [jax.device_put(np.empty(region_shape(_part_slice(placement, part, r, r)), part.dtype), d)
                for part in parts] for d, r in regions.items()}
    views = {d: [_host_view(a) for a in arrays] for d, arrays in held.items()}
    for slab in slabs:
        pieces = [_read(reads) for reads in placement.device_reads(slab)]
        for d, r in regions.items():
            inner = tuple(slice(max(a.start, b.start), min(a.stop, b.stop)) for a, b in zip(r, slab))
            if any(s.start >= s.stop for s in inner):
                continue
            for k, (part, piece) in enumerate(zip(parts, pieces)):
                cut, target = piece[_part_slice(placement, part, inner, slab)], _part_slice(placement, part, inner, r)
                if views[d][k] is not None:
                    views[d][k][target] = cut  # straight into the CPU device's buffer
                else:
                    starts = np.asarray([s.start for s in target], np.int32)
                    held[d][k] = _write(held[d][k], jax.device_put(np.ascontiguousarray(cut), d),
                                        jax.device_put(starts, d))
    return held


def _unique_bytes(plan: list, devices: list) -> int:
    """Bytes this process reads: each parameter's box over its devices once."""
    total = 0
    for placement in plan:
        regions = [r for r in (logical_device_index(placement, d) for d in devices) if r is not None]
        if regions:
            box = [max(r[a].stop for r in regions) - min(r[a].start for r in regions) for a in range(len(regions[0]))]
            total += int(math.prod(box) * sum(p.nbytes for p in placement.parts) / max(math.prod(placement.shape), 1))
    return total


def load_params(cfg, recipes: dict, *, parallel=None, numerics: str = "fast", mesh=None, kv_bytes: int = 0,
                threads: int = THREADS, piece_bytes: int = PIECE_BYTES, progress: bool = True):
    """The model's parameters (an `nnx.State`) read from `recipes` straight into device arrays, laid out by
    `parallel` over `mesh` (built from the layout when None) or on one device. Nothing is read before
    every placement is resolved and the memory check passed."""
    sharded = parallel is not None and not parallel.is_single_device
    if sharded and mesh is None:
        from sharding.mesh import build_mesh

        mesh = build_mesh(parallel)
    plan = placements(cfg, recipes, parallel=parallel, numerics=numerics, mesh=mesh)
    devices = list(mesh.local_devices) if sharded else [jax.devices()[0]]
    weights = {d: sum(p.local_bytes(d) for p in plan) for d in devices}
    check_memory(weights, kv_bytes, parallel.name if sharded else "one device", devices, quiet=not progress)
    meter = LoadProgress(len(plan), _unique_bytes(plan, devices), progress)
    shards: dict[int, dict] = {}

    def run(placement):
        shards[id(placement)] = _load_group(placement, devices, piece_bytes)
        meter.param_done()

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        for _ in pool.map(run, plan):
            pass
    flat = []
    from agentjax.models.params import split_model

    _, abstract = split_model(cfg.replace(num_mtp_modules=0) if sharded else cfg)
    variables = dict(nnx.to_flat_state(abstract))
    for placement in plan:
        per_device = shards[id(placement)]
        arrays = []
        for k, part in enumerate(placement.parts):
            locals_ = [per_device[d][k] for d in per_device]
            if sharded:
                arrays.append(jax.make_array_from_single_device_arrays(part.shape, part.sharding, locals_))
            else:
                arrays.append(locals_[0])
        value = arrays[0] if placement.codec is None else StoredWeight(
            *arrays, *([None] * (3 - len(arrays))), codec=placement.codec, dtype=placement.compute_dtype)
        flat.append((placement.path, variables[placement.path].replace(value=value)))
    return nnx.from_flat_state(flat)
