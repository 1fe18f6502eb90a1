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
from pallas_kernels.ragged_paged_attention import write_kv
from pallas_kernels.ragged_work import merge_attention_partials, next_power_of_two, work_items

# Finite stand-in for -inf in the running max: a fully masked block then leaves the
# accumulators exactly unchanged (exp(-inf - finite) == 0, exp(0) == 1) instead of making NaN.
_NEG_LARGE = -1e30


def _ragged_paged_attention_kernel(
    layer_ref, item_seq_ref, item_start_ref, item_count_ref, kv_lens_ref, cu_q_lens_ref, table_ref, q_ref, kv_ref,
    sinks_ref, out_ref, lse_ref, *, group, query_rows, kv_block, page_size, num_pages, num_kv_heads, dim,
    sm_scale, sliding_window, soft_cap, num_splits, apply_sinks, interpret,
):
    item, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq, start, count = item_seq_ref[item], item_start_ref[item], item_count_ref[item]
    layer = layer_ref[0]
    max_pages = table_ref.shape[1]
    padded_dim = next_power_of_two(dim)

    row = jnp.arange(query_rows, dtype=jnp.int32)
    row_used = row // group < count
    token = jnp.where(row_used, start + row // group, 0)
    # In interpret mode unused rows store into a spare last token row (sliced off), never onto a used
    # row's address: interpret mode writes masked lanes back with their old value.
    store_token = jnp.where(row_used, token, out_ref.shape[1] - 1) if interpret else token
    head = kv_head * group + row % group
    lane = jnp.arange(padded_dim, dtype=jnp.int32)
    lane_used = lane < dim
    row_mask = row_used[:, None] & lane_used[None, :]

    seq_start, seq_end = cu_q_lens_ref[seq], cu_q_lens_ref[seq + 1]
    context = kv_lens_ref[seq] - (seq_end - seq_start)
    position = context + (token - seq_start)
    first_position = context + (start - seq_start)
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
        m, denom, acc = carry
        key_position = block * kv_block + key_offsets
        key_used = key_position < kv_end
        page_slot = jnp.minimum(key_position // page_size, max_pages - 1)
        page = plt.load(table_ref.at[jnp.full_like(page_slot, seq), page_slot], mask=key_used, other=0)
        kv_row = (layer * num_pages + page) * page_size + key_position % page_size
        key_mask = key_used[:, None] & lane_used[None, :]
        k = plt.load(kv_ref.at[kv_row[:, None], kv_heads_column, lane[None, :]], mask=key_mask, other=0)
        v = plt.load(kv_ref.at[kv_row[:, None], kv_heads_column + num_kv_heads, lane[None, :]], mask=key_mask, other=0)
        scores = plt.dot(q, k.astype(q.dtype), trans_b=True, **precise) * sm_scale
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        visible = (key_position[None, :] <= position[:, None]) & key_used[None, :]
        if sliding_window is not None:
            visible &= key_position[None, :] > position[:, None] - sliding_window
        scores = jnp.where(visible, scores, -jnp.inf)
        m_new = jnp.maximum(m, scores.max(axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(scores - m_new[:, None])
        denom = denom * alpha + p.sum(axis=1)
        acc = acc * alpha[:, None] + plt.dot(p.astype(v.dtype), v, **precise)
        return m_new, denom, acc

    init = (
        jnp.full((query_rows,), _NEG_LARGE, jnp.float32),
        jnp.zeros((query_rows,), jnp.float32),
        jnp.zeros((query_rows, padded_dim), jnp.float32),
    )
    m, denom, acc = jax.lax.fori_loop(split_lo, split_hi, attend_block, init)
    if apply_sinks:
        sink = plt.load(sinks_ref.at[head])
        m_final = jnp.maximum(m, sink)
        alpha = jnp.exp(m - m_final)
        denom = denom * alpha + jnp.exp(sink - m_final)
        acc = acc * alpha[:, None]
        m = m_final
    safe_denom = jnp.where(denom == 0, 1.0, denom)
    out = acc / safe_denom[:, None]
    lse = jnp.where(denom == 0, -jnp.inf, m + jnp.log(safe_denom))
    split_rows = jnp.full((query_rows,), split, jnp.int32)
    plt.store(out_ref.at[split_rows[:, None], store_token[:, None], head[:, None], lane[None, :]],
              out.astype(out_ref.dtype), mask=row_mask)
    plt.store(lse_ref.at[split_rows, store_token, head], lse, mask=row_used)


def ragged_paged_attention_kernel(
    q: Float[Array, "tokens heads dim"],
    k: Float[Array, "tokens kv_heads dim"],
    v: Float[Array, "tokens kv_heads dim"],
    kv_pages: Float[Array, "layers pages page_size kv2 dim"],
    kv_lens: Int[Array, " seqs"],
    page_indices: Int[Array, "seqs max_pages"],
    cu_q_lens: Int[Array, " seqs_plus_1"],
    distribution: Int[Array, " 3"] | None = None,
    *,
    layer: int | Int[Array, ""],
    slot_mapping: Int[Array, " tokens"],
    return_lse: bool = False,
    token_seq_ids: Int[Array, " tokens"] | None = None,
    token_positions: Int[Array, " tokens"] | None = None,
    batch_invariant: bool = False,
    **options,
):
    """The reference's contract (write K/V, attend; the same arguments and results) with the
    attention as one kernel (`paged_attention_kernel`, whose keyword `options` it takes). Per-token
    metadata is recomputed from `kv_lens`/`cu_q_lens`, so `token_seq_ids`/`token_positions` are
    ignored. Batch invariance: each token's reduction order depends only on its own row and the
    fixed block sizes (keep `num_kv_splits` fixed)."""
    del distribution, token_seq_ids, token_positions, batch_invariant
    kv_pages = write_kv(kv_pages, layer, k, v, slot_mapping)
    out, lse = paged_attention_kernel(q, kv_pages, kv_lens, page_indices, cu_q_lens, layer=layer, **options)
    return (out, kv_pages, lse) if return_lse else (out, kv_pages)


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
    if query_rows is None:
        query_rows = 16 if num_tokens <= kv_lens.shape[0] else 64
    query_rows = max(query_rows, next_power_of_two(group))
    for name, value in (("query_rows", query_rows), ("kv_block", kv_block), ("page_size", page_size)):
        if value != next_power_of_two(value) or (name != "page_size" and value < 16):
            raise KernelShapeError(f"paged_attention_kernel: {name}={value} must be a power of two (>= 16 for blocks)")
    if num_kv_splits < 1:
        raise KernelShapeError(f"paged_attention_kernel: num_kv_splits={num_kv_splits} must be >= 1")

    item_seq, item_start, item_count = work_items(cu_q_lens, num_tokens, query_rows // group)
    apply_sinks = sinks is not None and num_kv_splits == 1
    sink_values = jnp.zeros((num_heads,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    out_dtype = q.dtype if num_kv_splits == 1 else jnp.float32
    kernel = functools.partial(
        _ragged_paged_attention_kernel, group=group, query_rows=query_rows, kv_block=kv_block, page_size=page_size,
        num_pages=num_pages, num_kv_heads=num_kv_heads, dim=dim, sm_scale=float(sm_scale),
        sliding_window=sliding_window, soft_cap=soft_cap, num_splits=num_kv_splits, apply_sinks=apply_sinks,
        interpret=bool(interpret),
    )
    spare = 1 if interpret else 0
    outs, lses = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((num_kv_splits, num_tokens + spare, num_heads, dim), out_dtype),
            jax.ShapeDtypeStruct((num_kv_splits, num_tokens + spare, num_heads), jnp.float32),
        ),
        grid=(item_seq.shape[0], num_kv_heads, num_kv_splits),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(
        jnp.asarray(layer, jnp.int32).reshape(1), item_seq, item_start, item_count, kv_lens.astype(jnp.int32),
        cu_q_lens.astype(jnp.int32), page_indices.astype(jnp.int32), q,
        kv_pages.reshape(num_layers * num_pages * page_size, kv2, dim), sink_values,
    )
    if spare:
        outs, lses = outs[:, :num_tokens], lses[:, :num_tokens]
    if num_kv_splits == 1:
        out, lse = outs[0], lses[0]
    else:
        if sinks is not None:
            sink_lse = jnp.broadcast_to(sink_values, (1, num_tokens, num_heads))
            outs = jnp.concatenate([outs, jnp.zeros((1, num_tokens, num_heads, dim), outs.dtype)])
            lses = jnp.concatenate([lses, sink_lse])
        out, lse = merge_attention_partials(outs, lses)
    real = jnp.arange(num_tokens) < cu_q_lens[-1]
    return jnp.where(real[:, None, None], out, 0).astype(q.dtype), jnp.where(real[:, None], lse, -jnp.inf)
