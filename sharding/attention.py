"""The attention ops of a parallel layout: TP head groups, decode and prefill context parallelism.

`ParallelAttentionOps` stands in for a mixer's `attention_impl` (agentjax/kernels.py hands it the op):
- TP, batch-invariant numerics: XLA's CPU arithmetic for a head depends on how many heads share the
  call (a GQA group split over ranks, MLA's or the indexer's heads as matmul rows), so each rank
  all-gathers the queries and attends with the single-device head shapes (its KV heads' whole groups,
  every MLA or indexer head), then keeps its own heads. Fast numerics attend the local heads only.
- DCP: KV interleaved over the DCP ranks token by token (a page id holds `page_size` tokens on each
  rank: effective page = page x dcp); each rank writes only its own tokens. Fast numerics all-gather
  the DCP group's queries, attend to the local shard with LSE, and merge with the LSE weights folded
  into the reduce-scatter that hands each rank its heads. Batch-invariant numerics all-gather the
  batch's pages into effective pages and attend as one device does (exact; moves the batch's KV).
- PCP: every op all-gathers this step's new K/V (indexer keys, latent rows) and their slots over the
  PCP ranks, writes all of them, and attends this rank's own query tokens.
`pcp_token_split` is PCP's host side (DualChunkSwap: each row cut into 2P chunks, rank r takes chunks r
and 2P-1-r); `select_rank_tokens` / `unpermute_tokens` its device side.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from agentjax import kernels
from agentjax.errors import ParallelLayoutError
from agentjax.ragged_batch import TOKEN_BUCKETS, bucket
from sharding import collectives
from sharding.mesh import ParallelConfig, axes


@dataclass(frozen=True)
class ParallelAttentionOps:
    """The attention ops of a layout over the base implementation `base` ("reference" or "kernel")."""

    base: str
    parallel: ParallelConfig
    num_heads: int  # the model's query heads (single device)
    num_kv_heads: int
    num_index_heads: int = 0
    invariant: bool = False  # batch-invariant numerics: attend with single-device head shapes

    @property
    def dcp(self) -> int:
        return self.parallel.decode_context_parallel_size

    @property
    def pcp(self) -> int:
        return self.parallel.prefill_context_parallel_size

    def _gather_tokens(self, *arrays):
        return tuple(collectives.all_gather(self.parallel, "pcp", a, axis=0) for a in arrays)

    # ---- head bookkeeping (TP) -------------------------------------------------------------------
    def _first_local(self, count: int):
        """Global index of this rank's first head of `count` heads split (or repeated) over kv_heads."""
        ranks = self.parallel.role_size("kv_heads")
        local, repeat = max(1, count // ranks), max(1, ranks // count)
        return collectives.rank(self.parallel, "kv_heads") // repeat * local

    def _group_queries(self, q, kv_heads_local: int):
        """All-gather the queries, keep the whole groups of this rank's KV heads: `(queries, offset of
        this rank's own heads among them)`."""
        every = collectives.all_gather(self.parallel, "tensor", q, axis=1)
        group = self.num_heads // self.num_kv_heads
        start = self._first_local(self.num_kv_heads) * group
        mine = collectives.rank(self.parallel, "tensor") * q.shape[1] - start
        return jax.lax.dynamic_slice_in_dim(every, start, kv_heads_local * group, axis=1), mine

    def _needs_group(self, q, kv_heads_local: int) -> bool:
        return self.invariant and q.shape[1] < kv_heads_local * (self.num_heads // self.num_kv_heads)

    # ---- GQA ---------------------------------------------------------------------------------
    def ragged_paged_attention(self, q, k, v, kv_pages, kv_lens, page_indices, cu_q_lens, distribution=None, *,
                               slot_mapping, token_positions, sliding_window=None, batch_invariant=False,
                               sinks=None, **kwargs):
        base = dict(kwargs, sinks=sinks, batch_invariant=batch_invariant, impl=self.base)
        heads = q.shape[1]
        grouped = self._needs_group(q, k.shape[1])
        if grouped:
            q, mine = self._group_queries(q, k.shape[1])
        if self.pcp > 1:
            k, v, slot_mapping = self._gather_tokens(k, v, slot_mapping)
        if self.dcp == 1:
            out, kv_pages = kernels.ragged_paged_attention(
                q, k, v, kv_pages, kv_lens, page_indices, cu_q_lens, distribution, slot_mapping=slot_mapping,
                token_positions=token_positions, sliding_window=sliding_window, **base)
        elif batch_invariant:
            kv_pages = self._write_own(kv_pages, kwargs["layer"], jnp.concatenate([k, v], axis=1), slot_mapping)
            gathered, tables = self._gather_pages(kv_pages, kwargs["layer"], page_indices)
            out, _ = kernels.ragged_paged_attention(
                q, k, v, gathered, kv_lens, tables, cu_q_lens, distribution,
                slot_mapping=self._no_write(gathered, slot_mapping), token_positions=token_positions,
                sliding_window=sliding_window, **dict(base, layer=0))
        else:
            if sinks is not None:
                raise ParallelLayoutError("decode context parallelism with attention sinks is not supported")
            kv_pages = self._write_own(kv_pages, kwargs["layer"], jnp.concatenate([k, v], axis=1), slot_mapping)
            q_group = collectives.all_gather(self.parallel, "dcp", q, axis=1)
            window = None if sliding_window is None else sliding_window // self.dcp  # dcp divides it
            part, _, lse = kernels.ragged_paged_attention(
                q_group, k, v, kv_pages, kv_lens, page_indices, cu_q_lens, distribution,
                slot_mapping=self._no_write(kv_pages, slot_mapping),
                token_positions=self._local_positions(token_positions), sliding_window=window, return_lse=True, **base)
            out = collectives.merge_partials_scatter_heads(self.parallel, part, lse)
        if grouped:
            out = jax.lax.dynamic_slice_in_dim(out, mine, heads, axis=1)
        return out, kv_pages

    # ---- MLA ---------------------------------------------------------------------------------
    def mla_paged_attention(self, q, latent, latent_pages, page_indices, *, layer, slot_mapping, token_positions,
                            batch_invariant=False, **kwargs):
        base = dict(kwargs, batch_invariant=batch_invariant, impl=self.base)
        heads = q.shape[1]
        grouped = self.invariant and self.parallel.role_size("tensor") > 1
        if grouped:  # every head: MLA's heads are the rows of one matmul per token
            q = collectives.all_gather(self.parallel, "tensor", q, axis=1)
        if self.pcp > 1:
            latent, slot_mapping = self._gather_tokens(latent, slot_mapping)
        if self.dcp == 1:
            out, latent_pages = kernels.mla_paged_attention(q, latent, latent_pages, page_indices, layer=layer,
                                                            slot_mapping=slot_mapping,
                                                            token_positions=token_positions, **base)
        elif batch_invariant:
            latent_pages = self._write_own(latent_pages, layer, latent, slot_mapping)
            gathered, tables = self._gather_pages(latent_pages, layer, page_indices)
            out, _ = kernels.mla_paged_attention(q, latent, gathered, tables, layer=0,
                                                 slot_mapping=self._no_write(gathered, slot_mapping),
                                                 token_positions=token_positions, **base)
        else:
            latent_pages = self._write_own(latent_pages, layer, latent, slot_mapping)
            q_group = collectives.all_gather(self.parallel, "dcp", q, axis=1)
            part, _, lse = kernels.mla_paged_attention(
                q_group, latent, latent_pages, page_indices, layer=layer,
                slot_mapping=self._no_write(latent_pages, slot_mapping),
                token_positions=self._local_positions(token_positions), return_lse=True, **base)
            out = collectives.merge_partials_scatter_heads(self.parallel, part, lse)
        if grouped:
            start = collectives.rank(self.parallel, "tensor") * heads
            out = jax.lax.dynamic_slice_in_dim(out, start, heads, axis=1)
        return out, latent_pages

    # ---- MiniMax-M3's indexer and block-sparse attention (TP and PCP) --------------------------
    def index_select_blocks(self, q, k, index_pages, page_indices, *, slot_mapping, **kwargs):
        heads = q.shape[1]
        grouped = self.invariant and self.parallel.role_size("kv_heads") > 1
        if grouped:  # every indexer head (repeated ones once): the heads are one matmul's rows
            repeat = max(1, self.parallel.role_size("kv_heads") // self.num_index_heads)
            q = collectives.all_gather(self.parallel, "kv_heads", q, axis=1)[:, ::repeat]
        k, slot_mapping = self._gather_tokens(k, slot_mapping)
        selected, index_pages = kernels.index_select_blocks(q, k, index_pages, page_indices,
                                                            slot_mapping=slot_mapping, impl=self.base, **kwargs)
        if grouped:
            selected = jax.lax.dynamic_slice_in_dim(selected, self._first_local(self.num_index_heads), heads, axis=1)
        return selected, index_pages

    def block_sparse_attention(self, q, k, v, kv_pages, page_indices, selected, *, slot_mapping, **kwargs):
        heads = q.shape[1]
        grouped = self._needs_group(q, k.shape[1])
        if grouped:
            q, mine = self._group_queries(q, k.shape[1])
        k, v, slot_mapping = self._gather_tokens(k, v, slot_mapping)
        out, kv_pages = kernels.block_sparse_attention(q, k, v, kv_pages, page_indices, selected,
                                                       slot_mapping=slot_mapping, impl=self.base, **kwargs)
        if grouped:
            out = jax.lax.dynamic_slice_in_dim(out, mine, heads, axis=1)
        return out, kv_pages

    # ---- DeepSeek-V4 (TP only): shared K=V rows, compressors and indexer replicated ------------------
    def dsv4_attention(self, q, window_pages, window_slot, page_indices, sinks, *args, batch_invariant=False,
                       **kwargs):
        heads = q.shape[1]
        grouped = self.invariant and self.parallel.role_size("tensor") > 1
        if grouped:  # every head: MQA's heads are the rows of one matmul per token
            q = collectives.all_gather(self.parallel, "tensor", q, axis=1)
            sinks = collectives.all_gather(self.parallel, "tensor", sinks, axis=-1)
        out = kernels.dsv4_attention(q, window_pages, window_slot, page_indices, sinks, *args,
                                     batch_invariant=batch_invariant, impl=self.base, **kwargs)
        if grouped:
            out = jax.lax.dynamic_slice_in_dim(out, collectives.rank(self.parallel, "tensor") * heads, heads, axis=1)
        return out

    # ---- KDA: heads are batch dimensions; its state is replicated over DCP ranks -----------------
    def kimi_delta_attention(self, *args, **kwargs):
        return kernels.kimi_delta_attention(*args, impl=self.base, **kwargs)

    # ---- DCP helpers ---------------------------------------------------------------------------
    def _write_own(self, pages, layer, rows, slot_mapping):
        """Scatter this rank's tokens' rows into its pages: a token at offset o of its effective page
        lives on rank `o % dcp` at entry `page * page_size + o // dcp`."""
        num_slots, num_pages, page_size = pages.shape[:3]
        effective = page_size * self.dcp
        page, offset = slot_mapping // effective, slot_mapping % effective
        mine = offset % self.dcp == collectives.rank(self.parallel, "dcp")
        slots = jnp.where(mine, page * page_size + offset // self.dcp, num_pages * page_size)
        flat = pages.reshape(num_slots, num_pages * page_size, *pages.shape[3:])
        return flat.at[layer, slots].set(rows.astype(pages.dtype), mode="drop").reshape(pages.shape)

    @staticmethod
    def _no_write(pages, slot_mapping):
        """Slots past the buffer: the op's own write drops every row (already written by `_write_own`)."""
        return jnp.full_like(slot_mapping, pages.shape[1] * pages.shape[2])

    def _local_positions(self, positions):
        """Key j of this rank's shard is token `j * dcp + rank`; a query at `pos` sees local keys up to
        `floor((pos - rank) / dcp)` (-1: none)."""
        return jnp.floor_divide(positions - collectives.rank(self.parallel, "dcp"), self.dcp)

    def _gather_pages(self, pages, layer, page_indices):
        """The batch's pages of `layer` from every DCP rank, interleaved back into effective pages: a
        one-slot buffer `[1, rows * max_pages, page * dcp, ...]` and the page table `[rows, max_pages]`
        over it (row b's pages in order)."""
        rows, max_pages = page_indices.shape
        local = pages[layer][page_indices]  # [rows, max_pages, page, ...]
        every = jnp.moveaxis(jax.lax.all_gather(local, axes("dcp"), axis=0), 0, 3)  # [..., page, dcp, ...]
        gathered = every.reshape(rows * max_pages, every.shape[2] * self.dcp, *every.shape[4:])[None]
        return gathered, jnp.arange(rows * max_pages, dtype=jnp.int32).reshape(rows, max_pages)


# ---- PCP: which tokens each rank runs ---------------------------------------------------------
def pcp_token_split(cu_q_lens: np.ndarray, num_tokens: int, ranks: int) -> np.ndarray:
    """`[ranks, tokens per rank]` flat token indices: each row's tokens cut into `2 * ranks` chunks as
    even as possible, rank r taking chunks r and `2 * ranks - 1 - r` (DualChunkSwap: every rank gets an
    early and a late chunk, so causal attention work is balanced). Padding entries are `num_tokens`."""
    per_rank: list[list[int]] = [[] for _ in range(ranks)]
    starts = np.asarray(cu_q_lens)
    for row in range(len(starts) - 1):
        start, end = int(starts[row]), int(starts[row + 1])
        if end <= start:
            continue
        chunks = np.array_split(np.arange(start, end), 2 * ranks)
        for r in range(ranks):
            per_rank[r] += chunks[r].tolist() + chunks[2 * ranks - 1 - r].tolist()
    width = bucket(max(1, max(len(t) for t in per_rank)), TOKEN_BUCKETS)
    out = np.full((ranks, width), num_tokens, np.int32)
    for r, tokens in enumerate(per_rank):
        out[r, :len(tokens)] = tokens
    return out


def select_rank_tokens(parallel: ParallelConfig, batch, tokens):
    """This rank's tokens of the batch (padding index = one past the batch: a padding token)."""
    num_seqs = batch.num_seqs

    def take(values, pad):
        return jnp.concatenate([values, jnp.full((1,), pad, values.dtype)])[tokens]

    return dataclasses.replace(
        batch, token_ids=take(batch.token_ids, 0), positions=take(batch.positions, 0),
        seq_ids=take(batch.seq_ids, num_seqs - 1), slot_mapping=tuple(take(s, 0) for s in batch.slot_mapping))


def unpermute_tokens(parallel: ParallelConfig, hidden, tokens, num_tokens: int):
    """Every rank's hidden states gathered and put back in the batch's token order."""
    every = collectives.all_gather(parallel, "pcp", hidden, axis=0)
    order = collectives.all_gather(parallel, "pcp", tokens, axis=0)
    whole = jnp.zeros((num_tokens + 1, *hidden.shape[1:]), hidden.dtype).at[order].set(every)
    return whole[:num_tokens]
