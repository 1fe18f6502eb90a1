"""How the offload worker moves one KV page group's pages between the device and the host, for either form
of KV memory (agentjax/kv_buffers.py): per-kind buffers `[slots, pages, ...]`, or a pool whose group page
is every kind's cells of that page, moved as one flat row of the pool's words. Under a parallel layout
(TP, DCP, PCP) each device holds its part of every page, so the buffers or the pool gain a leading
device axis and a page moves as every device's part of it, each part kept in its device's host memory.

A mover gives a group's page bytes, builds its host pool (`pinned_host` memory), gathers pages into it,
and scatters host or fetched pages back, each as one jitted call per group. It never changes a page's
values: a page stored and loaded back is bit-identical, on every device.
"""
from __future__ import annotations

import jax
import numpy as np

from agentjax.kv_buffers import KVPool, gather_group_pages, page_words, scatter_group_pages
from agentjax.runner.compilation_cache import with_compile_notice

# what each jitted move is called in the compile notices (agentjax/runner/compilation_cache.py)
GATHER, HOST_PUT, HOST_LOAD, SCATTER = ("the KV page copy to the host", "the host tier's page store",
                                        "the host tier's page load", "the KV page write")


def _write_pages(buffer, values, pages, axis: int = 1):
    """`buffer[..., pages[i], ...] = values[..., i, ...]` on the page `axis`, one page slice at a time
    (XLA's CPU scatter is element by element; a loop of dynamic_update_slice moves whole pages, as
    `model_runner.copy_pages` does)."""

    def write_one(i, out):
        page = jax.lax.dynamic_slice_in_dim(values, i, 1, axis=axis)
        return jax.lax.dynamic_update_slice_in_dim(out, page, pages[i], axis=axis)

    return jax.lax.fori_loop(0, pages.shape[0], write_one, buffer)


class _PageMover:
    """What both forms share: host pages are `[*lead, ..., pages on page_axis, ...]`, where `lead` is the
    device axis of a laid-out runner (none on one device)."""

    page_axis = 0
    num_devices = 0  # 0: one device, no leading device axis

    def __init__(self, device_sharding, host_sharding, index_sharding=None):
        self.device_sharding, self.host_sharding = device_sharding, host_sharding
        self.index_sharding = index_sharding or host_sharding  # where the host pool's slot indices live
        self._host_put = with_compile_notice(jax.jit(self._put_into_pool, donate_argnums=(0,),
                                                     out_shardings=host_sharding), HOST_PUT)

    def _lead(self) -> tuple:
        """The shape in front of a page's own axes: the device axis, if any."""
        return (self.num_devices,) if self.num_devices else ()

    def _devices(self) -> int:
        return self.num_devices or 1

    def host_put(self, host_pool, values, slots: np.ndarray):
        return self._host_put(host_pool, values, slots)

    def _put_into_pool(self, pool, values, slots):
        return pool.at[_at(self.page_axis, slots)].set(values)

    def _from_host(self, pool, slots):
        """Pages `slots` of a host pool, gathered in host memory and then moved to the devices."""
        values = pool[_at(self.page_axis, jax.device_put(slots, self.index_sharding))]
        return jax.device_put(values, self.device_sharding)

    def payload(self, values: np.ndarray, row: int) -> np.ndarray:
        return np.ascontiguousarray(np.take(values, row, axis=self.page_axis)).view(np.uint8).reshape(-1)

    def to_device(self, values: np.ndarray):
        """Fetched pages (host numpy, padded) on the devices, ready for `scatter`."""
        return jax.device_put(values, self.device_sharding)


