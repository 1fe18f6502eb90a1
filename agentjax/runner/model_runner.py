"""The device side of the engine: parameters, the KV buffers, and the compiled step per shape.

`ModelRunner.execute(rows, sampling, kv_copies=...)` first runs the scheduler's state-page copies
(recurrent-state saves and restores), then pads the rows into a `RaggedBatch`, runs the jitted
sampling step (the KV buffers are donated and replaced by the returned ones) and returns one token
per row. It records every compiled shape, so tests and benchmarks can check that steady state
never recompiles. `execute_extended` does the same for a step whose rows ask for penalties or log
probabilities (`StepExtras`), through the step's extended variants, and also returns them. With a
device drafter (speculative decoding's "mtp" or "draft_model", `drafting`) every step also proposes
each row's next draft tokens (`last_drafts`); a draft model's parameters and KV buffers ride along.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Sequence

import jax
import numpy as np

from agentjax.buckets import StepBuckets
from agentjax.config import ModelConfig
from agentjax.kv.cache_layout import state_group_ids
from agentjax.kv_buffers import KVPool, copy_pool_pages, new_pool
from agentjax.page_table_rows import PageTableRows
from agentjax.progress import Heartbeat
from agentjax.ragged_batch import STATE_SAVE_BUCKETS, RaggedBatch, bucket
from agentjax.runner.compilation_cache import compile_notice, describe_step_shape, enable_compilation_cache
from agentjax.runner.drafters import SpecInputs
from agentjax.runner.extras import StepExtras, penalty_inputs, prompt_logprob_inputs
from agentjax.runner.sampler import SamplingMetadata
from agentjax.runner.step import make_sampling_step

logger = logging.getLogger(__name__)


def kv_memory_summary(kv_layout, num_pages: int, page_size: int) -> str:
    """What the KV allocation holds, for the log: a pool's slabs and page groups, or pages of one size."""
    if kv_layout is None or kv_layout.mode != "pool":
        return f"{num_pages - 1} pages of {page_size} tokens"
    if len(kv_layout.groups) == 1 and kv_layout.groups[0].pages_per_slab == 1:  # a slab is a page
        return f"{num_pages - 1} pages of {kv_layout.groups[0].tokens_per_page} tokens"
    groups = ", ".join(f"{name} {g.tokens_per_page}" for name, g in zip(kv_layout.group_names(), kv_layout.groups))
    return (f"{kv_layout.num_slabs - 1} slabs of {kv_layout.slab_bytes / 2**20:.2f} MiB shared by "
            f"{len(kv_layout.groups)} page groups (tokens per page: {groups})")


def kv_cache_bytes(kv_pages) -> int:
    """Bytes the KV buffers hold (over every device, for sharded buffers)."""
    return sum(int(buffer.nbytes) for buffer in jax.tree.leaves(kv_pages))

# Copies per call, padded to these sizes (pad copies move the null page onto itself).
COPY_BUCKETS = (4, 16, 64, 256)


def padded_page_copies(copies: Sequence[tuple[int, int, int]]):
    """`(group, sources, destinations)` per page group of `(group, src, dst)` copies, in group order, each
    group's copies in the order given, padded with page 0 -> 0 copies to a `COPY_BUCKETS` size."""
    for group in sorted({c[0] for c in copies}):
        pairs = [(src, dst) for g, src, dst in copies if g == group]
        size = bucket(len(pairs), COPY_BUCKETS)
        sources = np.zeros(size, np.int32)
        destinations = np.zeros(size, np.int32)
        sources[:len(pairs)], destinations[:len(pairs)] = zip(*pairs)
        yield group, sources, destinations


@functools.partial(jax.jit, donate_argnums=(0,))
def copy_pages(buffer: jax.Array, sources: jax.Array, destinations: jax.Array) -> jax.Array:
    """`buffer[:, destinations[i]] = buffer[:, sources[i]]` for each i in order (a later copy may
    read what an earlier one wrote)."""

    def copy_one(i, buf):
        return buf.at[:, destinations[i]].set(buf[:, sources[i]])

    return jax.lax.fori_loop(0, sources.shape[0], copy_one, buffer)


