"""DeepSeek-V4 attention over the paged cache: the pure-jnp references future Pallas kernels must match.

Five ops, each per query token (or per completed block) with fixed shapes, so no result depends on
the batch or on how a sequence was split into steps (numerics="batch_invariant" runs fixed 8-row
blocks): `write_rows` scatters per-token rows (sliding-window K=V rows, compressor inputs) into their
pages; `pool_blocks` softmax-pools a completed block's compressor inputs (CSA: the previous block's
Ca half with this block's Cb half, 2r slots; HCA: r slots) into one entry; `write_entries` stores
entries; `indexer_topk` scores a token's lightning-indexer queries against every compressed key whose
block has ended and keeps the top k (ties: lower entry first); `sliding_compressed_attention` attends
over the token's window rows plus its selected (CSA) or all (HCA) compressed entries, with per-head
sinks. Entry w (tokens [w*r, (w+1)*r)) lives in page `table[w // E]`, row `w % E`, E = page_size // r.
Never reads a page position outside the query's window or an entry whose block has not ended.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.online_softmax import fold_sink, online_softmax_init, online_softmax_result, online_softmax_step
from pallas_kernels.ragged_paged_attention import over_query_blocks, write_rows

# Compressed entries scored or attended per loop iteration (rounded to whole pages).
ENTRY_CHUNK = 64


def _row_blocks(fn, *arrays, batch_invariant: bool):
    """`fn` over query row blocks, the batch-invariant ones fenced (see `over_query_blocks`)."""
    return over_query_blocks(fn, *arrays, batch_invariant=batch_invariant, fence=True)


def write_entries(
    pages: Float[Array, "slots pages entries_per_page width"],
    slot: Int[Array, ""],
    entries: Float[Array, "n width"],
    entry_slots: Int[Array, " n"],
) -> Float[Array, "slots pages entries_per_page width"]:
    """Scatter compressed entries to `page * entries_per_page + row`; a negative slot is dropped."""
    _, num_pages, per_page, _ = pages.shape
    target = jnp.where(entry_slots < 0, num_pages * per_page, entry_slots)  # out of range: dropped
    return write_rows(pages, slot, entries, target)


def _gather_positions(pages, slot, tables, positions, valid):
    """Rows at absolute token `positions [n, m]` through each row's page table `tables [n, p]`."""
    _, num_pages, page_size, width = pages.shape
    page_slot = jnp.clip(positions // page_size, 0, tables.shape[-1] - 1)
    page = jnp.take_along_axis(tables, page_slot, axis=-1)
    index = jnp.where(valid, page * page_size + positions % page_size, 0)
    return pages[slot].reshape(num_pages * page_size, width)[index]


def pool_blocks(
    state_pages: Float[Array, "slots pages page_size width"],
    slot: Int[Array, ""],
    tables: Int[Array, "n max_pages"],
    end_positions: Int[Array, " n"],
    position_bias: Float[Array, "ratio cd"],
    *,
    ratio: int,
    overlap: bool,
    dtype=None,
    batch_invariant: bool = False,
) -> Float[Array, "n dim"]:
    """The softmax-gated pool of the block that ends at each `end_positions[i]` (the entry before its
    norm and RoPE), in `dtype` (default: the rows' dtype; the model's dtype reproduces its rounding).

    A state row holds a token's `[kv_proj | gate_proj]` outputs (width 2*c*dim, c = 2 with `overlap`).
    Without overlap (HCA) the pool runs over the block's r tokens; with overlap (CSA) over 2r slots:
    the previous block's first halves (Ca) then this block's second halves (Cb); slots before
    position 0 take no weight. The gate of in-block position i adds `position_bias[i]`; the softmax
    runs per channel in float32, the weighted sum in `dtype` (transformers' order).
    """
    dtype = dtype or state_pages.dtype
    c = 2 if overlap else 1
    span = c * ratio
    dim = state_pages.shape[-1] // (2 * c)
    bias = position_bias.astype(jnp.float32)

    def pool(tables_rows, ends):
        positions = ends[:, None] - span + 1 + jnp.arange(span, dtype=jnp.int32)[None, :]
        valid = positions >= 0
        rows = _gather_positions(state_pages, slot, tables_rows, positions, valid)
        kv, gate = rows[..., :c * dim], rows[..., c * dim:]
        gate = gate.astype(jnp.float32) + jnp.tile(bias, (c, 1))[None]
        if overlap:
            kv = jnp.concatenate([kv[:, :ratio, :dim], kv[:, ratio:, dim:]], axis=1)
            gate = jnp.concatenate([gate[:, :ratio, :dim], gate[:, ratio:, dim:]], axis=1)
        kv = jnp.where(valid[..., None], kv, 0).astype(dtype)
        gate = jnp.where(valid[..., None], gate, -jnp.inf)
        weights = jax.nn.softmax(gate, axis=1).astype(dtype)
        return (kv * weights).sum(axis=1)

    return _row_blocks(pool, tables, end_positions, batch_invariant=batch_invariant)


def _entry_chunk_pages(entries_per_page: int, max_pages: int) -> int:
    return max(1, min(max_pages, ENTRY_CHUNK // entries_per_page))


def _chunked_tables(tables, chunk_pages):
    pad = (-tables.shape[-1]) % chunk_pages
    return jnp.pad(tables, ((0, 0), (0, pad))) if pad else tables


def indexer_topk(
    q: Float[Array, "tokens heads dim"],
    weights: Float[Array, "tokens heads"],
    key_pages: Float[Array, "slots pages entries_per_page dim"],
    slot: Int[Array, ""],
    page_indices: Int[Array, "seqs max_pages"],
    *,
    token_seq_ids: Int[Array, " tokens"],
    token_positions: Int[Array, " tokens"],
    ratio: int,
    topk: int,
    sm_scale: float,
    batch_invariant: bool = False,
) -> Int[Array, "tokens topk"]:
    """The lightning indexer's choice: per token, the `topk` compressed entries with the highest
    `sum_h weights[h] * relu(q_h . key) * sm_scale` among the entries whose block has ended
    (`w < (pos + 1) // ratio`), best first, ties to the lower entry (a zero score is +0.0 whatever
    its sign: `lax.top_k` alone would rank +0.0 above -0.0); -1 pads when fewer have ended.
    Scores are float32, one chunk of whole pages per loop iteration."""
    _, _, per_page, _ = key_pages.shape
    chunk_pages = _entry_chunk_pages(per_page, page_indices.shape[-1])
    tables = _chunked_tables(page_indices, chunk_pages)[token_seq_ids]
    num_chunks = tables.shape[-1] // chunk_pages
    chunk_entries = chunk_pages * per_page
    keys_flat = key_pages[slot].reshape(-1, key_pages.shape[-1])

    def select(q_rows, w_rows, table_rows, positions):
        q32 = q_rows.astype(jnp.float32)
        w32 = w_rows.astype(jnp.float32)
        ended = (positions + 1) // ratio
        last_needed = ended.max()
        offsets = jnp.arange(chunk_entries, dtype=jnp.int32)

        def score_chunk(chunk, scores):
            pages = jax.lax.dynamic_slice_in_dim(table_rows, chunk * chunk_pages, chunk_pages, -1)
            rows = (pages[:, :, None] * per_page + jnp.arange(per_page)[None, None, :]).reshape(pages.shape[0], -1)
            keys = keys_flat[rows].astype(jnp.float32)  # [n, chunk_entries, dim]
            logits = jnp.einsum("nhd,ncd->nhc", q32, keys)
            chunk_scores = (jnp.maximum(logits, 0) * sm_scale * w32[:, :, None]).sum(axis=1)
            ids = chunk * chunk_entries + offsets
            chunk_scores = jnp.where(chunk_scores == 0, 0.0, chunk_scores)  # -0.0 ties with +0.0
            chunk_scores = jnp.where(ids[None, :] < ended[:, None], chunk_scores, -jnp.inf)
            return jax.lax.dynamic_update_slice_in_dim(scores, chunk_scores, chunk * chunk_entries, axis=-1)

        def body(chunk, scores):  # chunks past every row's last ended entry stay -inf
            return jax.lax.cond(chunk * chunk_entries < last_needed, score_chunk, lambda _, s: s, chunk, scores)

        width = max(num_chunks * chunk_entries, topk)
        scores = jax.lax.fori_loop(0, num_chunks, body, jnp.full((q_rows.shape[0], width), -jnp.inf, jnp.float32))
        values, chosen = jax.lax.top_k(scores, topk)
        return jnp.where(values == -jnp.inf, -1, chosen).astype(jnp.int32)

    return _row_blocks(select, q, weights, tables, token_positions, batch_invariant=batch_invariant)


def _online_update(carry, scores, values):
    """Fold `scores [n, h, m]` (masked: -inf) over `values [n, m, d]` into the online softmax's carry."""
    return online_softmax_step(carry, scores, lambda p: jnp.einsum("nhm,nmd->nhd", p, values))


def sliding_compressed_attention(
    q: Float[Array, "tokens heads dim"],
    window_pages: Float[Array, "slots pages page_size dim"],
    window_slot: Int[Array, ""],
    window_page_indices: Int[Array, "seqs max_pages"],
    sinks: Float[Array, " heads"],
    *,
    token_seq_ids: Int[Array, " tokens"],
    token_positions: Int[Array, " tokens"],
    window: int,
    sm_scale: float,
    entry_pages: Float[Array, "slots pages entries_per_page dim"] | None = None,
    entry_slot: Int[Array, ""] | None = None,
    entry_page_indices: Int[Array, "seqs max_pages"] | None = None,
    ratio: int = 1,
    selected: Int[Array, "tokens topk"] | None = None,
    batch_invariant: bool = False,
) -> Float[Array, "tokens heads dim"]:
    """Shared-KV MQA of each query over its window rows (positions pos-window+1..pos) and, with
    `entry_pages`, compressed entries: the `selected` ones (CSA, -1 = none) or, without `selected`,
    every entry whose block has ended (HCA, streamed one chunk of pages at a time). K = V (one row per
    key). A head's sink logit joins the softmax denominator and carries no value. Float32 inside;
    returns q's dtype."""
    num_tokens, num_heads, dim = q.shape
    window_tables = window_page_indices[token_seq_ids]
    offsets = jnp.arange(window, dtype=jnp.int32)
    sink = sinks.astype(jnp.float32)
    if entry_pages is not None:
        per_page = entry_pages.shape[2]
        entries_flat = entry_pages[entry_slot].reshape(-1, dim)
        chunk_pages = _entry_chunk_pages(per_page, entry_page_indices.shape[-1])
        entry_tables = _chunked_tables(entry_page_indices, chunk_pages)[token_seq_ids]
    else:
        entry_tables = jnp.zeros((num_tokens, 1), jnp.int32)
    if selected is None:
        selected = jnp.zeros((num_tokens, 1), jnp.int32)
        dense = entry_pages is not None
    else:
        dense = False

    def attend(q_rows, positions, w_tables, e_tables, chosen):
        n = q_rows.shape[0]
        q32 = q_rows.astype(jnp.float32) * sm_scale
        key_pos = positions[:, None] - window + 1 + offsets[None, :]
        visible = key_pos >= 0
        rows = _gather_positions(window_pages, window_slot, w_tables, key_pos, visible).astype(jnp.float32)
        rows = jnp.where(visible[..., None], rows, 0)  # what masked slots read must not reach the sum
        scores = jnp.where(visible[:, None, :], jnp.einsum("nhd,nmd->nhm", q32, rows), -jnp.inf)
        carry = _online_update(online_softmax_init((n, num_heads), dim), scores, rows)
        if entry_pages is not None and not dense:  # CSA: the indexer's picks
            valid = chosen >= 0
            page = jnp.take_along_axis(e_tables, jnp.clip(chosen // per_page, 0, e_tables.shape[-1] - 1), axis=-1)
            index = jnp.where(valid, page * per_page + chosen % per_page, 0)
            picked = jnp.where(valid[..., None], entries_flat[index].astype(jnp.float32), 0)
            scores = jnp.where(valid[:, None, :], jnp.einsum("nhd,nmd->nhm", q32, picked), -jnp.inf)
            carry = _online_update(carry, scores, picked)
        elif dense:  # HCA: every ended entry, in ascending chunks
            ended = (positions + 1) // ratio
            chunk_entries = chunk_pages * per_page
            ids = jnp.arange(chunk_entries, dtype=jnp.int32)

            def attend_chunk(chunk, state):
                pages = jax.lax.dynamic_slice_in_dim(e_tables, chunk * chunk_pages, chunk_pages, -1)
                index = (pages[:, :, None] * per_page + jnp.arange(per_page)[None, None, :]).reshape(n, -1)
                chunk_rows = entries_flat[index].astype(jnp.float32)
                ok = (chunk * chunk_entries + ids)[None, :] < ended[:, None]
                chunk_scores = jnp.where(ok[:, None, :], jnp.einsum("nhd,nmd->nhm", q32, chunk_rows), -jnp.inf)
                return _online_update(state, chunk_scores, jnp.where(ok[..., None], chunk_rows, 0))

            def body(chunk, state):
                return jax.lax.cond(chunk * chunk_entries < ended.max(), attend_chunk, lambda _, s: s, chunk, state)

            carry = jax.lax.fori_loop(0, e_tables.shape[-1] // chunk_pages, body, carry)
        out, _ = online_softmax_result(fold_sink(carry, sink[None, :]))
        return out.astype(q.dtype)

    return _row_blocks(attend, q, token_positions, window_tables, entry_tables, selected,
                       batch_invariant=batch_invariant)
