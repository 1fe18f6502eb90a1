"""Paged MLA attention over the latent cache: the pure-jnp reference a Pallas kernel must match.

Multi-head latent attention stores one row per token and layer: the normed latent `c` (`kv_lora_rank`
values) then the rope part `k_rot` shared by all heads. One call first writes this step's rows into
their pages, then attends in the absorbed form: each query head arrives already multiplied into the
latent space (`[W_UK_h^T q_nope_h | q_rope_h]`), so a key is the whole stored row and a value is its
latent part, i.e. multi-query attention with one shared KV head. The caller maps the `[heads,
kv_lora_rank]` result back through `W_UV`. Pages stream with an online softmax (the same streaming as
`ragged_paged_attention`), so a token's arithmetic never depends on which tokens share the batch.
`mla_paged_attention_kernel` (below) is the same contract as a Triton-style Pallas kernel (GPU;
interpret mode on a CPU); the CPU runner never uses it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from agentjax.errors import KernelShapeError
from pallas_kernels.kv_fp8 import load_rows, store_rows
from pallas_kernels.online_softmax import online_softmax_init, online_softmax_result, online_softmax_step
from pallas_kernels.ragged_paged_attention import (
    attend_by_query_blocks, blocked_table, causal_visible, skipping_hidden_blocks, write_rows,
)
from pallas_kernels.ragged_work import merge_split_partials, next_power_of_two, work_items
from pallas_kernels.triton_call import (
    check_tiles, default_query_rows, item_rows, lanes, page_rows, query_positions, ragged_operands, spare_rows,
    store_index, triton_call,
)


def write_latent(
    latent_pages: Float[Array, "slots pages page_size width"],
    slot: int | Array,
    rows: Float[Array, "tokens width"],
    slot_mapping: Int[Array, " tokens"],
    fp8_kv: bool = False,
) -> Float[Array, "slots pages page_size width"]:
    """Scatter this step's latent rows into their entries (`page * page_size + offset`) of `slot`.
    Padding tokens carry entries of the null page 0, which nothing reads. `fp8_kv`: the pages hold
    packed FP8 rows (pallas_kernels/kv_fp8.py)."""
    return write_rows(latent_pages, slot, store_rows(rows, latent_pages.dtype, fp8_kv), slot_mapping)


def attend_latent(
    q: Float[Array, "tokens heads width"],
    latent_pages: Float[Array, "slots pages page_size width"],
    slot: int | Array,
    token_page_table: Int[Array, "tokens max_pages"] | Int[Array, " max_pages"],
    token_positions: Int[Array, " tokens"],
    *,
    value_dim: int,
    sm_scale: float,
    pages_per_block: int = 4,
    return_lse: bool = False,
    fp8_kv: bool = False,
) -> Float[Array, "tokens heads value_dim"] | tuple[Array, Float[Array, "tokens heads"]]:
    """Causal attention of each absorbed query over its sequence's latent rows: scores against the
    whole row, values its first `value_dim` entries. A 1-D `token_page_table` is one table shared by
    every token (a block of one sequence): its pages are gathered once. With `return_lse`, also each
    head's float32 log-sum-exp (-inf for a token that sees no row), as `attend_paged` gives it. `fp8_kv`:
    the pages hold FP8 rows, dequantised as they are gathered."""
    shared = token_page_table.ndim == 1
    num_tokens, num_heads, width = q.shape
    token_page_table, pages_per_block, num_blocks, block_tokens = blocked_table(
        token_page_table, pages_per_block, latent_pages.shape[2])
    q32 = q.astype(jnp.float32) * sm_scale
    offsets = jnp.arange(block_tokens, dtype=jnp.int32)

    def attend_block(block, carry):
        pages = jax.lax.dynamic_slice_in_dim(token_page_table, block * pages_per_block, pages_per_block, -1)
        rows = load_rows(latent_pages, (slot, pages), width, fp8_kv)
        if shared:  # one sequence's rows for every query
            rows = rows.reshape(block_tokens, width)
            scores = jnp.einsum("thw,sw->ths", q32, rows)
        else:
            rows = rows.reshape(num_tokens, block_tokens, width)
            scores = jnp.einsum("thw,tsw->ths", q32, rows)
        visible = causal_visible(block * block_tokens + offsets, token_positions, None)
        scores = jnp.where(visible[:, None, :], scores, -jnp.inf)
        values = rows[..., :value_dim]
        return online_softmax_step(carry, scores, lambda p: jnp.einsum("ths,sv->thv", p, values) if shared
                                   else jnp.einsum("ths,tsv->thv", p, values))

    body = skipping_hidden_blocks(attend_block, block_tokens, token_positions)
    carry = jax.lax.fori_loop(0, num_blocks, body, online_softmax_init((num_tokens, num_heads), value_dim))
    out, lse = online_softmax_result(carry)  # padding rows see no key: out 0, LSE -inf
    return (out.astype(q.dtype), lse) if return_lse else out.astype(q.dtype)


def mla_paged_attention(
    q: Float[Array, "tokens heads width"],
    latent: Float[Array, "tokens width"],
    latent_pages: Float[Array, "slots pages page_size width"],
    page_indices: Int[Array, "seqs max_pages"],
    *,
    layer: int | Array,
    slot_mapping: Int[Array, " tokens"],
    value_dim: int,
    sm_scale: float,
    token_seq_ids: Int[Array, " tokens"] | None = None,
    token_positions: Int[Array, " tokens"] | None = None,
    batch_invariant: bool = False,
    kv_lens: Int[Array, " seqs"] | None = None,
    cu_q_lens: Int[Array, " seqs_plus_1"] | None = None,
    return_lse: bool = False,
    fp8_kv: bool = False,
    attend=None,
    **attend_options,
) -> tuple[Float[Array, "tokens heads value_dim"], Float[Array, "slots pages page_size width"]]:
    """Write this step's latent rows (`[c | k_rot]`) into slot `layer`'s pages, then attend with the
    absorbed queries: `(latent-space output [tokens, heads, value_dim], latent_pages)`.

    `width = kv_lora_rank + rope_dim` and `value_dim = kv_lora_rank`. In "batch_invariant" numerics
    every token is computed alone in fixed row blocks; the fast path lets a block of one sequence's
    tokens share its page gathers. `return_lse` adds each head's log-sum-exp: `(out, latent_pages,
    lse)` (decode context parallelism merges partial results by it). `fp8_kv`: the pages hold FP8 rows
    (quantised as written). `attend`: a kernel instead of the reference, `attend(q, latent_pages,
    kv_lens, page_indices, cu_q_lens, layer=, value_dim=, sm_scale=, **attend_options) -> (out, lse)`
    from the rows' `kv_lens`/`cu_q_lens` (which the reference does not read).
    """
    latent_pages = write_latent(latent_pages, layer, latent, slot_mapping, fp8_kv)
    if attend is not None:
        out, lse = attend(q, latent_pages, kv_lens, page_indices, cu_q_lens, layer=layer, value_dim=value_dim,
                          sm_scale=sm_scale, **attend_options)
        return (out, latent_pages, lse) if return_lse else (out, latent_pages)
    if attend_options:
        raise TypeError(f"mla_paged_attention: unexpected keyword arguments {sorted(attend_options)}")

    def attend_rows(q_rows, table_rows, position_rows):
        return attend_latent(q_rows, latent_pages, layer, table_rows, position_rows,
                             value_dim=value_dim, sm_scale=sm_scale, return_lse=return_lse, fp8_kv=fp8_kv)

    out = attend_by_query_blocks(attend_rows, q, page_indices, token_seq_ids, token_positions,
                                 batch_invariant=batch_invariant)
    return (out[0], latent_pages, out[1]) if return_lse else (out, latent_pages)


# ---------------------------------------------------------------------------------------------
# The Triton-style Pallas kernel (GPU: Hopper and Blackwell through the Triton backend; CPU:
# interpret mode only). MLA is multi-query attention with one shared latent KV head, so one
# program runs `head_block` query heads of up to `query_rows // head_block` consecutive tokens of
# one sequence as its dot rows, over one share of that sequence's latent blocks. The latent part
# and the rope part of a row are loaded and dotted separately (576 = 512 + 64 at Kimi's shapes,
# each a power of two, so no lane is wasted on padding).
# ---------------------------------------------------------------------------------------------