class BufferPageMover(_PageMover):
    """Per-kind buffers on one device; a group's pages are `buffer[:, pages]` (one kind per group)."""

    page_axis = 1

    def __init__(self, specs, device_sharding, host_sharding, index_sharding=None):
        super().__init__(device_sharding, host_sharding, index_sharding)
        self.specs = specs
        axis = self.page_axis
        self._gather = with_compile_notice(jax.jit(lambda buffer, pages: buffer[_at(axis, pages)],
                                                   out_shardings=host_sharding), GATHER)
        self._host_load = with_compile_notice(jax.jit(self._load_from_host, donate_argnums=(0,),
                                                      out_shardings=device_sharding), HOST_LOAD)
        self._scatter = with_compile_notice(jax.jit(lambda buffer, values, pages: _write_pages(buffer, values, pages,
                                                                                                axis),
                                                    donate_argnums=(0,), out_shardings=device_sharding), SCATTER)

    @property
    def num_groups(self) -> int:
        return len(self.specs)

    def page_bytes(self, group: int) -> int:
        return self.specs[group].bytes_per_page * self._devices()

    def new_host_pool(self, group: int, slots: int):
        spec = self.specs[group]
        zeros = np.zeros((*self._lead(), spec.num_slots, slots, *spec.page_shape), dtype=jax.numpy.dtype(spec.dtype))
        return jax.device_put(zeros, self.host_sharding)

    def gather(self, kv, group: int, pages: np.ndarray):
        return self._gather(kv[group], pages)

    def host_load(self, kv, group: int, host_pool, slots: np.ndarray, pages: np.ndarray):
        return _replace(kv, group, self._host_load(kv[group], host_pool, slots, pages))

    def scatter(self, kv, group: int, values, pages: np.ndarray):
        return _replace(kv, group, self._scatter(kv[group], values, pages))

    def _load_from_host(self, buffer, pool, slots, pages):
        return _write_pages(buffer, self._from_host(pool, slots), pages, self.page_axis)

    def empty_values(self, group: int, count: int) -> np.ndarray:
        spec = self.specs[group]
        return np.empty((*self._lead(), spec.num_slots, count, *spec.page_shape), dtype=jax.numpy.dtype(spec.dtype))

    def put_payload(self, values: np.ndarray, row: int, group: int, data: bytes) -> None:
        spec = self.specs[group]
        page = np.frombuffer(data, dtype=values.dtype).reshape(*self._lead(), spec.num_slots, *spec.page_shape)
        values[_at(self.page_axis, row)] = page


class ShardedBufferPageMover(BufferPageMover):
    """A laid-out runner's buffers `[devices, slots, pages, *local page]`: a page is every device's part
    of it, moved together; the host pool keeps each device's part in that device's host memory."""

    page_axis = 2

    def __init__(self, specs, num_devices: int, device_sharding, host_sharding, index_sharding):
        self.num_devices = num_devices
        super().__init__(specs, device_sharding, host_sharding, index_sharding)


