"""The device side of a parallel layout: the model runner over a mesh of devices (sharding/).

`ShardedModelRunner` is `ModelRunner` with the parameters laid out by the layout's rules, one KV
buffer per device, and the shard_map step of agentjax/runner/sharded_step.py; the host side (rows, sampling, page
copies) is the single-device runner's. Its `page_size` is the effective page the KV manager counts
(block_size x DCP). `execute_ranks` runs one step for several data-parallel ranks at once (each its
own rows; an idle rank a dummy row), which is how DP/DEP ranks step in lockstep.
`make_model_runner` picks the runner for an engine's settings after checking that the layout fits.
"""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence

import jax
import numpy as np

from agentjax.config import EngineConfig, ModelConfig
from agentjax.errors import ParallelLayoutError
from agentjax.kv.cache_layout import state_group_ids
from agentjax.kv_buffers import KVPool
from agentjax.buckets import StepBuckets, lockstep_buckets
from agentjax.ragged_batch import RaggedBatch
from agentjax.runner.compilation_cache import enable_compilation_cache
from agentjax.runner.model_runner import ModelRunner, padded_page_copies
from agentjax.runner.sampler import SamplingMetadata

logger = logging.getLogger(__name__)


def make_model_runner(cfg: ModelConfig, params, num_pages: int, engine_cfg: EngineConfig,
                      drafting=None, kv_layout=None) -> ModelRunner:
    """The runner an engine's settings ask for (after `sharding.mesh.check_layout`); `drafting` (a device
    drafter of speculative decoding) runs on one device only; `kv_layout` places the KV memory."""
    from agentjax.runner.distributed import distributed_runner

    parallel = engine_cfg.parallel
    page_size = parallel.kv_page_tokens(engine_cfg.block_size)
    if parallel.is_single_device and engine_cfg.num_processes == 1:
        return ModelRunner(cfg, params, num_pages, page_size, engine_cfg.numerics, engine_cfg.logprobs_mode,
                           drafting=drafting, kv_layout=kv_layout, step_buckets=engine_cfg.step_buckets)
    check_engine_layout(cfg, engine_cfg)
    runner = ShardedModelRunner(cfg, params, num_pages, page_size, engine_cfg.numerics, engine_cfg.logprobs_mode,
                                parallel=parallel, kv_layout=kv_layout, step_buckets=engine_cfg.step_buckets)
    return distributed_runner(runner, engine_cfg)  # process 0 announces its calls to the others


def check_engine_layout(cfg: ModelConfig, engine_cfg: EngineConfig) -> None:
    """`ParallelLayoutError` unless the layout fits the model, the devices and the engine's other settings."""
    from sharding.mesh import check_layout

    parallel = engine_cfg.parallel
    check_layout(cfg, parallel, available_devices=len(jax.devices()), block_size=engine_cfg.block_size)
    if engine_cfg.kv_offload_enabled and (parallel.data_parallel_size > 1 or engine_cfg.num_processes > 1):
        raise ParallelLayoutError(f"KV offload tiers do not run with data parallelism or several processes yet "
                                  f"(layout {parallel.name}, {engine_cfg.num_processes} processes); they run with "
                                  "TP, DCP and PCP in one process. Turn off host_cache_gb, disk_cache_dir and "
                                  "mooncake_master")