def _mla_decode_kernel(
    slot_ref, item_seq_ref, item_start_ref, item_count_ref, kv_lens_ref, cu_q_lens_ref, table_ref, q_ref, rows_ref,
    out_ref, lse_ref, *, head_block, query_rows, kv_block, page_size, num_pages, num_heads, value_dim, rope_dim,
    sm_scale, num_splits, interpret,
):
    item, head_tile, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq, start, count = item_seq_ref[item], item_start_ref[item], item_count_ref[item]
    slot = slot_ref[0]

    token, head, row_used = item_rows(query_rows, head_block, start, count, head_tile * head_block, num_heads)
    store_token = store_index(token, row_used, out_ref.shape[1] - 1, interpret)
    position, first_position = query_positions(kv_lens_ref, cu_q_lens_ref, seq, start, token)
    kv_end = first_position + count
    block_hi = jnp.where(count > 0, (kv_end + kv_block - 1) // kv_block, 0)
    per_split = (block_hi + num_splits - 1) // num_splits
    split_lo = jnp.minimum(split * per_split, block_hi)
    split_hi = jnp.minimum(split_lo + per_split, block_hi)

    value_lane, value_lane_used = lanes(value_dim, minimum=1)
    rope_lane, rope_lane_used = lanes(rope_dim, minimum=1)
    rope_lane = value_dim + rope_lane

    def load_query(lane, lane_used):
        return plt.load(q_ref.at[token[:, None], head[:, None], lane[None, :]],
                        mask=row_used[:, None] & lane_used[None, :], other=0)

    q_value = load_query(value_lane, value_lane_used)
    q_rope = load_query(rope_lane, rope_lane_used) if rope_dim else None
    precise = dict(allow_tf32=False) if q_value.dtype == jnp.float32 else {}
    key_offsets = jnp.arange(kv_block, dtype=jnp.int32)

    def attend_block(block, carry):
        key_position = block * kv_block + key_offsets
        key_used = key_position < kv_end
        entry = page_rows(table_ref, seq, key_position, key_used, slot, num_pages, page_size)

        def load_rows(lane, lane_used):
            return plt.load(rows_ref.at[entry[:, None], lane[None, :]],
                            mask=key_used[:, None] & lane_used[None, :], other=0).astype(q_value.dtype)

        values = load_rows(value_lane, value_lane_used)
        scores = plt.dot(q_value, values, trans_b=True, **precise)
        if rope_dim:
            scores += plt.dot(q_rope, load_rows(rope_lane, rope_lane_used), trans_b=True, **precise)
        scores = scores * sm_scale
        visible = causal_visible(key_position, position, None) & key_used[None, :]
        scores = jnp.where(visible, scores, -jnp.inf)
        return online_softmax_step(carry, scores, lambda p: plt.dot(p.astype(values.dtype), values, **precise))

    carry = online_softmax_init((query_rows,), value_lane.shape[0])
    out, lse = online_softmax_result(jax.lax.fori_loop(split_lo, split_hi, attend_block, carry))
    split_rows = jnp.full((query_rows,), split, jnp.int32)
    plt.store(out_ref.at[split_rows[:, None], store_token[:, None], head[:, None], value_lane[None, :]],
              out.astype(out_ref.dtype), mask=row_used[:, None] & value_lane_used[None, :])
    plt.store(lse_ref.at[split_rows, store_token, head], lse, mask=row_used)


def mla_attention_kernel(
    q: Float[Array, "tokens heads width"],
    latent_pages: Float[Array, "slots pages page_size width"],
    kv_lens: Int[Array, " seqs"],
    page_indices: Int[Array, "seqs max_pages"],
    cu_q_lens: Int[Array, " seqs_plus_1"],
    *,
    layer: int | Array,
    value_dim: int,
    sm_scale: float,
    head_block: int | None = None,
    query_rows: int | None = None,
    kv_block: int = 32,
    num_kv_splits: int = 1,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> tuple[Float[Array, "tokens heads value_dim"], Float[Array, "tokens heads"]]:
    """`attend_latent` for a ragged batch as one kernel, over pages that already hold this step's rows:
    `(out, lse)` (lse float32, as `attend_latent(..., return_lse=True)` gives it).

    Row b's tokens are `q[cu_q_lens[b]:cu_q_lens[b+1]]`, its KV length after the step `kv_lens[b]`;
    padding tokens (past `cu_q_lens[-1]`) get out 0 and LSE -inf. Tuning: `head_block` heads per program (a power
    of two; default min(heads, 64) rounded up), `query_rows` dot rows (>= 16 and >= `head_block`; a
    program takes `query_rows // head_block` tokens), `kv_block` latent rows per step, and
    `num_kv_splits` programs per item over disjoint key ranges merged by LSE (flash-decoding).
    """
    num_tokens, num_heads, width = q.shape
    num_slots, num_pages, page_size, rows_width = latent_pages.shape
    rope_dim = width - value_dim
    if rows_width != width or rope_dim < 0:
        raise KernelShapeError(f"mla_attention_kernel: q {q.shape} does not fit latent_pages {latent_pages.shape} "
                               f"with value_dim={value_dim} (widths must match and value_dim <= {width})")
    if head_block is None:
        head_block = next_power_of_two(min(num_heads, 64))
    query_rows = max(default_query_rows(query_rows, num_tokens, kv_lens), head_block)
    check_tiles("mla_attention_kernel", dict(query_rows=query_rows, kv_block=kv_block),
                dict(head_block=head_block, page_size=page_size))
    if num_kv_splits < 1:
        raise KernelShapeError(f"mla_attention_kernel: num_kv_splits={num_kv_splits} must be >= 1")

    cu_q_lens = jnp.asarray(cu_q_lens, jnp.int32)
    items = work_items(cu_q_lens, num_tokens, query_rows // head_block)
    kernel = functools.partial(
        _mla_decode_kernel, head_block=head_block, query_rows=query_rows, kv_block=kv_block, page_size=page_size,
        num_pages=num_pages, num_heads=num_heads, value_dim=value_dim, rope_dim=rope_dim, sm_scale=float(sm_scale),
        num_splits=num_kv_splits, interpret=bool(interpret),
    )
    spare = spare_rows(interpret)
    out_dtype = q.dtype if num_kv_splits == 1 else jnp.float32
    outs, lses = triton_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((num_kv_splits, num_tokens + spare, num_heads, value_dim), out_dtype),
            jax.ShapeDtypeStruct((num_kv_splits, num_tokens + spare, num_heads), jnp.float32),
        ),
        grid=(items[0].shape[0], pl.cdiv(num_heads, head_block), num_kv_splits),
        name="mla_paged_attention", num_warps=num_warps, num_stages=num_stages, interpret=interpret,
    )(*ragged_operands(layer, items, kv_lens, cu_q_lens, page_indices), q,
      latent_pages.reshape(num_slots * num_pages * page_size, width))
    return merge_split_partials(outs, lses, num_tokens, cu_q_lens, q.dtype)


def mla_paged_attention_kernel(*args, interpret: bool = False, **kwargs):
    """`mla_paged_attention`'s contract (write the latent rows, attend: `(out, latent_pages)`, or
    `(out, latent_pages, lse)` with `return_lse`) with the attention as one kernel
    (`mla_attention_kernel`, whose tuning keywords it takes). It needs the rows' `kv_lens` and
    `cu_q_lens`; the per-token metadata is recomputed from them. A token's reduction order depends
    only on its own row and the fixed block sizes."""
    return mla_paged_attention(*args, attend=functools.partial(mla_attention_kernel, interpret=interpret), **kwargs)
