"""DeepSeek-V4's lightning indexer (scores and top-k) as Triton-style Pallas kernels.

They match `pallas_kernels.dsv4_attention.indexer_topk`:
  * `indexer_scores_kernel`: one program per work item (consecutive query tokens of one sequence
    times the indexer heads as dot rows) streams the sequence's compressed indexer keys from their
    pages and stores `sum_h w_h relu(q_h . key) * sm_scale` per entry, up to the item's last ended
    entry (later entries are left unwritten: the top-k kernels never read them);
  * `topk_entries_kernel`: per token, finds the k-th best score exactly by a radix search over the
    scores' order-preserving int32 keys (32 passes), keeps the entries above it and the lowest
    entries that tie with it (compacted in entry order), then a second kernel ranks the kept
    entries against each other and writes them best first (ties: lower entry first); -1 pads the
    slots past the ended entries. A zero score counts as +0.0, as in the reference.
The attention over the chosen entries is `pallas_kernels.dsv4_attention_kernels`. A token's choice
depends only on its own scores. Pallas' Triton backend on a GPU (always with Triton CompilerParams);
interpret mode on a CPU (the CPU runner never uses these). In interpret mode masked-off lanes store
into a spare row or column, never onto a used address.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from agentjax.errors import KernelShapeError
from pallas_kernels import dsv4_attention as reference
from pallas_kernels.ragged_work import next_power_of_two
from pallas_kernels.triton_call import (
    check_tiles, contract_arguments, item_rows, lanes, page_rows, spare_rows, store_index, triton_call,
)

_INT_MIN = -(2**31)


def seq_runs(token_seq_ids: Int[Array, " tokens"], tokens_per_item: int):
    """Work items `(start, count)` over runs of consecutive tokens with one sequence id, at most
    `tokens_per_item` tokens each; static length `tokens` (unused items: start 0, count 0)."""
    num_tokens = token_seq_ids.shape[0]
    index = jnp.arange(num_tokens, dtype=jnp.int32)
    new_run = jnp.concatenate([jnp.ones((1,), bool), token_seq_ids[1:] != token_seq_ids[:-1]])
    run_start = jax.lax.cummax(jnp.where(new_run, index, 0))
    first = new_run | ((index - run_start) % tokens_per_item == 0)
    (start,) = jnp.nonzero(first, size=num_tokens, fill_value=num_tokens)
    end = jnp.concatenate([start[1:], jnp.full((1,), num_tokens, start.dtype)])
    used = start < num_tokens
    return jnp.where(used, start, 0).astype(jnp.int32), jnp.where(used, end - start, 0).astype(jnp.int32)


def _entries_ended(token_positions, ratio: int, capacity: int):
    return jnp.minimum((token_positions.astype(jnp.int32) + 1) // ratio, capacity)


# ---- the lightning indexer's scores ---------------------------------------------------------------

def _indexer_scores_kernel(
    slot_ref, item_start_ref, item_count_ref, seq_ref, positions_ref, table_ref, q_ref, w_ref, keys_ref,
    scores_ref, *, heads_per_token, num_heads, rows, kv_block, per_page, num_pages, ratio, capacity, dim, sm_scale,
    interpret,
):
    item = pl.program_id(0)
    start, count = item_start_ref[item], item_count_ref[item]
    seq = seq_ref[start]
    tokens_per_tile = rows // heads_per_token
    row_token, head, row_used = item_rows(rows, heads_per_token, start, count, num_heads=num_heads)
    lane, lane_used = lanes(dim)
    q = plt.load(q_ref.at[row_token[:, None], head[:, None], lane[None, :]],
                 mask=row_used[:, None] & lane_used[None, :], other=0)
    weights = plt.load(w_ref.at[row_token, head], mask=row_used, other=0.0).astype(jnp.float32)
    precise = dict(allow_tf32=False) if q.dtype == jnp.float32 else {}

    local = jnp.arange(tokens_per_tile, dtype=jnp.int32)
    token_used = local < count
    token = jnp.where(token_used, start + local, 0)
    store_token = store_index(token, token_used, scores_ref.shape[0] - 1, interpret)
    position = plt.load(positions_ref.at[token], mask=token_used, other=0)
    ended = jnp.where(token_used, jnp.minimum((position + 1) // ratio, capacity), 0)
    last = jnp.max(ended)
    offsets = jnp.arange(kv_block, dtype=jnp.int32)

    def tile(index, carry):
        entry = index * kv_block + offsets
        entry_used = entry < last
        flat = page_rows(table_ref, seq, entry, entry_used, slot_ref[0], num_pages, per_page)
        keys = plt.load(keys_ref.at[flat[:, None], lane[None, :]], mask=entry_used[:, None] & lane_used[None, :],
                        other=0)
        logits = plt.dot(q, keys.astype(q.dtype), trans_b=True, **precise)
        weighted = jnp.maximum(logits, 0.0) * sm_scale * weights[:, None]
        scores = weighted.reshape(tokens_per_tile, heads_per_token, kv_block).sum(axis=1)
        plt.store(scores_ref.at[store_token[:, None], entry[None, :]], scores,
                  mask=token_used[:, None] & entry_used[None, :])
        return carry

    jax.lax.fori_loop(0, (last + kv_block - 1) // kv_block, tile, 0)


def indexer_scores_kernel(
    q: Float[Array, "tokens heads dim"],
    weights: Float[Array, "tokens heads"],
    key_pages: Float[Array, "slots pages entries_per_page dim"],
    slot: int | Array,
    page_indices: Int[Array, "seqs max_pages"],
    *,
    token_seq_ids: Int[Array, " tokens"],
    token_positions: Int[Array, " tokens"],
    ratio: int,
    sm_scale: float,
    query_rows: int = 64,
    kv_block: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    one_token_per_item: bool = False,
    interpret: bool = False,
) -> Float[Array, "tokens entries"]:
    """Each token's float32 indexer score of every compressed entry whose block has ended
    (`w < (pos + 1) // ratio`); entries past the token's work item's last ended entry are left
    unwritten. `query_rows // heads` consecutive tokens of one sequence share each key tile
    (`one_token_per_item`: one token, so a row's tile never depends on its neighbours)."""
    num_tokens, num_heads, dim = q.shape
    num_slots, num_pages, per_page, key_dim = key_pages.shape
    if key_dim != dim or weights.shape != (num_tokens, num_heads):
        raise KernelShapeError(f"indexer_scores_kernel: q {q.shape}, weights {weights.shape} and key pages "
                               f"{key_pages.shape} do not fit")
    heads_per_token = next_power_of_two(num_heads)
    tokens_per_item = 1 if one_token_per_item else max(1, query_rows // heads_per_token)
    rows = max(16, tokens_per_item * heads_per_token)
    check_tiles("indexer_scores_kernel", dict(kv_block=kv_block, rows=rows))
    capacity = page_indices.shape[1] * per_page
    width = -(-capacity // kv_block) * kv_block
    item_start, item_count = seq_runs(token_seq_ids.astype(jnp.int32), tokens_per_item)
    kernel = functools.partial(
        _indexer_scores_kernel, heads_per_token=heads_per_token, num_heads=num_heads, rows=rows, kv_block=kv_block,
        per_page=per_page, num_pages=num_pages, ratio=ratio, capacity=capacity, dim=dim, sm_scale=float(sm_scale),
        interpret=bool(interpret))
    scores = triton_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_tokens + spare_rows(interpret), width), jnp.float32),
        grid=(num_tokens,), name="dsv4_indexer_scores", num_warps=num_warps, num_stages=num_stages,
        interpret=interpret,
    )(jnp.asarray(slot, jnp.int32).reshape(1), item_start, item_count, token_seq_ids.astype(jnp.int32),
      token_positions.astype(jnp.int32), page_indices.astype(jnp.int32), q, weights,
      key_pages.reshape(num_slots * num_pages * per_page, dim))
    return scores[:num_tokens]