class PoolPageMover(_PageMover):
    """A pool's group page: every kind's cells of the page as one flat row of the pool's words."""

    page_axis = 0

    def __init__(self, layout, device_sharding, host_sharding, index_sharding=None):
        super().__init__(device_sharding, host_sharding, index_sharding)
        self.layout = layout
        self.dtype = jax.numpy.dtype(layout.dtype)
        self._gathers, self._scatters, self._loads = {}, {}, {}

    @property
    def num_groups(self) -> int:
        return len(self.layout.groups)

    def page_bytes(self, group: int) -> int:
        return self.layout.page_bytes(group) * self._devices()

    def new_host_pool(self, group: int, slots: int):
        shape = (*self._lead(), slots, self.layout.groups[group].page_words)
        return jax.device_put(np.zeros(shape, self.dtype), self.host_sharding)

    def _each_device(self, fn):
        """`fn` over one device's pool part (and its pages' values), mapped over the device axis if any."""
        return jax.vmap(fn) if self.num_devices else fn

    def gather(self, kv: KVPool, group: int, pages: np.ndarray):
        if group not in self._gathers:
            def gather(kv, pages):
                return self._each_device(lambda part: gather_group_pages(part, group, pages))(kv)

            self._gathers[group] = with_compile_notice(jax.jit(gather, out_shardings=self.host_sharding), GATHER)
        return self._gathers[group](kv, pages)

    def host_load(self, kv: KVPool, group: int, host_pool, slots: np.ndarray, pages: np.ndarray) -> KVPool:
        if group not in self._loads:
            def load(kv, pool, slots, pages):
                return self._scatter_on_devices(kv, group, self._from_host(pool, slots), pages)

            self._loads[group] = with_compile_notice(jax.jit(load, donate_argnums=(0,)), HOST_LOAD)
        return self._loads[group](kv, host_pool, slots, pages)

    def scatter(self, kv: KVPool, group: int, values, pages: np.ndarray) -> KVPool:
        if group not in self._scatters:
            scatter = jax.jit(lambda kv, values, pages: self._scatter_on_devices(kv, group, values, pages),
                              donate_argnums=(0,))
            self._scatters[group] = with_compile_notice(scatter, SCATTER)
        return self._scatters[group](kv, values, pages)

    def _scatter_on_devices(self, kv: KVPool, group: int, values, pages) -> KVPool:
        return self._each_device(lambda part, values: scatter_group_pages(part, group, values, pages))(kv, values)

    def empty_values(self, group: int, count: int) -> np.ndarray:
        return np.empty((*self._lead(), count, self.layout.groups[group].page_words), dtype=self.dtype)

    def put_payload(self, values: np.ndarray, row: int, group: int, data: bytes) -> None:
        values[_at(self.page_axis, row)] = np.frombuffer(data, dtype=values.dtype).reshape(*self._lead(), -1)


class ShardedPoolPageMover(PoolPageMover):
    """A laid-out runner's pool `[devices, slabs, local slab words]` (`layout`: one device's part of the
    engine's layout): a group page is every device's flat row of it, moved together."""

    page_axis = 1

    def __init__(self, layout, num_devices: int, device_sharding, host_sharding, index_sharding):
        self.num_devices = num_devices
        super().__init__(layout, device_sharding, host_sharding, index_sharding)


def _at(axis: int, index) -> tuple:
    """The index that picks `index` on `axis` and keeps every axis before it."""
    return (slice(None),) * axis + (index,)


def _replace(buffers: tuple, group: int, new) -> tuple:
    return buffers[:group] + (new,) + buffers[group + 1:]


def page_mover(model_cfg, page_size: int, runner=None, kv_layout=None):
    """The mover for an engine's KV memory: a "pool" `kv_layout`'s pool, else per-kind buffers of
    `page_size`-token pages; a laid-out runner's (`runner.sharded`) per-device parts of either."""
    from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

    pooled = kv_layout is not None and kv_layout.mode == "pool"
    sharded = getattr(runner, "sharded", None)
    if sharded is None:
        device = jax.devices()[0]
        on_device = SingleDeviceSharding(device, memory_kind="device")
        on_host = SingleDeviceSharding(device, memory_kind="pinned_host")
        if pooled:
            return PoolPageMover(kv_layout, on_device, on_host)
        from agentjax.kv.cache_layout import kv_buffer_specs

        return BufferPageMover(kv_buffer_specs(model_cfg, page_size), on_device, on_host)
    on_devices = sharded.device_sharding()
    shardings = (on_devices.with_memory_kind("device"), on_devices.with_memory_kind("pinned_host"),
                 NamedSharding(sharded.mesh, PartitionSpec(), memory_kind="pinned_host"))
    devices = runner.parallel.num_devices
    if pooled:
        return ShardedPoolPageMover(sharded.local_kv_layout(kv_layout), devices, *shardings)
    from sharding.layouts import local_kv_buffer_specs

    return ShardedBufferPageMover(local_kv_buffer_specs(model_cfg, runner.parallel, runner.page_size), devices,
                                  *shardings)


__all__ = ["BufferPageMover", "PoolPageMover", "ShardedBufferPageMover", "ShardedPoolPageMover", "page_mover",
           "page_words"]
