"""Block-sparse GQA with its indexer (MiniMax-M3): the pure-jnp references the Pallas kernels must match.

`index_select_blocks` writes this step's indexer keys into their pages, scores each query token's
indexer heads against every earlier indexer key of its row (read through the row's page table),
max-pools the scores into blocks of `block_size` positions, forces the query's local blocks and
keeps the top-k blocks per indexer head, -1 padding the slots past the causal blocks (transformers'
MiniMaxM3VLIndexer contract). `block_sparse_attention` writes this step's K/V and attends each
query head only to the keys of its indexer head's selected blocks, one block per step of an online
softmax. Every per-query computation has fixed shapes, so no result depends on the batch or on
how a sequence was split into steps (numerics="batch_invariant" runs fixed 8-row blocks).
The Triton-style kernels for both live in `block_sparse_attention_kernels.py`.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.kv_fp8 import load_rows
from pallas_kernels.online_softmax import online_softmax_init, online_softmax_result, online_softmax_step
from pallas_kernels.ragged_paged_attention import over_query_blocks, write_kv, write_rows

# Key positions scored per iteration of the indexer (rounded to whole pages and whole blocks).
INDEX_CHUNK_TOKENS = 64


def write_index_keys(
    index_pages: Float[Array, "slots pages page_size dim"],
    slot: int,
    keys: Float[Array, "tokens dim"],
    slot_mapping: Int[Array, " tokens"],
) -> Float[Array, "slots pages page_size dim"]:
    """Scatter one layer's new indexer keys into their entries (`page * page_size + offset`)."""
    return write_rows(index_pages, slot, keys, slot_mapping)


def _chunk_pages(page_size: int, block_size: int) -> int:
    """Pages per indexer iteration: a whole number of key blocks, about INDEX_CHUNK_TOKENS tokens."""
    unit = math.lcm(page_size, block_size)
    return unit // page_size * max(1, INDEX_CHUNK_TOKENS // unit)


def block_scores_paged(
    q: Float[Array, "tokens heads dim"],
    index_pages: Float[Array, "slots pages page_size dim"],
    slot: int,
    token_page_table: Int[Array, "tokens max_pages"],
    token_positions: Int[Array, " tokens"],
    *,
    block_size: int,
) -> Float[Array, "tokens heads blocks"]:
    """Max over each block of `block_size` key positions of `q . key` (float32, unscaled), keys
    after the query's position excluded; a block without a visible key scores -inf. Keys are read
    through each token's page table, a chunk of whole blocks per iteration."""
    num_tokens, num_heads, _ = q.shape
    page_size = index_pages.shape[2]
    chunk_pages = _chunk_pages(page_size, block_size)
    pad = (-token_page_table.shape[-1]) % chunk_pages
    table = jnp.pad(token_page_table, ((0, 0), (0, pad)))
    num_chunks = table.shape[-1] // chunk_pages
    chunk_tokens = chunk_pages * page_size
    chunk_blocks = chunk_tokens // block_size
    q32 = q.astype(jnp.float32)
    offsets = jnp.arange(chunk_tokens, dtype=jnp.int32)
    last_position = token_positions.max()

    def score_chunk(chunk, scores):
        pages = jax.lax.dynamic_slice_in_dim(table, chunk * chunk_pages, chunk_pages, -1)
        keys = index_pages[slot, pages].reshape(num_tokens, chunk_tokens, -1).astype(jnp.float32)
        logits = jnp.einsum("thd,tsd->ths", q32, keys)
        visible = (chunk * chunk_tokens + offsets)[None, :] <= token_positions[:, None]
        logits = jnp.where(visible[:, None, :], logits, -jnp.inf)
        pooled = logits.reshape(num_tokens, num_heads, chunk_blocks, block_size).max(axis=-1)
        return jax.lax.dynamic_update_slice_in_dim(scores, pooled, chunk * chunk_blocks, axis=-1)

    def body(chunk, scores):
        # Chunks wholly after every query here hold no visible key: skip them (they stay -inf).
        return jax.lax.cond(chunk * chunk_tokens <= last_position, score_chunk, lambda _, s: s, chunk, scores)

    init = jnp.full((num_tokens, num_heads, num_chunks * chunk_blocks), -jnp.inf, jnp.float32)
    return jax.lax.fori_loop(0, num_chunks, body, init)