# ---- top-k over the scores ------------------------------------------------------------------------

def _order_keys(scores):
    """int32 keys whose signed order is the scores' float order, with -0.0 read as +0.0."""
    bits = jax.lax.bitcast_convert_type(scores, jnp.int32)
    bits = jnp.where(bits == _INT_MIN, 0, bits)
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _topk_select_kernel(ended_ref, keep_ref, scores_ref, kept_entry_ref, kept_key_ref, *, chunk, padded_topk,
                        interpret):
    token = pl.program_id(0)
    ended, keep = ended_ref[token], keep_ref[token]
    offsets = jnp.arange(chunk, dtype=jnp.int32)
    rows = jnp.full((chunk,), token, jnp.int32)
    num_chunks = (ended + chunk - 1) // chunk

    def load(index):
        entry = index * chunk + offsets
        valid = entry < ended
        score = plt.load(scores_ref.at[rows, entry], mask=valid, other=0.0)
        return entry, valid, _order_keys(score)

    def count_at_least(threshold):
        def body(index, total):
            _, valid, key = load(index)
            return total + jnp.sum(jnp.where(valid & (key >= threshold), 1, 0))
        return jax.lax.fori_loop(0, num_chunks, body, jnp.int32(0))

    def radix_step(step, prefix):  # bit 31 - step of the k-th largest key, in offset binary
        candidate = prefix | jnp.left_shift(jnp.int32(1), 31 - step)
        return jnp.where(count_at_least(candidate ^ _INT_MIN) >= keep, candidate, prefix)

    threshold = jax.lax.fori_loop(0, jnp.where(keep > 0, 32, 0), radix_step, jnp.int32(0)) ^ _INT_MIN

    def above(index, total):
        _, valid, key = load(index)
        return total + jnp.sum(jnp.where(valid & (key > threshold), 1, 0))

    ties_wanted = keep - jax.lax.fori_loop(0, num_chunks, above, jnp.int32(0))

    def compact(index, carry):
        written, ties_seen = carry
        entry, valid, key = load(index)
        tie = jnp.where(valid & (key == threshold), 1, 0)
        tie_rank = ties_seen + jnp.cumsum(tie) - tie
        kept = (valid & (key > threshold)) | ((tie == 1) & (tie_rank < ties_wanted))
        kept_count = jnp.where(kept, 1, 0)
        slot = written + jnp.cumsum(kept_count) - kept_count
        slot = jnp.where(kept, slot, padded_topk) if interpret else slot
        plt.store(kept_entry_ref.at[rows, slot], entry, mask=kept)
        plt.store(kept_key_ref.at[rows, slot], key, mask=kept)
        return written + jnp.sum(kept_count), ties_seen + jnp.sum(tie)

    jax.lax.fori_loop(0, jnp.where(keep > 0, num_chunks, 0), compact, (jnp.int32(0), jnp.int32(0)))


