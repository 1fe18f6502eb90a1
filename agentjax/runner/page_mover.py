"""How the offload worker moves one KV page group's pages between the device and the host, for either form
of KV memory (agentjax/kv_buffers.py): a tuple of per-kind buffers `[slots, pages, ...]`, or a pool
whose group page is every kind's cells of that page, moved as one flat row of the pool's words.

A mover gives a group's page shape and bytes, builds its host pool (`pinned_host` memory), gathers pages
into it, and scatters host or fetched pages back, each as one jitted call per group.
"""
from __future__ import annotations


import jax
import numpy as np

from agentjax.kv_buffers import KVPool, gather_group_pages, page_words, scatter_group_pages
from agentjax.runner.compilation_cache import with_compile_notice

# what each jitted move is called in the compile notices (agentjax/runner/compilation_cache.py)
GATHER, HOST_PUT, HOST_LOAD, SCATTER = ("the KV page copy to the host", "the host tier's page store",
                                        "the host tier's page load", "the KV page write")


def _write_pages(buffer, values, pages):
    """`buffer[:, pages[i]] = values[:, i]`, one page slice at a time (XLA's CPU scatter is element by
    element; a loop of dynamic_update_slice moves whole pages, as `model_runner.copy_pages` does)."""

    def write_one(i, out):
        page = jax.lax.dynamic_slice_in_dim(values, i, 1, axis=1)
        return jax.lax.dynamic_update_slice_in_dim(out, page, pages[i], axis=1)

    return jax.lax.fori_loop(0, pages.shape[0], write_one, buffer)


class BufferPageMover:
    """Per-kind buffers; a group's pages are `buffer[:, pages]` (one kind per group)."""

    page_axis = 1

    def __init__(self, specs, device_sharding, host_sharding):
        self.specs = specs
        self.device_sharding, self.host_sharding = device_sharding, host_sharding
        self._gather = with_compile_notice(jax.jit(lambda buffer, pages: buffer[:, pages],
                                                   out_shardings=host_sharding), GATHER)
        self._host_put = with_compile_notice(jax.jit(lambda pool, values, slots: pool.at[:, slots].set(values),
                                                     donate_argnums=(0,), out_shardings=host_sharding), HOST_PUT)
        self._host_load = with_compile_notice(jax.jit(self._load_from_host, donate_argnums=(0,),
                                                      out_shardings=device_sharding), HOST_LOAD)
        self._scatter = with_compile_notice(jax.jit(_write_pages, donate_argnums=(0,),
                                                    out_shardings=device_sharding), SCATTER)

    def page_bytes(self, group: int) -> int:
        return self.specs[group].bytes_per_page

    def new_host_pool(self, group: int, slots: int):
        spec = self.specs[group]
        zeros = np.zeros((spec.num_slots, slots, *spec.page_shape), dtype=jax.numpy.dtype(spec.dtype))
        return jax.device_put(zeros, self.host_sharding)

    def gather(self, kv, group: int, pages: np.ndarray):
        return self._gather(kv[group], pages)

    def host_put(self, host_pool, values, slots: np.ndarray):
        return self._host_put(host_pool, values, slots)

    def host_load(self, kv, group: int, host_pool, slots: np.ndarray, pages: np.ndarray):
        return _replace(kv, group, self._host_load(kv[group], host_pool, slots, pages))

    def scatter(self, kv, group: int, values, pages: np.ndarray):
        return _replace(kv, group, self._scatter(kv[group], values, pages))

    def _load_from_host(self, buffer, pool, slots, pages):
        values = pool[:, jax.device_put(slots, self.host_sharding)]  # gather in host memory, move the pages
        return _write_pages(buffer, jax.device_put(values, self.device_sharding), pages)

    def payload(self, values: np.ndarray, row: int) -> np.ndarray:
        return np.ascontiguousarray(values[:, row]).view(np.uint8).reshape(-1)

    def empty_values(self, group: int, count: int) -> np.ndarray:
        spec = self.specs[group]
        return np.empty((spec.num_slots, count, *spec.page_shape), dtype=jax.numpy.dtype(spec.dtype))

    def put_payload(self, values: np.ndarray, row: int, group: int, data: bytes) -> None:
        spec = self.specs[group]
        values[:, row] = np.frombuffer(data, dtype=values.dtype).reshape(spec.num_slots, *spec.page_shape)


