"""How the offload worker moves one KV group's pages between the device and the host: per-kind buffers
`[slots, pages, ...]` on one device, or a laid-out runner's per-device buffers `[devices, slots, pages,
...]` (TP, DCP, PCP: each device holds its part of every page, so a page moves as every device's part).

A mover gives a group's page bytes, builds its host pool (`pinned_host` memory), gathers pages into it,
and scatters host or fetched pages back, each as one jitted call per group. It never changes a page's
values: a page stored and loaded back is bit-identical, on every device.
"""
from __future__ import annotations

import jax
import numpy as np

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


class BufferPageMover:
    """Per-kind buffers on one device; a group's pages are `buffer[:, pages]` (one kind per group)."""

    page_axis = 1

    def __init__(self, specs, device_sharding, host_sharding, index_sharding=None):
        self.specs = specs
        self.device_sharding, self.host_sharding = device_sharding, host_sharding
        self.index_sharding = index_sharding or host_sharding  # where the host pool's slot indices live
        axis = self.page_axis
        self._gather = with_compile_notice(jax.jit(lambda buffer, pages: buffer[_at(axis, pages)],
                                                   out_shardings=host_sharding), GATHER)
        self._host_put = with_compile_notice(jax.jit(self._put_into_pool, donate_argnums=(0,),
                                                     out_shardings=host_sharding), HOST_PUT)
        self._host_load = with_compile_notice(jax.jit(self._load_from_host, donate_argnums=(0,),
                                                      out_shardings=device_sharding), HOST_LOAD)
        self._scatter = with_compile_notice(jax.jit(lambda buffer, values, pages: _write_pages(buffer, values, pages,
                                                                                                axis),
                                                    donate_argnums=(0,), out_shardings=device_sharding), SCATTER)

    def _lead(self) -> tuple:
        """The shape in front of a page's slots (none on one device)."""
        return ()

    def page_bytes(self, group: int) -> int:
        return self.specs[group].bytes_per_page * int(np.prod(self._lead(), dtype=np.int64))

    def new_host_pool(self, group: int, slots: int):
        spec = self.specs[group]
        zeros = np.zeros((*self._lead(), spec.num_slots, slots, *spec.page_shape), dtype=jax.numpy.dtype(spec.dtype))
        return jax.device_put(zeros, self.host_sharding)

    def gather(self, kv, group: int, pages: np.ndarray):
        return self._gather(kv[group], pages)

    def host_put(self, host_pool, values, slots: np.ndarray):
        return self._host_put(host_pool, values, slots)

    def host_load(self, kv, group: int, host_pool, slots: np.ndarray, pages: np.ndarray):
        return _replace(kv, group, self._host_load(kv[group], host_pool, slots, pages))

    def scatter(self, kv, group: int, values, pages: np.ndarray):
        return _replace(kv, group, self._scatter(kv[group], values, pages))

    def _put_into_pool(self, pool, values, slots):
        return pool.at[_at(self.page_axis, slots)].set(values)

    def _load_from_host(self, buffer, pool, slots, pages):
        # gather in host memory, then move the pages
        values = pool[_at(self.page_axis, jax.device_put(slots, self.index_sharding))]
        return _write_pages(buffer, jax.device_put(values, self.device_sharding), pages, self.page_axis)

    def payload(self, values: np.ndarray, row: int) -> np.ndarray:
        return np.ascontiguousarray(np.take(values, row, axis=self.page_axis)).view(np.uint8).reshape(-1)

    def empty_values(self, group: int, count: int) -> np.ndarray:
        spec = self.specs[group]
        return np.empty((*self._lead(), spec.num_slots, count, *spec.page_shape), dtype=jax.numpy.dtype(spec.dtype))

    def put_payload(self, values: np.ndarray, row: int, group: int, data: bytes) -> None:
        spec = self.specs[group]
        page = np.frombuffer(data, dtype=values.dtype).reshape(*self._lead(), spec.num_slots, *spec.page_shape)
        values[_at(self.page_axis, row)] = page

    def to_device(self, values: np.ndarray):
        """Fetched pages (host numpy, padded) on the devices, ready for `scatter`."""
        return jax.device_put(values, self.device_sharding)


class ShardedBufferPageMover(BufferPageMover):
    """A laid-out runner's buffers `[devices, slots, pages, *local page]`: a page is every device's part
    of it, moved together; the host pool keeps each device's part in that device's host memory."""

    page_axis = 2

    def __init__(self, specs, num_devices: int, device_sharding, host_sharding, index_sharding):
        self.num_devices = num_devices
        super().__init__(specs, device_sharding, host_sharding, index_sharding)

    def _lead(self) -> tuple:
        return (self.num_devices,)


def _at(axis: int, index) -> tuple:
    """The index that picks `index` on `axis` and keeps every axis before it."""
    return (slice(None),) * axis + (index,)


def _replace(buffers: tuple, group: int, new) -> tuple:
    return buffers[:group] + (new,) + buffers[group + 1:]


def page_mover(model_cfg, page_size: int, runner=None):
    """The mover for an engine's KV buffers: a laid-out runner's (`runner.sharded`), else one device's
    buffers of `page_size`-token pages."""
    from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

    sharded = getattr(runner, "sharded", None)
    if sharded is None:
        from agentjax.kv.cache_layout import kv_buffer_specs

        device = jax.devices()[0]
        return BufferPageMover(kv_buffer_specs(model_cfg, page_size),
                               SingleDeviceSharding(device, memory_kind="device"),
                               SingleDeviceSharding(device, memory_kind="pinned_host"))
    from sharding.step import local_kv_buffer_specs

    on_devices = sharded.device_sharding()
    return ShardedBufferPageMover(local_kv_buffer_specs(model_cfg, runner.parallel, runner.page_size),
                                  runner.parallel.num_devices,
                                  on_devices.with_memory_kind("device"), on_devices.with_memory_kind("pinned_host"),
                                  NamedSharding(sharded.mesh, PartitionSpec(), memory_kind="pinned_host"))