class ShardedModelRunner(ModelRunner):
    """Owns the laid-out parameters and the per-device KV buffers; one shard_map step per call."""

    def __init__(self, cfg: ModelConfig, params, num_pages: int, page_size: int, numerics: str = "fast",
                 logprobs_mode: str = "raw_logprobs", *, parallel, devices=None, kv_layout=None,
                 step_buckets: StepBuckets = StepBuckets()):
        from sharding.mesh import build_mesh
        from sharding.modules import place_parameters, specs_of
        from agentjax.runner.sharded_step import ShardedStep

        enable_compilation_cache()
        if page_size % parallel.decode_context_parallel_size:
            raise ParallelLayoutError(f"page_size={page_size} is not a multiple of decode_context_parallel_size="
                                      f"{parallel.decode_context_parallel_size}")
        self.cfg, self.logprobs_mode, self.numerics = cfg, logprobs_mode, numerics
        self.page_size, self.num_pages, self.parallel = page_size, num_pages, parallel
        self.step_buckets = step_buckets
        self.mesh = build_mesh(parallel, devices)
        self.sharded = ShardedStep(cfg, parallel, self.mesh, numerics)
        self.params = place_parameters(params, self.sharded.plans, self.mesh)
        self.sharded.param_specs = specs_of(self.params)  # stored (quantised) weights shard part by part
        self.kv_layout = kv_layout
        pooled = kv_layout is not None and kv_layout.mode == "pool"
        if kv_layout is not None:
            self.num_pages = num_pages = kv_layout.num_slabs
        self.page_sizes = kv_layout.tokens_per_page() if pooled else page_size
        self.kv_pages = self.sharded.new_kv_pages(num_pages, page_size, kv_layout)
        self.state_groups = kv_layout.state_groups() if pooled else state_group_ids(cfg)
        self.state_interval = kv_layout.state_interval() if kv_layout is not None else 0
        data_ranks = parallel.data_parallel_size
        self._steps = {g: self._sampling_step(g) for g in (True, False)} if data_ranks == 1 else {}
        self.compiled_shapes: set[tuple] = set()
        self.last_device_s = 0.0
        logger.info("layout %s over %d devices", parallel.name, parallel.num_devices)

    def _sampling_step(self, greedy_only: bool, **variant):
        """One data rank's step through the sharded step (inputs get the leading `[data]` axis)."""
        if self.parallel.data_parallel_size != 1:
            raise ParallelLayoutError("a data-parallel runner steps through execute_ranks")
        jitted = self.sharded.sampling_step(greedy_only, **variant)

        def step(params, kv_pages, batch, *inputs):
            *results, kv_pages = jitted(params, kv_pages, self._global(_stacked([(batch, *inputs)]), "data"),
                                        self._global(self._pcp_tokens([batch]), "pcp"))
            return (*jax.tree.map(lambda a: a[0], self._fetch(tuple(results))), kv_pages)

        return step

    def _pcp_tokens(self, batches: Sequence[RaggedBatch]) -> np.ndarray:
        from sharding.attention import pcp_token_split

        pcp = self.parallel.prefill_context_parallel_size
        if pcp == 1:
            return np.zeros((1,), np.int32)
        if len(batches) != 1:
            raise ParallelLayoutError("prefill context parallelism runs with data_parallel_size=1")
        return pcp_token_split(batches[0].cu_q_lens, batches[0].num_tokens, pcp)

    def execute_ranks(self, rank_rows: Sequence[Sequence | None], rank_sampling: Sequence[Sequence | None]
                      ) -> list[np.ndarray | None]:
        """One lockstep step of every data rank: `rank_rows[r]` as `execute` takes rows (None: the rank
        is idle and runs a dummy row on its null page). Greedy unless some row samples. Returns each
        rank's tokens (None for idle ranks)."""
        ranks = self.parallel.data_parallel_size
        if len(rank_rows) != ranks:
            raise ParallelLayoutError(f"execute_ranks got {len(rank_rows)} ranks' rows, the layout has {ranks}")
        groups = len(self.kv_layout.groups) if isinstance(self.kv_pages, KVPool) else len(self.kv_pages)
        dummy_row = ([0], 0, [[0] for _ in range(groups)])
        rows = [list(r) if r else [dummy_row] for r in rank_rows]
        sampling = [list(s) if r else [(0.0, 0, 1.0, 0, 0)] for r, s in zip(rank_rows, rank_sampling)]
        tokens_bucket, seqs_bucket = lockstep_buckets([sum(len(row[0]) for row in r) for r in rows],
                                                      [len(r) for r in rows], self.step_buckets)
        batches = [RaggedBatch.build(r, self.page_sizes, state_groups=self.state_groups, token_buckets=(tokens_bucket,),
                                     seq_buckets=(seqs_bucket,), page_buckets=self.step_buckets.pages,
                                     state_interval=self.state_interval) for r in rows]
        batches = _common_page_tables(batches)
        greedy_only = all(s[0] == 0.0 for per_rank in sampling for s in per_rank)
        metas = [_sampling_metadata(s, seqs_bucket, self.cfg.vocab_size, greedy_only) for s in sampling]
        jitted = self.sharded.sampling_step(greedy_only)
        started = time.perf_counter()
        with self._compiling((*batches[0].shape_key(), greedy_only, "ranks")):
            tokens, self.kv_pages = jitted(self.params, self.kv_pages,
                                           self._global(_stacked(list(zip(batches, metas))), "data"),
                                           self._global(self._pcp_tokens([batches[0]] if ranks == 1 else batches), "pcp"))
            tokens = self._fetch(tokens)
        self.last_device_s = time.perf_counter() - started
        return [tokens[r, :len(rank_rows[r])] if rank_rows[r] else None for r in range(ranks)]

    def copy_pages(self, copies: Sequence[tuple[int, int, int]], rank: int = 0) -> None:
        """Page copies (see `ModelRunner.copy_pages`) on the devices of data rank `rank`."""
        pooled = isinstance(self.kv_pages, KVPool)
        buffers = self.kv_pages if pooled else list(self.kv_pages)
        for group, sources, destinations in padded_page_copies(copies):
            on_devices = _data_rank_of_devices(self.parallel) == rank
            arrays = tuple(self._global(a, None) for a in (sources, destinations, on_devices))
            if pooled:
                buffers = _copy_device_pool_pages(buffers, *arrays, group=group)
            else:
                buffers[group] = _copy_device_pages(buffers[group], *arrays)
        self.kv_pages = buffers if pooled else tuple(buffers)

    def reset_kv(self) -> None:
        self.kv_pages = self.sharded.new_kv_pages(self.num_pages, self.page_size, self.kv_layout)

    def _global(self, tree, role: str | None):
        """Host inputs as arrays over the mesh (split over `role` on their leading axis, or replicated).
        One process passes numpy as it is; several build each array from their own (equal) copies."""
        if jax.process_count() == 1:
            return tree
        from jax.sharding import NamedSharding, PartitionSpec

        from sharding.mesh import axes

        spec = PartitionSpec(axes(role)) if role and self.parallel.role_size(role) > 1 else PartitionSpec()
        sharding = NamedSharding(self.mesh, spec)

        def build(value):
            value = np.asarray(value)
            return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

        return jax.tree.map(build, tree)

    def _fetch(self, tree):
        """Step outputs on the host (from every process's devices when there are several)."""
        if jax.process_count() == 1:
            return jax.tree.map(lambda a: np.asarray(jax.device_get(a)), tree)
        from jax.experimental import multihost_utils

        return jax.tree.map(lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True)), tree)