def _topk_order_kernel(keep_ref, kept_entry_ref, kept_key_ref, out_ref, *, tile, chunk):
    token, part = pl.program_id(0), pl.program_id(1)
    keep = keep_ref[token]
    slot = part * tile + jnp.arange(tile, dtype=jnp.int32)
    used = slot < keep
    key = plt.load(kept_key_ref.at[jnp.full((tile,), token, jnp.int32), slot], mask=used, other=0)
    entry = plt.load(kept_entry_ref.at[jnp.full((tile,), token, jnp.int32), slot], mask=used, other=0)
    offsets = jnp.arange(chunk, dtype=jnp.int32)

    def beaten_by(index, rank):  # kept entries sit in entry order: a lower slot is a lower entry
        other = index * chunk + offsets
        other_used = other < keep
        other_key = plt.load(kept_key_ref.at[jnp.full((chunk,), token, jnp.int32), other], mask=other_used, other=0)
        better = (other_key[None, :] > key[:, None]) | (
            (other_key[None, :] == key[:, None]) & (other[None, :] < slot[:, None]))
        return rank + jnp.sum(jnp.where(other_used[None, :] & better, 1, 0), axis=1)

    rank = jax.lax.fori_loop(0, (keep + chunk - 1) // chunk, beaten_by, jnp.zeros((tile,), jnp.int32))
    # Kept entries take ranks 0 .. keep-1 and the other slots keep their own index: a permutation.
    plt.store(out_ref.at[jnp.full((tile,), token, jnp.int32), jnp.where(used, rank, slot)],
              jnp.where(used, entry, -1))


def topk_entries_kernel(
    scores: Float[Array, "tokens entries"],
    token_positions: Int[Array, " tokens"],
    *,
    ratio: int,
    topk: int,
    num_entries: int,
    chunk: int = 64,
    order_tile: int = 64,
    num_warps: int = 4,
    interpret: bool = False,
) -> Int[Array, "tokens topk"]:
    """`indexer_topk`'s selection over `indexer_scores_kernel`'s scores: per token the `topk` best of
    its ended entries (at most `num_entries`), best first, ties to the lower entry, -1 padded."""
    num_tokens = scores.shape[0]
    check_tiles("topk_entries_kernel", dict(chunk=chunk, order_tile=order_tile))
    padded_topk = max(order_tile, next_power_of_two(topk))
    ended = _entries_ended(token_positions, ratio, num_entries)
    keep = jnp.minimum(ended, topk).astype(jnp.int32)
    call = functools.partial(triton_call, num_warps=num_warps, num_stages=1, interpret=interpret)
    kept_entry, kept_key = call(
        functools.partial(_topk_select_kernel, chunk=chunk, padded_topk=padded_topk, interpret=bool(interpret)),
        out_shape=(jax.ShapeDtypeStruct((num_tokens, padded_topk + spare_rows(interpret)), jnp.int32),) * 2,
        grid=(num_tokens,), name="dsv4_indexer_top_k_select",
    )(ended, keep, scores)
    selected = call(
        functools.partial(_topk_order_kernel, tile=order_tile, chunk=chunk),
        out_shape=jax.ShapeDtypeStruct((num_tokens, padded_topk), jnp.int32),
        grid=(num_tokens, padded_topk // order_tile), name="dsv4_indexer_top_k_order",
    )(keep, kept_entry, kept_key)
    return selected[:, :topk]


def indexer_topk_kernel(*args, interpret: bool = False, score_options: dict | None = None,
                        select_options: dict | None = None, **kwargs) -> Int[Array, "tokens topk"]:
    """`dsv4_attention.indexer_topk`'s contract (its arguments) as the score and top-k kernels.
    Batch-invariant numerics score one token per work item (a token's key tiles never depend on its
    neighbours)."""
    call, _ = contract_arguments(reference.indexer_topk, args, kwargs, tuning=False)
    score_options = dict(score_options or {})
    score_options.setdefault("one_token_per_item", call.batch_invariant)
    scores = indexer_scores_kernel(call.q, call.weights, call.key_pages, call.slot, call.page_indices,
                                   token_seq_ids=call.token_seq_ids, token_positions=call.token_positions,
                                   ratio=call.ratio, sm_scale=call.sm_scale, interpret=interpret, **score_options)
    return topk_entries_kernel(scores, call.token_positions, ratio=call.ratio, topk=call.topk,
                               num_entries=call.page_indices.shape[1] * call.key_pages.shape[2], interpret=interpret,
                               **(select_options or {}))
