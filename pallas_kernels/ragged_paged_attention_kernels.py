"""The Triton-style Pallas kernel of ragged paged attention, matching the jnp reference
(pallas_kernels/ragged_paged_attention.py) argument for argument and result for result.

GPU: Hopper and Blackwell through Pallas' Triton backend (deprecated from jax 0.11, no removal date); CPU:
interpret mode only, and the CPU runner never uses it. One program attends one work item
(pallas_kernels/ragged_work.py: up to `query_rows // group` consecutive query tokens of one sequence,
times the `group` query heads of one KV head, as `query_rows` dot rows) over one share of that
sequence's KV blocks.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from agentjax.errors import KernelShapeError
from pallas_kernels.online_softmax import fold_sink, online_softmax_init, online_softmax_result, online_softmax_step
from pallas_kernels.ragged_paged_attention import causal_visible, ragged_paged_attention, soft_capped
from pallas_kernels.ragged_work import merge_split_partials, next_power_of_two, work_items
from pallas_kernels.triton_call import (
    check_tiles, default_query_rows, item_rows, page_rows, query_positions, ragged_operands, spare_rows, store_index,
    triton_call,
)


def _ragged_paged_attention_kernel(
    layer_ref, item_seq_ref, item_start_ref, item_count_ref, kv_lens_ref, cu_q_lens_ref, table_ref, q_ref, kv_ref,
    sinks_ref, out_ref, lse_ref, *, group, query_rows, kv_block, page_size, num_pages, num_kv_heads, dim,
    sm_scale, sliding_window, soft_cap, num_splits, apply_sinks, interpret,
):
    item, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq, start, count = item_seq_ref[item], item_start_ref[item], item_count_ref[item]
    layer = layer_ref[0]
    padded_dim = next_power_of_two(dim)

    token, head, row_used = item_rows(query_rows, group, start, count, first_head=kv_head * group)
    store_token = store_index(token, row_used, out_ref.shape[1] - 1, interpret)
    lane = jnp.arange(padded_dim, dtype=jnp.int32)
    lane_used = lane < dim
    row_mask = row_used[:, None] & lane_used[None, :]

    position, first_position = query_positions(kv_lens_ref, cu_q_lens_ref, seq, start, token)
    kv_end = first_position + count
    kv_begin = jnp.maximum(first_position - sliding_window + 1, 0) if sliding_window is not None else 0
    block_lo = kv_begin // kv_block
    block_hi = jnp.where(count > 0, (kv_end + kv_block - 1) // kv_block, block_lo)
    per_split = (block_hi - block_lo + num_splits - 1) // num_splits
    split_lo = jnp.minimum(block_lo + split * per_split, block_hi)
    split_hi = jnp.minimum(split_lo + per_split, block_hi)

    q = plt.load(q_ref.at[token[:, None], head[:, None], lane[None, :]], mask=row_mask, other=0)
    precise = dict(allow_tf32=False) if q.dtype == jnp.float32 else {}
    key_offsets = jnp.arange(kv_block, dtype=jnp.int32)
    kv_heads_column = jnp.full((kv_block, 1), kv_head, jnp.int32)

    def attend_block(block, carry):
        key_position = block * kv_block + key_offsets
        key_used = key_position < kv_end
        kv_row = page_rows(table_ref, seq, key_position, key_used, layer, num_pages, page_size)
        key_mask = key_used[:, None] & lane_used[None, :]
        k = plt.load(kv_ref.at[kv_row[:, None], kv_heads_column, lane[None, :]], mask=key_mask, other=0)
        v = plt.load(kv_ref.at[kv_row[:, None], kv_heads_column + num_kv_heads, lane[None, :]], mask=key_mask, other=0)
        scores = soft_capped(plt.dot(q, k.astype(q.dtype), trans_b=True, **precise) * sm_scale, soft_cap)
        visible = causal_visible(key_position, position, sliding_window) & key_used[None, :]
        scores = jnp.where(visible, scores, -jnp.inf)
        return online_softmax_step(carry, scores, lambda p: plt.dot(p.astype(v.dtype), v, **precise))

    carry = jax.lax.fori_loop(split_lo, split_hi, attend_block, online_softmax_init((query_rows,), padded_dim))
    if apply_sinks:
        carry = fold_sink(carry, plt.load(sinks_ref.at[head]))
    out, lse = online_softmax_result(carry)
    split_rows = jnp.full((query_rows,), split, jnp.int32)
    plt.store(out_ref.at[split_rows[:, None], store_token[:, None], head[:, None], lane[None, :]],
              out.astype(out_ref.dtype), mask=row_mask)
    plt.store(lse_ref.at[split_rows, store_token, head], lse, mask=row_used)


def ragged_paged_attention_kernel(*args, interpret: bool = False, **kwargs):
    """`ragged_paged_attention`'s contract (write K/V, attend; the same arguments and results) with the
    attention as one kernel (`paged_attention_kernel`, whose tuning keywords it takes). The per-token
    metadata is recomputed from `kv_lens`/`cu_q_lens`. Batch invariance: each token's reduction order
    depends only on its own row and the fixed block sizes (keep `num_kv_splits` fixed)."""
    return ragged_paged_attention(*args, attend=functools.partial(paged_attention_kernel, interpret=interpret),
                                  **kwargs)


def paged_attention_kernel(
    q: Float[Array, "tokens heads dim"],
    kv_pages: Float[Array, "layers pages page_size kv2 dim"],
    kv_lens: Int[Array, " seqs"],
    page_indices: Int[Array, "seqs max_pages"],
    cu_q_lens: Int[Array, " seqs_plus_1"],
    *,
    layer: int | Int[Array, ""],
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: Float[Array, " heads"] | None = None,
    query_rows: int | None = None,
    kv_block: int = 64,
    num_kv_splits: int = 1,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> tuple[Float[Array, "tokens heads dim"], Float[Array, "tokens heads"]]:
    """Attention of every query token over its row's pages (already holding this step's K/V): `(out, lse)`.

    `attend_paged`'s semantics with row metadata: row b's tokens are `q[cu_q_lens[b]:cu_q_lens[b+1]]`,
    its KV length after the step `kv_lens[b]`. Padding tokens (past `cu_q_lens[-1]`) get out 0 and
    LSE -inf. Tuning: `query_rows` dot rows per program (a power of two >= 16 and >= the GQA group;
    default 16 for a decode-shaped batch, 64 otherwise), `kv_block` keys per step (a power of two
    >= 16), `num_kv_splits` programs per item over disjoint key ranges merged by LSE (flash-decoding),
    `num_warps`/`num_stages` for Triton.
    """
    num_tokens, num_heads, dim = q.shape
    num_layers, num_pages, page_size, kv2, kv_dim = kv_pages.shape
    num_kv_heads = kv2 // 2
    if kv_dim != dim or num_heads % num_kv_heads:
        raise KernelShapeError(
            f"paged_attention_kernel: q {q.shape} does not fit kv_pages {kv_pages.shape} "
            f"(head dims must match and {num_heads} query heads must be a multiple of {num_kv_heads} KV heads)")
    group = num_heads // num_kv_heads
    query_rows = max(default_query_rows(query_rows, num_tokens, kv_lens), next_power_of_two(group))
    check_tiles("paged_attention_kernel", dict(query_rows=query_rows, kv_block=kv_block), dict(page_size=page_size))
    if num_kv_splits < 1:
        raise KernelShapeError(f"paged_attention_kernel: num_kv_splits={num_kv_splits} must be >= 1")

    items = work_items(cu_q_lens, num_tokens, query_rows // group)
    apply_sinks = sinks is not None and num_kv_splits == 1
    sink_values = jnp.zeros((num_heads,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    out_dtype = q.dtype if num_kv_splits == 1 else jnp.float32
    kernel = functools.partial(
        _ragged_paged_attention_kernel, group=group, query_rows=query_rows, kv_block=kv_block, page_size=page_size,
        num_pages=num_pages, num_kv_heads=num_kv_heads, dim=dim, sm_scale=float(sm_scale),
        sliding_window=sliding_window, soft_cap=soft_cap, num_splits=num_kv_splits, apply_sinks=apply_sinks,
        interpret=bool(interpret),
    )
    spare = spare_rows(interpret)
    outs, lses = triton_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((num_kv_splits, num_tokens + spare, num_heads, dim), out_dtype),
            jax.ShapeDtypeStruct((num_kv_splits, num_tokens + spare, num_heads), jnp.float32),
        ),
        grid=(items[0].shape[0], num_kv_heads, num_kv_splits),
        name="ragged_paged_attention", num_warps=num_warps, num_stages=num_stages, interpret=interpret,
    )(*ragged_operands(layer, items, kv_lens, cu_q_lens, page_indices), q,
      kv_pages.reshape(num_layers * num_pages * page_size, kv2, dim), sink_values)
    return merge_split_partials(outs, lses, num_tokens, cu_q_lens, q.dtype,
                                sinks=None if apply_sinks else sinks)