def _stacked(trees: list):
    from agentjax.runner.sharded_step import stack_for_data

    return stack_for_data(trees)


def _common_page_tables(batches: list[RaggedBatch]) -> list[RaggedBatch]:
    """Pad every rank's page tables and state saves to the widest rank's (0-padded and past the tokens,
    like `RaggedBatch.build`)."""
    widths = [max(b.page_indices[g].shape[1] for b in batches) for g in range(batches[0].num_groups)]
    saves = max(len(b.state_save_tokens) for b in batches)
    return [b.replace(page_indices=tuple(np.pad(t, ((0, 0), (0, w - t.shape[1]))) for t, w in
                                         zip(b.page_indices, widths)),
                      state_save_tokens=np.pad(b.state_save_tokens, (0, saves - len(b.state_save_tokens)),
                                               constant_values=b.num_tokens),
                      state_save_cols=np.pad(b.state_save_cols, (0, saves - len(b.state_save_cols))))
            for b in batches]


def _sampling_metadata(sampling, rows: int, vocab_size: int, greedy_only: bool) -> SamplingMetadata:
    meta = SamplingMetadata.greedy(rows, vocab_size)
    if not greedy_only:
        for row, (temperature, top_k, top_p, seed, generated) in enumerate(sampling):
            meta.temperature[row], meta.top_k[row], meta.top_p[row] = temperature, top_k, top_p
            meta.seeds[row], meta.num_generated[row] = seed, generated
    return meta


def _data_rank_of_devices(parallel) -> np.ndarray:
    """The data rank of each device, in the KV buffers' device order (the mesh's)."""
    sizes = parallel.axis_sizes
    return np.repeat(np.arange(sizes["data"]), parallel.num_devices // sizes["data"])


@functools.partial(jax.jit, donate_argnums=(0,), static_argnames=("group",))
def _copy_device_pool_pages(pool: KVPool, sources, destinations, on_device, *, group: int) -> KVPool:
    """`copy_pool_pages` on each device's part of a pool `[devices, ...]`, kept where `on_device[d]`."""
    from agentjax.kv_buffers import move_pool_pages

    def one(array):
        return move_pool_pages(KVPool(array, pool.layout), sources, destinations, group=group).array

    moved = jax.vmap(one)(pool.array)
    keep = on_device.reshape(-1, *([1] * (pool.array.ndim - 1)))
    return KVPool(jax.numpy.where(keep, moved, pool.array), pool.layout)


@functools.partial(jax.jit, donate_argnums=(0,))
def _copy_device_pages(buffer, sources, destinations, on_device):
    """`buffer[d, :, destinations[i]] = buffer[d, :, sources[i]]` in order, on devices where `on_device[d]`."""
    def copy_one(i, buf):
        moved = buf.at[:, :, destinations[i]].set(buf[:, :, sources[i]])
        keep = on_device.reshape(-1, *([1] * (buf.ndim - 1)))
        return jax.numpy.where(keep, moved, buf)

    return jax.lax.fori_loop(0, sources.shape[0], copy_one, buffer)
