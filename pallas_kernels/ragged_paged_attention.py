"""Ragged paged attention: the pure-jnp reference (its Pallas kernel: ragged_paged_attention_kernels.py).

One call serves a ragged batch of sequences, each with some new query tokens (a prefill chunk or
one decode token) over KV that lives in fixed-size pages. It first writes the new K/V into their
pages, then attends causally (optionally inside a sliding window, with a logit soft cap and
per-head attention sinks) and can return each query head's log-sum-exp. The reference streams
over KV pages with an online softmax, so it never materialises a full query-by-key score matrix,
and the per-token arithmetic does not depend on which other tokens share the batch. The kernel
(`ragged_paged_attention_kernel`, pallas_kernels/ragged_paged_attention_kernels.py) targets Pallas'
Triton backend on Hopper and Blackwell and runs in interpret mode on a CPU; it and the Mosaic GPU decode
kernel enter through `ragged_paged_attention(attend=...)`, so the contract is written once. The paged
references of the other families (MLA, block-sparse, DeepSeek-V4) share this module's row writer,
causal mask, blocked page tables and query-block loops.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.kv_fp8 import load_rows, store_rows
from pallas_kernels.online_softmax import fold_sink, online_softmax_init, online_softmax_result, online_softmax_step

from agentjax.numerics import INVARIANT_ROW_BLOCK, map_row_blocks  # noqa: F401 (re-exported)

# Query tokens per block in the fast paths of the attention families that build on this module
# (block-sparse attention): a block inside one sequence shares its page gathers.
FAST_QUERY_BLOCK = 64
# Query tokens per block in this module's fast path. A block of one sequence's tokens (a prefill
# chunk) runs head-major over key blocks of SHARED_PAGES_PER_BLOCK pages: one batched matmul per KV
# head and key block. Measured on a 2-core CPU for a 1024-token prefill of SmolLM2's attention: 128
# query tokens over 8-page (128-key) blocks took half the time of 64 tokens over 4-page blocks in
# the token-major layout.
SHARED_QUERY_BLOCK = 128
SHARED_PAGES_PER_BLOCK = 8


def causal_visible(key_position: Int[Array, " keys"], position: Int[Array, " queries"],
                   sliding_window: int | None) -> Array:
    """`[queries, keys]`: key j is visible to a query at `pos` when `j <= pos` and, with a window W, `j > pos - W`."""
    visible = key_position[None, :] <= position[:, None]
    if sliding_window is not None:
        visible &= key_position[None, :] > position[:, None] - sliding_window
    return visible


def soft_capped(scores: Array, soft_cap: float | None) -> Array:
    """`soft_cap * tanh(scores / soft_cap)`, or the scores as they are without a soft cap."""
    return scores if soft_cap is None else soft_cap * jnp.tanh(scores / soft_cap)


def blocked_table(table: Int[Array, "... max_pages"], pages_per_block: int, page_size: int):
    """A page table (per token, or one shared 1-D table) padded with page 0 to whole blocks:
    `(table, pages_per_block, num_blocks, block_tokens)` (a short table makes one smaller block)."""
    max_pages = table.shape[-1]
    pages_per_block = max(1, min(pages_per_block, max_pages))
    pad = (-max_pages) % pages_per_block
    if pad:
        table = jnp.pad(table, [(0, 0)] * (table.ndim - 1) + [(0, pad)])
    return table, pages_per_block, table.shape[-1] // pages_per_block, pages_per_block * page_size


def skipping_hidden_blocks(attend_block, block_tokens: int, token_positions: Int[Array, " tokens"],
                           sliding_window: int | None = None):
    """A `fori_loop` body that runs `attend_block` only on key blocks some query here can see.

    Blocks past the furthest query position, or wholly before the earliest query's window, are fully
    masked for every query: skipping them is an exact no-op, so padded page tables, causal tails and
    the released pages before a sliding window cost nothing.
    """
    last_position = token_positions.max()
    first_visible = token_positions.min() - sliding_window + 1 if sliding_window is not None else 0

    def body(block, carry):
        needed = (block * block_tokens <= last_position) & ((block + 1) * block_tokens > first_visible)
        return jax.lax.cond(needed, attend_block, lambda _, c: c, block, carry)

    return body


def over_query_blocks(fn, *arrays, batch_invariant: bool, block: int = FAST_QUERY_BLOCK, fence: bool = False):
    """`fn` over row blocks of `arrays` (a row per query token): agentjax.numerics' fixed blocks in
    batch-invariant numerics, else blocks of `block` rows. `fence` wraps the batch-invariant blocks in
    optimization barriers, since a one-block loop would otherwise be inlined and fused with its
    neighbours (other roundings)."""
    if batch_invariant and fence:
        return jax.lax.optimization_barrier(map_row_blocks(fn, *jax.lax.optimization_barrier(arrays)))
    if batch_invariant:
        return map_row_blocks(fn, *arrays)
    return map_row_blocks(fn, *arrays, block=max(1, min(block, arrays[0].shape[0])))


def attend_by_query_blocks(attend, q, page_indices, token_seq_ids, token_positions, *, batch_invariant: bool,
                           block: int = FAST_QUERY_BLOCK, attend_shared=None):
    """`attend(q_rows, table_rows, position_rows)` over blocks of query tokens, each token with its row's
    page table. Batch-invariant numerics: fixed blocks, every token alone. Otherwise blocks of `block`
    tokens, and a block whose tokens are all of one sequence runs `attend_shared` (default `attend`)
    with that one 1-D table, so its pages are gathered once."""
    token_tables = page_indices[token_seq_ids]
    if batch_invariant:
        return map_row_blocks(attend, q, token_tables, token_positions)
    attend_shared = attend_shared or attend

    def attend_query_block(q_rows, table_rows, position_rows, seq_rows):
        return jax.lax.cond(
            jnp.all(seq_rows == seq_rows[0]),
            lambda: attend_shared(q_rows, table_rows[0], position_rows),
            lambda: attend(q_rows, table_rows, position_rows),
        )

    return over_query_blocks(attend_query_block, q, token_tables, token_positions, token_seq_ids,
                             batch_invariant=False, block=block)


def write_rows(
    pages: Float[Array, "slots pages page_size *row"],
    slot: int | Int[Array, ""],
    rows: Float[Array, "tokens *row"],
    slot_mapping: Int[Array, " tokens"],
) -> Float[Array, "slots pages page_size *row"]:
    """Scatter per-token rows into layer slot `slot` of a paged buffer at `page * page_size + offset`.

    The whole multi-layer buffer goes in and out, so a donated buffer is updated in place. Padding
    tokens carry entries of the null page 0, which nothing reads; an entry past the buffer is dropped.
    """
    num_slots, num_pages, page_size = pages.shape[:3]
    flat = pages.reshape(num_slots, num_pages * page_size, *pages.shape[3:])
    flat = flat.at[slot, slot_mapping].set(rows.astype(flat.dtype), mode="drop")
    return flat.reshape(pages.shape)


def write_kv(
    kv_pages: Float[Array, "layers pages page_size kv2 dim"],
    layer: int,
    k: Float[Array, "tokens kv_heads dim"],
    v: Float[Array, "tokens kv_heads dim"],
    slot_mapping: Int[Array, " tokens"],
    fp8_kv: bool = False,
) -> Float[Array, "layers pages page_size kv2 dim"]:
    """Scatter one layer's new keys and values into their slots (`write_rows`). `fp8_kv`: the pages
    hold packed FP8 rows (pallas_kernels/kv_fp8.py; the last axis is a row's words, not `dim`)."""
    return write_rows(kv_pages, layer, store_rows(jnp.concatenate([k, v], axis=1), kv_pages.dtype, fp8_kv),
                      slot_mapping)


def attend_paged(
    q: Float[Array, "tokens heads dim"],
    kv_pages: Float[Array, "layers pages page_size kv2 dim"],
    layer: int,
    token_page_table: Int[Array, "tokens max_pages"] | Int[Array, " max_pages"],
    token_positions: Int[Array, " tokens"],
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: Float[Array, " heads"] | None = None,
    pages_per_block: int = 4,
    fp8_kv: bool = False,
) -> tuple[Float[Array, "tokens heads dim"], Float[Array, "tokens heads"]]:
    """Causal attention of each query token over its own sequence's pages: `(out, lse)`.

    `token_page_table[t]` is the page table of token t's sequence (padded with page 0) and
    `token_positions[t]` its position; key j is visible when `j <= pos` and, with a window W,
    `j > pos - W`. Scores are `q.k * sm_scale`, then `soft_cap * tanh(score / soft_cap)` with a
    soft cap; a head's sink logit joins the softmax denominator and carries no value. `lse` is
    the natural log of that denominator (float32; -inf for a token that sees no key and has no
    sink). Streams `pages_per_block` pages per iteration with an online softmax. A 1-D
    `token_page_table` is one table shared by every token (tokens of one sequence): its pages
    are then gathered once, not once per token. `fp8_kv`: the pages hold FP8 rows, dequantised as
    they are gathered.
    """
    if token_page_table.ndim == 1:
        return _attend_shared_table(q, kv_pages, layer, token_page_table, token_positions, sm_scale=sm_scale,
                                    sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks,
                                    pages_per_block=pages_per_block, fp8_kv=fp8_kv)
    num_tokens, num_heads, dim = q.shape
    _, _, page_size, kv2, _ = kv_pages.shape
    num_kv_heads = kv2 // 2
    group = num_heads // num_kv_heads
    token_page_table, pages_per_block, num_blocks, block_tokens = blocked_table(
        token_page_table, pages_per_block, page_size)
    qg = (q.astype(jnp.float32) * sm_scale).reshape(num_tokens, num_kv_heads, group, dim)
    offsets = jnp.arange(block_tokens, dtype=jnp.int32)

    def attend_block(block, carry):
        pages = jax.lax.dynamic_slice_in_dim(token_page_table, block * pages_per_block, pages_per_block, -1)
        kv = load_rows(kv_pages, (layer, pages), dim, fp8_kv).reshape(num_tokens, block_tokens, kv2, dim)
        k, v = kv[:, :, :num_kv_heads], kv[:, :, num_kv_heads:]
        visible = causal_visible(block * block_tokens + offsets, token_positions, sliding_window)
        scores = soft_capped(jnp.einsum("thgd,tshd->thgs", qg, k), soft_cap)
        scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
        return online_softmax_step(carry, scores, lambda p: jnp.einsum("thgs,tshd->thgd", p, v))

    body = skipping_hidden_blocks(attend_block, block_tokens, token_positions, sliding_window)
    carry = jax.lax.fori_loop(0, num_blocks, body, online_softmax_init((num_tokens, num_kv_heads, group), dim))
    if sinks is not None:
        carry = fold_sink(carry, sinks.astype(jnp.float32).reshape(1, num_kv_heads, group))
    out, lse = online_softmax_result(carry)  # padding tokens see no key at all: out 0, LSE -inf
    return out.reshape(num_tokens, num_heads, dim).astype(q.dtype), lse.reshape(num_tokens, num_heads)


def _attend_shared_table(
    q: Float[Array, "tokens heads dim"],
    kv_pages: Float[Array, "layers pages page_size kv2 dim"],
    layer: int,
    page_table: Int[Array, " max_pages"],
    token_positions: Int[Array, " tokens"],
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    sinks: Float[Array, " heads"] | None,
    pages_per_block: int,
    fp8_kv: bool = False,
) -> tuple[Float[Array, "tokens heads dim"], Float[Array, "tokens heads"]]:
    """`attend_paged` for tokens of one sequence (one shared page table), head-major.

    Query rows are laid out `[kv_heads, tokens * group, dim]` and each key block is gathered once
    and transposed to `[kv_heads, keys, dim]`, so both products are batched matmuls with the KV head
    leading (no per-block transposes of the scores). Same arithmetic per score as `attend_paged`'s
    per-token form; the online softmax runs in the same block order.
    """
    num_tokens, num_heads, dim = q.shape
    _, _, page_size, kv2, _ = kv_pages.shape
    num_kv_heads = kv2 // 2
    group = num_heads // num_kv_heads
    page_table, pages_per_block, num_blocks, block_tokens = blocked_table(page_table, pages_per_block, page_size)
    rows = num_tokens * group  # row r is token r // group, query head (of its KV head) r % group

    q_heads = (q.astype(jnp.float32) * sm_scale).reshape(num_tokens, num_kv_heads, group, dim)
    q_heads = q_heads.transpose(1, 0, 2, 3).reshape(num_kv_heads, rows, dim)
    row_positions = jnp.repeat(token_positions, group)
    offsets = jnp.arange(block_tokens, dtype=jnp.int32)

    def attend_block(block, carry):
        pages = jax.lax.dynamic_slice_in_dim(page_table, block * pages_per_block, pages_per_block)
        kv = load_rows(kv_pages, (layer, pages), dim, fp8_kv).reshape(block_tokens, kv2, dim).transpose(1, 0, 2)
        k, v = kv[:num_kv_heads], kv[num_kv_heads:]
        visible = causal_visible(block * block_tokens + offsets, row_positions, sliding_window)
        scores = soft_capped(jnp.einsum("hrd,hsd->hrs", q_heads, k), soft_cap)
        scores = jnp.where(visible[None], scores, -jnp.inf)
        return online_softmax_step(carry, scores, lambda p: jnp.einsum("hrs,hsd->hrd", p, v))

    body = skipping_hidden_blocks(attend_block, block_tokens, token_positions, sliding_window)
    carry = jax.lax.fori_loop(0, num_blocks, body, online_softmax_init((num_kv_heads, rows), dim))
    if sinks is not None:
        carry = fold_sink(carry, jnp.tile(sinks.astype(jnp.float32).reshape(num_kv_heads, group), (1, num_tokens)))
    out, lse = online_softmax_result(carry)
    out = out.reshape(num_kv_heads, num_tokens, group, dim).transpose(1, 0, 2, 3).reshape(num_tokens, num_heads, dim)
    lse = lse.reshape(num_kv_heads, num_tokens, group).transpose(1, 0, 2).reshape(num_tokens, num_heads)
    return out.astype(q.dtype), lse


def ragged_paged_attention(
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
    sm_scale: float,
    token_seq_ids: Int[Array, " tokens"] | None = None,
    token_positions: Int[Array, " tokens"] | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: Float[Array, " heads"] | None = None,
    batch_invariant: bool = False,
    return_lse: bool = False,
    fp8_kv: bool = False,
    attend=None,
    **attend_options,
) -> tuple[Float[Array, "tokens heads dim"], Float[Array, "layers pages page_size kv2 dim"]] | tuple[
    Float[Array, "tokens heads dim"], Float[Array, "layers pages page_size kv2 dim"], Float[Array, "tokens heads"]
]:
    """Write this step's K/V into layer `layer`'s pages, then attend: `(out, kv_pages)`, or
    `(out, kv_pages, lse)` with `return_lse` (lse: float32 `[tokens, heads]`, see `attend_paged`).

    The leading arguments follow the ragged paged attention convention of the JAX serving
    engines. `kv_lens[b]` counts sequence b's KV after this step; its query tokens are
    `q[cu_q_lens[b]:cu_q_lens[b+1]]`. `distribution` (decode, prefill, mixed sequence ends) is
    accepted for kernel compatibility and unused. The per-token metadata (`token_seq_ids`,
    `token_positions`, `slot_mapping`) is derived from those arrays on the host, where it is cheap,
    and passed in so the device never recomputes it. `fp8_kv`: the pages hold FP8 rows
    (pallas_kernels/kv_fp8.py): this step's K/V are quantised as written, pages dequantised as read.

    `attend`: a kernel that attends over the written pages instead of the reference,
    `attend(q, kv_pages, kv_lens, page_indices, cu_q_lens, layer=, sm_scale=, sliding_window=,
    soft_cap=, sinks=, **attend_options) -> (out, lse)` from the row metadata alone (it ignores the
    per-token metadata and `batch_invariant`: a kernel's reduction order per token is fixed).
    """
    del distribution
    kv_pages = write_kv(kv_pages, layer, k, v, slot_mapping, fp8_kv)
    if attend is not None:
        out, lse = attend(q, kv_pages, kv_lens, page_indices, cu_q_lens, layer=layer, sm_scale=sm_scale,
                          sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks, **attend_options)
        return (out, kv_pages, lse) if return_lse else (out, kv_pages)
    if attend_options:
        raise TypeError(f"ragged_paged_attention: unexpected keyword arguments {sorted(attend_options)}")

    def attend_rows(q_rows, table_rows, position_rows, pages_per_block=4):
        return attend_paged(
            q_rows, kv_pages, layer, table_rows, position_rows, sm_scale=sm_scale, sliding_window=sliding_window,
            soft_cap=soft_cap, sinks=sinks, pages_per_block=pages_per_block, fp8_kv=fp8_kv,
        )

    out, lse = attend_by_query_blocks(
        attend_rows, q, page_indices, token_seq_ids, token_positions, batch_invariant=batch_invariant,
        block=SHARED_QUERY_BLOCK, attend_shared=functools.partial(attend_rows, pages_per_block=SHARED_PAGES_PER_BLOCK))
    return (out, kv_pages, lse) if return_lse else (out, kv_pages)