class ModelRunner:
    """Owns params and KV pages; runs one ragged batch per call."""

    # No device drafter unless `__init__` builds one (the sharded runner builds its own state without it).
    drafting = None
    drafter = None
    # With a drafter: each row's proposed next drafts from the last call, [rows, k].
    last_drafts: np.ndarray | None = None
    # The batch page tables kept between steps (written where they changed; made on first use).
    page_table_rows: PageTableRows | None = None
    greedy_metadata: dict | None = None  # by sample count (`_greedy_metadata`)

    def __init__(self, cfg: ModelConfig, params, num_pages: int, page_size: int, numerics: str = "fast",
                 logprobs_mode: str = "raw_logprobs", drafting=None, kv_layout=None,
                 step_buckets: StepBuckets = StepBuckets()):
        """`drafting` (agentjax.spec_decode.setup.Drafting, or None) names a device drafter: the method,
        its draft count and, for a draft model, its config and parameters. `kv_layout` (a
        `KVMemoryLayout`) places the KV memory: a "pool" layout's slabs, or with None / "shared" one
        buffer per kind of `num_pages` pages of `page_size` tokens. `step_buckets`: the sizes a batch
        pads to (`EngineConfig.step_buckets`)."""
        enable_compilation_cache()
        self.cfg = cfg
        self.logprobs_mode = logprobs_mode
        self.params = params
        self.page_size = page_size
        self.kv_layout = kv_layout
        pooled = kv_layout is not None and kv_layout.mode == "pool"
        self.num_pages = kv_layout.num_slabs if kv_layout is not None else num_pages
        # tokens per page of each batch page table (a pool's page groups each have their own)
        self.page_sizes = kv_layout.tokens_per_page() if pooled else page_size
        self.numerics = numerics
        self.step_buckets = step_buckets
        self.drafting = drafting
        self.drafter = make_drafter(cfg, drafting, numerics, page_size, kv_layout) if drafting is not None else None
        what = kv_memory_summary(kv_layout, self.num_pages, page_size)
        with Heartbeat(logger, f"allocating the KV cache: {what}", doing="allocating the KV cache") as beat:
            self.kv_pages = self._new_kv_pages()
        logger.info("KV cache: %s (and the null %s), %.2f GiB on the device (%.1f s)", what,
                    "page" if what.endswith("tokens") else "slab", kv_cache_bytes(self.kv_pages) / 2**30, beat.elapsed)
        self.state_groups = kv_layout.state_groups() if pooled else state_group_ids(cfg)
        self.state_interval = kv_layout.state_interval() if kv_layout is not None else 0
        self._steps = {
            True: make_sampling_step(cfg, numerics, greedy_only=True, drafter=self.drafter),
            False: make_sampling_step(cfg, numerics, greedy_only=False, drafter=self.drafter),
        }
        self.compiled_shapes: set[tuple] = set()
        # Wall time of the last call spent waiting on the device (dispatch to tokens on the host).
        self.last_device_s = 0.0

    @property
    def step_params(self):
        """The step's parameters: the model's, or with a draft model (the model's, the draft model's)."""
        drafting = self.drafting
        return (self.params, drafting.draft_params) if drafting is not None and drafting.draft_cfg else self.params

    def _new_kv_pages(self):
        # Committed to the device from the start: the offload page movers return committed arrays, and a
        # step sees an uncommitted and a committed KV as two shapes (a compile after warm-up).
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        if self.kv_layout is not None and self.kv_layout.mode == "pool":
            return new_pool(self.kv_layout, device)
        pages = tuple(self.cfg.new_kv_pages(self.num_pages, self.page_size))
        if self.drafting is not None and self.drafting.draft_cfg is not None:
            pages += tuple(self.drafting.draft_cfg.new_kv_pages(self.num_pages, self.page_size))
        return jax.device_put(pages, device)

    def execute(
        self,
        rows: Sequence[tuple[Sequence[int], int, Sequence]],
        sampling: Sequence[tuple[float, int, float, int, int]],
        token_bitmask: np.ndarray | None = None,
        kv_copies: Sequence[tuple[int, int, int]] = (),
        sample_counts: Sequence[int] | None = None,
        next_tokens: Sequence[int] | None = None,
    ) -> np.ndarray:
        """Run rows of `(new_tokens, num_computed, page_tables)` (one page list per KV group);
        `sampling` per row is `(temperature, top_k, top_p, seed, num_generated)`; `token_bitmask`
        (`[samples, words]`, optional) limits each sampled position's tokens; `kv_copies` are `(group,
        source page, destination page)` copies to run first, in order. Returns a token per row, or with
        `sample_counts` (speculative decoding: a row samples its last `sample_counts[row]` tokens, the
        i-th of them drawn as the row's `num_generated + i`-th token) the tokens of every row's sampled
        positions, row after row. With a drafter, `next_tokens[row]` is the known token after the row's
        last one (-1 where the row's sample is kept) and `last_drafts` holds the next drafts."""
        batch, meta, greedy_only = self._prepare(rows, sampling, token_bitmask, kv_copies, sample_counts)
        started = time.perf_counter()
        with self._compiling(self._shape_key(batch, greedy_only)):
            spec = self._spec_inputs(batch, rows, next_tokens)
            tokens, self.kv_pages = self._steps[greedy_only](self.step_params, self.kv_pages, batch, meta, *spec)
            tokens = self._take_drafts(tokens, len(rows))
            tokens = np.asarray(jax.device_get(tokens))[: sum(sample_counts) if sample_counts else len(rows)]
        self.last_device_s = time.perf_counter() - started
        return tokens

    def compile_step(self, rows: Sequence[tuple[Sequence[int], int, Sequence]],
                     sampling: Sequence[tuple[float, int, float, int, int]]) -> None:
        """Build (or load from the compilation cache) the executable `execute` would run for these rows,
        without running it (agentjax/runner/warmup.py); a runner whose step is not one jitted function
        (a layout's, a drafter's) runs the step on them instead."""
        batch, meta, greedy_only = self._prepare(rows, sampling, None, ())
        step = self._steps[greedy_only]
        if not hasattr(step, "lower") or self.drafter is not None:
            self.execute(rows, sampling)
            return
        with self._compiling(self._shape_key(batch, greedy_only)):
            step.lower(self.step_params, self.kv_pages, batch, meta).compile()

    def _spec_inputs(self, batch: RaggedBatch, rows, next_tokens) -> tuple:
        """The drafter's extra step argument (none without a drafter)."""
        if self.drafter is None:
            return ()
        return (SpecInputs.build(batch, rows, next_tokens if next_tokens is not None else [-1] * len(rows)),)

    def _take_drafts(self, tokens, num_rows: int):
        if self.drafter is None:
            return tokens
        tokens, drafts = tokens
        self.last_drafts = np.asarray(jax.device_get(drafts))[:num_rows]
        return tokens

    def execute_extended(
        self,
        rows: Sequence[tuple[Sequence[int], int, Sequence]],
        sampling: Sequence[tuple[float, int, float, int, int]],
        extras: StepExtras,
        token_bitmask: np.ndarray | None = None,
        kv_copies: Sequence[tuple[int, int, int]] = (),
        sample_counts: Sequence[int] | None = None,
        next_tokens: Sequence[int] | None = None,
    ) -> tuple[np.ndarray, dict]:
        """`execute` for a step whose rows ask for `extras`. Returns the tokens and a dict with
        `"sampled"`: `(logprob, rank, top ids, top values)` arrays by sampled position (by row without
        `sample_counts`; when any row asked), and `"prompt"`: per entry of `extras.prompt_positions`,
        `(row, those four arrays)`. Penalised rows must sample one position."""
        batch, meta, greedy_only = self._prepare(rows, sampling, token_bitmask, kv_copies, sample_counts)
        penalties = None
        if extras.penalties:
            last_sample = np.cumsum(sample_counts) - 1 if sample_counts else np.arange(len(rows))
            penalties = penalty_inputs(batch.num_samples, {int(last_sample[row]): p for row, p in extras.penalties.items()})
        prompt, slices = (prompt_logprob_inputs(batch, extras.prompt_positions) if extras.prompt_positions
                          else (None, []))
        mode = self.logprobs_mode if extras.logprobs else None
        step = self._sampling_step(greedy_only, penalties=penalties is not None, logprobs_mode=mode,
                                   prompt_logprobs=prompt is not None)
        key = (*self._shape_key(batch, greedy_only), penalties is not None and penalties.token_ids.shape[1],
               mode, prompt is not None and prompt.indices.shape[0])
        started = time.perf_counter()
        with self._compiling(key):
            spec = self._spec_inputs(batch, rows, next_tokens)
            tokens, aux, self.kv_pages = step(self.step_params, self.kv_pages, batch, meta, penalties, prompt, *spec)
            tokens = self._take_drafts(tokens, len(rows))
            tokens, aux = jax.device_get((tokens, aux))
        self.last_device_s = time.perf_counter() - started
        num_samples = sum(sample_counts) if sample_counts else len(rows)
        out: dict = {}
        if "sampled" in aux:
            out["sampled"] = tuple(np.asarray(a)[:num_samples] for a in aux["sampled"])
        if "prompt" in aux:
            arrays = [np.asarray(a) for a in aux["prompt"]]
            out["prompt"] = [(row, tuple(a[start:stop] for a in arrays)) for row, start, stop in slices]
        return np.asarray(tokens)[:num_samples], out

    def _sampling_step(self, greedy_only: bool, **variant):
        """The jitted sampling step of one variant (`make_sampling_step`); the sharded runner
        (agentjax/runner/sharded_runner.py) gives its shard_map step instead."""
        return make_sampling_step(self.cfg, self.numerics, greedy_only, drafter=self.drafter, **variant)

    @staticmethod
    def _shape_key(batch: RaggedBatch, greedy_only: bool) -> tuple:
        """The compiled shape: a step that samples more positions than rows (speculative decoding)
        adds its sample count."""
        key = (*batch.shape_key(), greedy_only)
        if batch.state_save_tokens is not None and len(batch.state_save_tokens) > STATE_SAVE_BUCKETS[0]:
            key = (*key, ("state saves", len(batch.state_save_tokens)))
        return key if batch.num_samples == batch.num_seqs else (*key, ("samples", batch.num_samples))

    def _prepare(self, rows, sampling, token_bitmask, kv_copies, sample_counts=None
                 ) -> tuple[RaggedBatch, SamplingMetadata, bool]:
        if kv_copies:
            self.copy_pages(kv_copies)
        if self.page_table_rows is None:
            self.page_table_rows = PageTableRows()
        # each step waits for its tokens before the next is built, so the device has read the kept tables
        buckets = self.step_buckets
        batch = RaggedBatch.build(rows, self.page_sizes, state_groups=self.state_groups, sample_counts=sample_counts,
                                  state_interval=self.state_interval, page_table_rows=self.page_table_rows,
                                  token_buckets=buckets.tokens, seq_buckets=buckets.rows, page_buckets=buckets.pages)
        greedy_only = all(s[0] == 0.0 for s in sampling)
        if greedy_only and token_bitmask is None:
            meta = self._greedy_metadata(batch.num_samples)
        else:
            meta = SamplingMetadata.greedy(batch.num_samples, self.cfg.vocab_size)
        if token_bitmask is not None:
            meta.token_bitmask[: len(token_bitmask)] = token_bitmask
        if not greedy_only:
            counts = sample_counts or [1] * len(rows)
            sample = 0
            for (temperature, top_k, top_p, seed, generated), count in zip(sampling, counts):
                # the row's i-th sampled position draws its (generated + i)-th token, with that token's key
                stop = sample + count
                meta.temperature[sample:stop] = temperature
                meta.top_k[sample:stop] = top_k
                meta.top_p[sample:stop] = top_p
                meta.seeds[sample:stop] = seed
                meta.num_generated[sample:stop] = np.arange(generated, generated + count)
                sample = stop
        return batch, meta, greedy_only

    def _greedy_metadata(self, num_samples: int) -> SamplingMetadata:
        """The metadata of a greedy step without constraints, made once per sample count (its bitmask of
        every token allowed is megabytes at a full vocabulary); never written after it is made."""
        if self.greedy_metadata is None:
            self.greedy_metadata = {}
        meta = self.greedy_metadata.get(num_samples)
        if meta is None:
            meta = self.greedy_metadata[num_samples] = SamplingMetadata.greedy(num_samples, self.cfg.vocab_size)
        return meta

    def _compiling(self, key: tuple):
        """Around a step call: the first call of a new shape compiles, and says so (agentjax.progress)."""
        if key in self.compiled_shapes:
            return contextlib.nullcontext()
        self.compiled_shapes.add(key)
        return compile_notice(describe_step_shape(key))

    def copy_pages(self, copies: Sequence[tuple[int, int, int]]) -> None:
        """Run page copies group by group, each group's in the order given."""
        pooled = isinstance(self.kv_pages, KVPool)
        buffers = self.kv_pages if pooled else list(self.kv_pages)
        for group, sources, destinations in padded_page_copies(copies):
            if pooled:
                buffers = copy_pool_pages(buffers, sources, destinations, group=group)
            else:
                buffers[group] = copy_pages(buffers[group], sources, destinations)
        self.kv_pages = buffers if pooled else tuple(buffers)

    def reset_kv(self) -> None:
        self.kv_pages = self._new_kv_pages()


def make_drafter(cfg: ModelConfig, drafting, numerics: str, page_size: int, kv_layout=None):
    """The device drafter of a `Drafting` (agentjax/runner/drafters.py); with a "pool" `kv_layout`, over
    its page tables (each with its tokens per page) and its kinds."""
    from agentjax.kv.cache_layout import kv_buffer_specs
    from agentjax.runner.drafters import DraftModelDrafter, MTPDrafter

    k = drafting.num_speculative_tokens
    pooled = kv_layout is not None and kv_layout.mode == "pool"
    sizes = kv_layout.tokens_per_page() if pooled else page_size
    if drafting.draft_cfg is None:
        return MTPDrafter(cfg, k, numerics, sizes)
    if pooled:
        kinds = sum(1 for kind in kv_layout.kinds if kind.owner == 0)
        tables = sum(1 for group in kv_layout.groups if group.owner == 0)
        return DraftModelDrafter(cfg, drafting.draft_cfg, kinds, k, numerics, sizes, tables)
    return DraftModelDrafter(cfg, drafting.draft_cfg, len(kv_buffer_specs(cfg, page_size)), k, numerics, page_size)