class PoolPageMover:
    """A pool's group page: every kind's cells of the page as one flat row of the pool's words."""

    page_axis = 0

    def __init__(self, layout, device_sharding, host_sharding):
        self.layout = layout
        self.dtype = jax.numpy.dtype(layout.dtype)
        self.device_sharding, self.host_sharding = device_sharding, host_sharding
        self._host_put = with_compile_notice(jax.jit(lambda pool, values, slots: pool.at[slots].set(values),
                                                     donate_argnums=(0,), out_shardings=host_sharding), HOST_PUT)
        self._gathers, self._scatters, self._loads = {}, {}, {}

    def page_bytes(self, group: int) -> int:
        return self.layout.page_bytes(group)

    def new_host_pool(self, group: int, slots: int):
        return jax.device_put(np.zeros((slots, self.layout.groups[group].page_words), self.dtype), self.host_sharding)

    def gather(self, kv: KVPool, group: int, pages: np.ndarray):
        if group not in self._gathers:
            gather = jax.jit(lambda kv, pages: gather_group_pages(kv, group, pages), out_shardings=self.host_sharding)
            self._gathers[group] = with_compile_notice(gather, GATHER)
        return self._gathers[group](kv, pages)

    def host_put(self, host_pool, values, slots: np.ndarray):
        return self._host_put(host_pool, values, slots)

    def host_load(self, kv: KVPool, group: int, host_pool, slots: np.ndarray, pages: np.ndarray) -> KVPool:
        if group not in self._loads:
            def load(kv, pool, slots, pages):
                values = pool[jax.device_put(slots, self.host_sharding)]
                return scatter_group_pages(kv, group, jax.device_put(values, self.device_sharding), pages)

            self._loads[group] = with_compile_notice(jax.jit(load, donate_argnums=(0,)), HOST_LOAD)
        return self._loads[group](kv, host_pool, slots, pages)

    def scatter(self, kv: KVPool, group: int, values, pages: np.ndarray) -> KVPool:
        if group not in self._scatters:
            scatter = jax.jit(lambda kv, values, pages: scatter_group_pages(kv, group, values, pages),
                              donate_argnums=(0,))
            self._scatters[group] = with_compile_notice(scatter, SCATTER)
        return self._scatters[group](kv, values, pages)

    def payload(self, values: np.ndarray, row: int) -> np.ndarray:
        return np.ascontiguousarray(values[row]).view(np.uint8).reshape(-1)

    def empty_values(self, group: int, count: int) -> np.ndarray:
        return np.empty((count, self.layout.groups[group].page_words), dtype=self.dtype)

    def put_payload(self, values: np.ndarray, row: int, group: int, data: bytes) -> None:
        values[row] = np.frombuffer(data, dtype=values.dtype)


def _replace(buffers: tuple, group: int, new) -> tuple:
    return buffers[:group] + (new,) + buffers[group + 1:]


def page_mover(model_cfg, page_size: int, device_sharding, host_sharding, kv_layout=None):
    """The mover for an engine's KV memory: a pool's, or per-kind buffers of `page_size`-token pages."""
    if kv_layout is not None and kv_layout.mode == "pool":
        return PoolPageMover(kv_layout, device_sharding, host_sharding)
    from agentjax.kv.cache_layout import kv_buffer_specs

    return BufferPageMover(kv_buffer_specs(model_cfg, page_size), device_sharding, host_sharding)


__all__ = ["BufferPageMover", "PoolPageMover", "page_mover", "page_words"]
