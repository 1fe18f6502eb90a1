"""DeepSeek-V4's sliding-window + compressed attention as a Triton-style Pallas kernel.

`sliding_compressed_attention_kernel` matches `pallas_kernels.dsv4_attention.sliding_compressed_attention`:
one program per (token, tile of query heads) runs shared-KV MQA (one row per key, K = V) over the
token's window rows, then its selected (CSA: the lightning indexer's picks,
`pallas_kernels.dsv4_indexer_kernels`) or all ended (HCA) compressed entries, online softmax, and
the heads' sinks in the final denominator. Each token's arithmetic depends only on its own query,
rows and selection, so no result depends on the batch. Pallas' Triton backend on a GPU (always with
Triton CompilerParams); interpret mode on a CPU (the CPU runner never uses it). In interpret mode
masked-off heads store into a spare head column, never onto a used address.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from agentjax.errors import KernelShapeError
from pallas_kernels import dsv4_attention as reference
from pallas_kernels.online_softmax import online_softmax_init, online_softmax_step
from pallas_kernels.ragged_work import next_power_of_two
from pallas_kernels.triton_call import (
    check_tiles, contract_arguments, lanes, page_rows, spare_rows, store_index, triton_call,
)


def _compressed_attention_kernel(
    window_slot_ref, entry_slot_ref, seq_ref, positions_ref, window_table_ref, entry_table_ref, selected_ref,
    selected_tiles_ref, sinks_ref, q_ref, window_ref, entry_ref, out_ref, *, mode, head_block, num_heads, kv_block,
    window, page_size, num_window_pages, per_page, num_entry_pages, ratio, entry_capacity, dim, sm_scale,
    interpret,
):
    token, head_tile = pl.program_id(0), pl.program_id(1)
    seq, position = seq_ref[token], positions_ref[token]
    head = head_tile * head_block + jnp.arange(head_block, dtype=jnp.int32)
    head_used = head < num_heads
    head = jnp.where(head_used, head, 0)
    store_head = store_index(head, head_used, out_ref.shape[1] - 1, interpret)
    lane, lane_used = lanes(dim)
    token_rows = jnp.full((head_block, 1), token, jnp.int32)
    q = plt.load(q_ref.at[token_rows, head[:, None], lane[None, :]], mask=head_used[:, None] & lane_used[None, :],
                 other=0)
    precise = dict(allow_tf32=False) if q.dtype == jnp.float32 else {}
    offsets = jnp.arange(kv_block, dtype=jnp.int32)

    def load_rows(rows_ref, table_ref, slot, pages_per_slot, rows_per_page, index, used):
        """Rows at per-sequence row `index` (a position, or an entry id) through the page table."""
        flat = page_rows(table_ref, seq, jnp.where(used, index, 0), used, slot, pages_per_slot, rows_per_page)
        rows = plt.load(rows_ref.at[flat[:, None], lane[None, :]], mask=used[:, None] & lane_used[None, :], other=0)
        return rows.astype(q.dtype)

    def update(carry, rows, used):
        scores = jnp.where(used[None, :], plt.dot(q, rows, trans_b=True, **precise) * sm_scale, -jnp.inf)
        return online_softmax_step(carry, scores, lambda p: plt.dot(p.astype(rows.dtype), rows, **precise))

    def window_tile(index, carry):
        offset = index * kv_block + offsets
        key_position = position - window + 1 + offset
        used = (offset < window) & (key_position >= 0)
        rows = load_rows(window_ref, window_table_ref, window_slot_ref[0], num_window_pages, page_size,
                         key_position, used)
        return update(carry, rows, used)

    carry = jax.lax.fori_loop(0, -(-window // kv_block), window_tile, online_softmax_init((head_block,), lane.shape[0]))
    if mode == "selected":  # CSA: the indexer's picks, -1 = none
        width = selected_ref.shape[1]

        def selected_tile(index, carry):
            column = index * kv_block + offsets
            entry = plt.load(selected_ref.at[jnp.full_like(column, token), column], mask=column < width, other=-1)
            used = entry >= 0
            rows = load_rows(entry_ref, entry_table_ref, entry_slot_ref[0], num_entry_pages, per_page, entry, used)
            return update(carry, rows, used)

        carry = jax.lax.fori_loop(0, selected_tiles_ref[token], selected_tile, carry)
    elif mode == "dense":  # HCA: every entry whose block has ended
        ended = jnp.minimum((position + 1) // ratio, entry_capacity)

        def dense_tile(index, carry):
            entry = index * kv_block + offsets
            used = entry < ended
            rows = load_rows(entry_ref, entry_table_ref, entry_slot_ref[0], num_entry_pages, per_page, entry, used)
            return update(carry, rows, used)

        carry = jax.lax.fori_loop(0, (ended + kv_block - 1) // kv_block, dense_tile, carry)
    m, denom, acc = carry
    sink = plt.load(sinks_ref.at[head], mask=head_used, other=0.0).astype(jnp.float32)
    top = jnp.maximum(m, sink)
    alpha = jnp.exp(m - top)
    denom = denom * alpha + jnp.exp(sink - top)
    out = acc * (alpha / denom)[:, None]
    plt.store(out_ref.at[token_rows, store_head[:, None], lane[None, :]], out.astype(out_ref.dtype),
              mask=head_used[:, None] & lane_used[None, :])


def sliding_compressed_attention_kernel(*args, head_block: int | None = None, kv_block: int = 64,
                                        num_warps: int = 4, num_stages: int = 2, interpret: bool = False, **kwargs):
    """`dsv4_attention.sliding_compressed_attention`'s contract (its arguments) as one kernel: the pages
    already hold this step's rows and entries. `head_block` query heads per program (a power of two >= 16;
    default min(heads, 64) rounded up), `kv_block` rows per step. Each token's arithmetic depends
    only on its own query, rows and selection, so batch-invariant numerics need nothing more."""
    call, _ = contract_arguments(reference.sliding_compressed_attention, args, kwargs, tuning=False)
    q, window_pages, sinks, selected = call.q, call.window_pages, call.sinks, call.selected
    entry_pages, entry_slot, entry_page_indices = call.entry_pages, call.entry_slot, call.entry_page_indices
    num_tokens, num_heads, dim = q.shape
    num_slots, num_window_pages, page_size, row_dim = window_pages.shape
    head_block = head_block or max(16, next_power_of_two(min(num_heads, 64)))
    check_tiles("sliding_compressed_attention_kernel", dict(head_block=head_block, kv_block=kv_block))
    if row_dim != dim or sinks.shape != (num_heads,):
        raise KernelShapeError(f"sliding_compressed_attention_kernel: q {q.shape}, window pages {window_pages.shape} "
                               f"and sinks {sinks.shape} do not fit")
    mode = "window" if entry_pages is None else ("dense" if selected is None else "selected")
    if entry_pages is None:  # placeholders the window-only kernel never reads
        entry_pages = jnp.zeros((1, 1, 1, dim), q.dtype)
        entry_slot, entry_page_indices = 0, jnp.zeros((1, 1), jnp.int32)
    elif entry_pages.shape[-1] != dim:
        raise KernelShapeError(f"sliding_compressed_attention_kernel: entry pages {entry_pages.shape} do not fit q "
                               f"{q.shape}")
    entry_slots, num_entry_pages, per_page, _ = entry_pages.shape
    if selected is None:
        selected = jnp.full((num_tokens, 1), -1, jnp.int32)
    # Tiles up to each token's last valid pick (-1 may sit anywhere; a tile's -1 lanes are masked).
    last = jnp.max(jnp.where(selected >= 0, jnp.arange(1, selected.shape[1] + 1, dtype=jnp.int32), 0), axis=1)
    selected_tiles = ((last + kv_block - 1) // kv_block).astype(jnp.int32)
    kernel = functools.partial(
        _compressed_attention_kernel, mode=mode, head_block=head_block, num_heads=num_heads, kv_block=kv_block,
        window=int(call.window), page_size=page_size, num_window_pages=num_window_pages, per_page=per_page,
        num_entry_pages=num_entry_pages, ratio=int(call.ratio), entry_capacity=entry_page_indices.shape[1] * per_page,
        dim=dim, sm_scale=float(call.sm_scale), interpret=bool(interpret))
    out = triton_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_tokens, num_heads + spare_rows(interpret), dim), q.dtype),
        grid=(num_tokens, pl.cdiv(num_heads, head_block)), name=f"dsv4_{mode}_attention", num_warps=num_warps,
        num_stages=num_stages, interpret=interpret,
    )(jnp.asarray(call.window_slot, jnp.int32).reshape(1), jnp.asarray(entry_slot, jnp.int32).reshape(1),
      call.token_seq_ids.astype(jnp.int32), call.token_positions.astype(jnp.int32),
      call.window_page_indices.astype(jnp.int32),
      entry_page_indices.astype(jnp.int32), selected.astype(jnp.int32), selected_tiles, sinks.astype(jnp.float32), q,
      window_pages.reshape(num_slots * num_window_pages * page_size, dim),
      entry_pages.reshape(entry_slots * num_entry_pages * per_page, dim))
    return out[:, :num_heads]