def top_blocks(
    block_scores: Float[Array, "tokens heads blocks"],
    token_positions: Int[Array, " tokens"],
    *,
    block_size: int,
    topk_blocks: int,
    local_blocks: int,
) -> Int[Array, "tokens heads topk"]:
    """Force blocks `max(pos // block_size - l, 0)` for `l < local_blocks` (+inf), then the top
    `topk_blocks` block ids per head, best first (ties: lower block first); slots whose score is
    -inf (no visible key) are -1, so valid ids come first and -1 pads the rest."""
    num_blocks = block_scores.shape[-1]
    query_block = token_positions // block_size
    ids = jnp.arange(num_blocks, dtype=jnp.int32)
    for back in range(local_blocks):
        forced = ids[None, :] == jnp.maximum(query_block - back, 0)[:, None]
        block_scores = jnp.where(forced[:, None, :], jnp.inf, block_scores)
    if num_blocks < topk_blocks:
        block_scores = jnp.pad(block_scores, ((0, 0), (0, 0), (0, topk_blocks - num_blocks)),
                               constant_values=-jnp.inf)
    values, chosen = jax.lax.top_k(block_scores, topk_blocks)
    return jnp.where(values == -jnp.inf, -1, chosen).astype(jnp.int32)


def index_select_blocks(
    q: Float[Array, "tokens index_heads dim"],
    k: Float[Array, "tokens dim"],
    index_pages: Float[Array, "slots pages page_size dim"],
    page_indices: Int[Array, "seqs max_pages"],
    *,
    slot: int | Array,
    token_positions: Int[Array, " tokens"],
    slot_mapping: Int[Array, " tokens"],
    block_size: int,
    topk_blocks: int,
    local_blocks: int,
    token_seq_ids: Int[Array, " tokens"] | None = None,
    batch_invariant: bool = False,
    kv_lens: Int[Array, " seqs"] | None = None,
    cu_q_lens: Int[Array, " seqs_plus_1"] | None = None,
) -> tuple[Int[Array, "tokens index_heads topk"], Float[Array, "slots pages page_size dim"]]:
    """Write this step's indexer keys, then pick each query's key blocks: `(selected, index_pages)`.

    `selected[t, j]` holds the `topk_blocks` block ids (absolute: block b covers positions
    `[b * block_size, (b + 1) * block_size)`) that indexer head j of token t keeps, best first,
    -1 padded. Per query the selection depends only on its own scores, so it is the same alone,
    in a batch or in any chunking. `kv_lens`/`cu_q_lens` are the kernel's row metadata, unused here.
    """
    del kv_lens, cu_q_lens  # encoded in the per-token metadata
    index_pages = write_index_keys(index_pages, slot, k, slot_mapping)

    def select(q_rows, table_rows, position_rows):
        scores = block_scores_paged(q_rows, index_pages, slot, table_rows, position_rows, block_size=block_size)
        return top_blocks(scores, position_rows, block_size=block_size, topk_blocks=topk_blocks,
                          local_blocks=local_blocks)

    tables = page_indices[token_seq_ids]
    return over_query_blocks(select, q, tables, token_positions, batch_invariant=batch_invariant), index_pages


def sparse_attend_paged(
    q: Float[Array, "tokens heads dim"],
    kv_pages: Float[Array, "slots pages page_size kv2 dim"],
    slot: int,
    token_page_table: Int[Array, "tokens max_pages"],
    token_positions: Int[Array, " tokens"],
    selected: Int[Array, "tokens index_heads topk"],
    *,
    sm_scale: float,
    block_size: int,
    fp8_kv: bool = False,
) -> Float[Array, "tokens heads dim"]:
    """Attention of each query head over the keys of its indexer head's selected blocks (and at or
    before its position), one selected block per iteration with an online softmax (`fp8_kv`: FP8 rows,
    dequantised as they are gathered).

    Query head h reads KV head `h // (heads / kv_heads)` and indexer head `h // (heads / index_heads)`.
    Heads are grouped in `max(kv_heads, index_heads)` units that share one KV head and one
    selection, so each iteration gathers one block of keys per unit. Blocks are visited in
    ascending order, whatever the order of `selected`.
    """
    num_tokens, num_heads, dim = q.shape
    _, num_pages, page_size, kv2, row_width = kv_pages.shape
    num_kv_heads, num_index_heads = kv2 // 2, selected.shape[1]
    units = max(num_kv_heads, num_index_heads)
    per_unit = num_heads // units
    unit_kv_head = jnp.arange(units) // (units // num_kv_heads)
    unit_index_head = jnp.arange(units) // (units // num_index_heads)
    max_pages = token_page_table.shape[-1]

    # Ascending block order (valid ids first, -1 last): a canonical accumulation order.
    unit_blocks = selected[:, unit_index_head]
    big = jnp.iinfo(jnp.int32).max
    unit_blocks = jnp.sort(jnp.where(unit_blocks < 0, big, unit_blocks), axis=-1)
    unit_blocks = jnp.where(unit_blocks == big, -1, unit_blocks)

    flat = kv_pages[slot].reshape(num_pages * page_size, kv2, row_width)
    qg = (q.astype(jnp.float32) * sm_scale).reshape(num_tokens, units, per_unit, dim)
    offsets = jnp.arange(block_size, dtype=jnp.int32)

    def attend_block(i, carry):
        block = unit_blocks[:, :, i]  # [t, u]
        key_pos = block[:, :, None] * block_size + offsets  # [t, u, B]
        visible = (block[:, :, None] >= 0) & (key_pos <= token_positions[:, None, None])
        page_slot = jnp.clip(key_pos // page_size, 0, max_pages - 1)
        pages = jnp.take_along_axis(token_page_table[:, None, :], page_slot.reshape(num_tokens, 1, -1), axis=-1)
        rows = jnp.where(visible, pages.reshape(key_pos.shape) * page_size + key_pos % page_size, 0)
        k = load_rows(flat, (rows, unit_kv_head[None, :, None]), dim, fp8_kv)  # [t, u, B, dim]
        v = load_rows(flat, (rows, num_kv_heads + unit_kv_head[None, :, None]), dim, fp8_kv)
        scores = jnp.where(visible[:, :, None, :], jnp.einsum("tugd,tubd->tugb", qg, k), -jnp.inf)
        return online_softmax_step(carry, scores, lambda p: jnp.einsum("tugb,tubd->tugd", p, v))

    def body(i, carry):
        return jax.lax.cond(jnp.any(unit_blocks[:, :, i] >= 0), attend_block, lambda _, c: c, i, carry)

    carry = jax.lax.fori_loop(0, unit_blocks.shape[-1], body, online_softmax_init((num_tokens, units, per_unit), dim))
    out, _ = online_softmax_result(carry)  # padding tokens see no key: out 0
    return out.reshape(num_tokens, num_heads, dim).astype(q.dtype)


def block_sparse_attention(
    q: Float[Array, "tokens heads dim"],
    k: Float[Array, "tokens kv_heads dim"],
    v: Float[Array, "tokens kv_heads dim"],
    kv_pages: Float[Array, "slots pages page_size kv2 dim"],
    page_indices: Int[Array, "seqs max_pages"],
    selected: Int[Array, "tokens index_heads topk"],
    *,
    slot: int,
    token_seq_ids: Int[Array, " tokens"],
    token_positions: Int[Array, " tokens"],
    slot_mapping: Int[Array, " tokens"],
    sm_scale: float,
    block_size: int,
    batch_invariant: bool = False,
    fp8_kv: bool = False,
    attend=None,
    **attend_options,
) -> tuple[Float[Array, "tokens heads dim"], Float[Array, "slots pages page_size kv2 dim"]]:
    """Write this step's K/V into slot `slot`'s pages, then attend over the selected blocks:
    `(out, kv_pages)`. `selected` comes from `index_select_blocks` (-1: no block). `fp8_kv`: the pages
    hold FP8 rows (pallas_kernels/kv_fp8.py). `attend`: a kernel instead of the reference,
    `attend(q, kv_pages, page_indices, selected, token_seq_ids, token_positions, slot=, sm_scale=,
    block_size=, **attend_options)` (each token's arithmetic is its own: `batch_invariant` is moot)."""
    kv_pages = write_kv(kv_pages, slot, k, v, slot_mapping, fp8_kv)
    if attend is not None:
        return attend(q, kv_pages, page_indices, selected, token_seq_ids, token_positions, slot=slot,
                      sm_scale=sm_scale, block_size=block_size, **attend_options), kv_pages
    if attend_options:
        raise TypeError(f"block_sparse_attention: unexpected keyword arguments {sorted(attend_options)}")

    def attend_rows(q_rows, table_rows, position_rows, selected_rows):
        return sparse_attend_paged(q_rows, kv_pages, slot, table_rows, position_rows, selected_rows,
                                   sm_scale=sm_scale, block_size=block_size, fp8_kv=fp8_kv)

    tables = page_indices[token_seq_ids]
    return over_query_blocks(attend_rows, q, tables, token_positions, selected,
                             batch_invariant=batch_invariant), kv_pages
