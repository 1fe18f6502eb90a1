"""MiniMax-M3's block indexer and block-sparse attention as Triton-style Pallas kernels.

They match `pallas_kernels.block_sparse_attention` (`index_select_blocks`, `block_sparse_attention`):
  * `block_scores_kernel`: one program per work item (consecutive query tokens of one sequence times
    the indexer heads as dot rows) streams the row's indexer keys from their pages and stores each
    block's max score, up to the query's own block;
  * `top_blocks_kernel`: per (token, indexer head), forces the local blocks and selects the top-k
    blocks best first (ties: lower block first) by k passes over the block scores, each taking the
    best block after the previous one in that order; -1 pads slots past the causal blocks;
  * `sparse_attention_kernel`: one program per (token, head unit: the query heads sharing one KV
    head and one selection) attends over the selected blocks in ascending order, online softmax.
Pallas' Triton backend on a GPU; interpret mode on a CPU (the CPU runner never uses these kernels).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from agentjax.errors import KernelShapeError
from pallas_kernels.block_sparse_attention import block_sparse_attention, index_select_blocks, write_index_keys
from pallas_kernels.online_softmax import online_softmax_init, online_softmax_result, online_softmax_step
from pallas_kernels.ragged_paged_attention import causal_visible
from pallas_kernels.ragged_work import next_power_of_two, work_items
from pallas_kernels.triton_call import (
    check_tiles, contract_arguments, item_rows, lanes, page_rows, query_positions, ragged_operands, spare_rows,
    store_index, triton_call,
)

_NO_BLOCK = 2**30  # larger than any block id


def _block_scores_kernel(
    slot_ref, item_seq_ref, item_start_ref, item_count_ref, kv_lens_ref, cu_q_lens_ref, table_ref, q_ref, keys_ref,
    scores_ref, *, heads_per_token, num_heads, query_rows, kv_block, block_size, page_size, num_pages, dim,
    interpret,
):
    item = pl.program_id(0)
    seq, start, count = item_seq_ref[item], item_start_ref[item], item_count_ref[item]
    token, head, row_used = item_rows(query_rows, heads_per_token, start, count, num_heads=num_heads)
    store_token = store_index(token, row_used, scores_ref.shape[0] - 1, interpret)
    position, first_position = query_positions(kv_lens_ref, cu_q_lens_ref, seq, start, token)
    kv_end = first_position + count
    lane, lane_used = lanes(dim)
    q = plt.load(q_ref.at[token[:, None], head[:, None], lane[None, :]],
                 mask=row_used[:, None] & lane_used[None, :], other=0)
    precise = dict(allow_tf32=False) if q.dtype == jnp.float32 else {}
    unit = max(block_size, kv_block)  # key positions per loop step: a whole number of blocks and tiles
    offsets = jnp.arange(kv_block, dtype=jnp.int32)

    def tile_scores(first):
        key_position = first + offsets
        key_used = key_position < kv_end
        entry = page_rows(table_ref, seq, key_position, key_used, slot_ref[0], num_pages, page_size)
        keys = plt.load(keys_ref.at[entry[:, None], lane[None, :]], mask=key_used[:, None] & lane_used[None, :],
                        other=0)
        scores = plt.dot(q, keys.astype(q.dtype), trans_b=True, **precise)
        visible = causal_visible(key_position, position, None) & key_used[None, :]
        return jnp.where(visible, scores, -jnp.inf)

    def step(index, carry):
        if block_size >= kv_block:  # one block per step, several tiles
            best = jnp.full((query_rows,), -jnp.inf, jnp.float32)
            for tile in range(block_size // kv_block):
                best = jnp.maximum(best, tile_scores(index * unit + tile * kv_block).max(axis=1))
            block = jnp.full((query_rows,), index, jnp.int32)
            plt.store(scores_ref.at[store_token, head, block], best, mask=row_used)
        else:  # several blocks per tile
            per_tile = kv_block // block_size
            best = tile_scores(index * unit).reshape(query_rows, per_tile, block_size).max(axis=2)
            block = index * per_tile + jnp.arange(per_tile, dtype=jnp.int32)
            plt.store(scores_ref.at[store_token[:, None], head[:, None], block[None, :]], best,
                      mask=row_used[:, None])
        return carry

    jax.lax.fori_loop(0, jnp.where(count > 0, (kv_end + unit - 1) // unit, 0), step, 0)


def block_scores_kernel(
    q: Float[Array, "tokens index_heads dim"],
    index_pages: Float[Array, "slots pages page_size dim"],
    kv_lens: Int[Array, " seqs"],
    page_indices: Int[Array, "seqs max_pages"],
    cu_q_lens: Int[Array, " seqs_plus_1"],
    *,
    slot: int | Array,
    block_size: int,
    query_rows: int = 64,
    kv_block: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> Float[Array, "tokens index_heads blocks"]:
    """Each query's block-max indexer score (float32, unscaled) for blocks 0 .. its own block; later
    blocks are left unwritten (`top_blocks_kernel` never reads them). `block_size` and the tiles are
    powers of two; `query_rows // index_heads` tokens share each key tile."""
    num_tokens, num_heads, dim = q.shape
    num_slots, num_pages, page_size, key_dim = index_pages.shape
    heads_per_token = next_power_of_two(num_heads)
    query_rows = max(query_rows, heads_per_token)
    check_tiles("block_scores_kernel", dict(query_rows=query_rows, kv_block=kv_block), dict(block_size=block_size))
    if key_dim != dim:
        raise KernelShapeError(f"block_scores_kernel: queries {q.shape} and index pages {index_pages.shape} "
                               "have different head dims")
    num_blocks = -(-page_indices.shape[1] * page_size // block_size)
    cu_q_lens = jnp.asarray(cu_q_lens, jnp.int32)
    items = work_items(cu_q_lens, num_tokens, query_rows // heads_per_token)
    kernel = functools.partial(
        _block_scores_kernel, heads_per_token=heads_per_token, num_heads=num_heads, query_rows=query_rows,
        kv_block=kv_block, block_size=block_size, page_size=page_size, num_pages=num_pages, dim=dim,
        interpret=bool(interpret))
    scores = triton_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_tokens + spare_rows(interpret), num_heads, num_blocks), jnp.float32),
        grid=(items[0].shape[0],), name="block_indexer_scores", num_warps=num_warps, num_stages=num_stages,
        interpret=interpret,
    )(*ragged_operands(slot, items, kv_lens, cu_q_lens, page_indices), q,
      index_pages.reshape(num_slots * num_pages * page_size, dim))
    return scores[:num_tokens]


def _top_blocks_kernel(real_ref, positions_ref, scores_ref, out_ref, *, rows, num_heads, block_size, topk,
                       local_blocks, chunk, interpret):
    flat = pl.program_id(0) * rows + jnp.arange(rows, dtype=jnp.int32)
    token, head = flat // num_heads, flat % num_heads
    used = token < real_ref[0]
    token = jnp.where(used, token, 0)
    store_token = store_index(token, used, out_ref.shape[0] - 1, interpret)
    position = plt.load(positions_ref.at[token], mask=used, other=0)
    query_block = jnp.where(used, position // block_size, -1)
    first_forced = jnp.maximum(query_block - local_blocks + 1, 0)
    offsets = jnp.arange(chunk, dtype=jnp.int32)
    num_chunks = (jnp.max(query_block) + chunk) // chunk

    def select(slot, previous):
        # The best block strictly after `previous` in the order (score descending, block ascending).
        previous_score, previous_block = previous

        def scan(index, best):
            best_score, best_block = best
            block = index * chunk + offsets
            valid = block[None, :] <= query_block[:, None]
            score = plt.load(scores_ref.at[token[:, None], head[:, None], block[None, :]], mask=valid,
                             other=-jnp.inf)
            score = jnp.where(valid & (block[None, :] >= first_forced[:, None]), jnp.inf, score)
            after = valid & ((score < previous_score[:, None])
                             | ((score == previous_score[:, None]) & (block[None, :] > previous_block[:, None])))
            top = jnp.where(after, score, -jnp.inf).max(axis=1)
            top_block = jnp.where(after & (score == top[:, None]), block[None, :], _NO_BLOCK).min(axis=1)
            better = (top_block < _NO_BLOCK) & ((top > best_score) | ((top == best_score) & (top_block < best_block)))
            return jnp.where(better, top, best_score), jnp.where(better, top_block, best_block)

        init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.full((rows,), _NO_BLOCK, jnp.int32))
        best_score, best_block = jax.lax.fori_loop(0, num_chunks, scan, init)
        chosen = jnp.where(best_block < _NO_BLOCK, best_block, -1)
        plt.store(out_ref.at[store_token, head, jnp.full((rows,), slot, jnp.int32)], chosen, mask=used)
        return best_score, best_block

    jax.lax.fori_loop(0, topk, select, (jnp.full((rows,), jnp.inf, jnp.float32), jnp.full((rows,), -1, jnp.int32)))


def top_blocks_kernel(
    block_scores: Float[Array, "tokens heads blocks"],
    token_positions: Int[Array, " tokens"],
    num_real_tokens: Int[Array, ""],
    *,
    block_size: int,
    topk_blocks: int,
    local_blocks: int,
    rows: int = 64,
    chunk: int = 64,
    num_warps: int = 4,
    interpret: bool = False,
) -> Int[Array, "tokens heads topk"]:
    """`block_sparse_attention.top_blocks` over `block_scores_kernel`'s scores: blocks after the query's
    own are never read; tokens from `num_real_tokens` on get -1. `rows` (token, head) pairs per program."""
    num_tokens, num_heads, _ = block_scores.shape
    check_tiles("top_blocks_kernel", dict(rows=rows, chunk=chunk))
    kernel = functools.partial(
        _top_blocks_kernel, rows=rows, num_heads=num_heads, block_size=block_size, topk=topk_blocks,
        local_blocks=local_blocks, chunk=chunk, interpret=bool(interpret))
    selected = triton_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_tokens + spare_rows(interpret), num_heads, topk_blocks), jnp.int32),
        grid=(pl.cdiv(num_tokens * num_heads, rows),), name="block_indexer_top_k", num_warps=num_warps,
        num_stages=1, interpret=interpret,
    )(jnp.asarray(num_real_tokens, jnp.int32).reshape(1), token_positions.astype(jnp.int32), block_scores)
    real = (jnp.arange(num_tokens) < num_real_tokens)[:, None, None]
    return jnp.where(real, selected[:num_tokens], -1)


def index_select_blocks_kernel(*args, interpret: bool = False, score_options: dict | None = None,
                               select_options: dict | None = None, **kwargs):
    """`index_select_blocks`' contract (its arguments: write the indexer keys, select) as the two kernels,
    which need the rows' `kv_lens` and `cu_q_lens`; padding tokens (past `cu_q_lens[-1]`) get -1. A
    query's selection depends only on its own scores."""
    call, _ = contract_arguments(index_select_blocks, args, kwargs, tuning=False)
    index_pages = write_index_keys(call.index_pages, call.slot, call.k, call.slot_mapping)
    scores = block_scores_kernel(call.q, index_pages, call.kv_lens, call.page_indices, call.cu_q_lens, slot=call.slot,
                                 block_size=call.block_size, interpret=interpret, **(score_options or {}))
    selected = top_blocks_kernel(scores, call.token_positions, call.cu_q_lens[-1], block_size=call.block_size,
                                 topk_blocks=call.topk_blocks, local_blocks=call.local_blocks, interpret=interpret,
                                 **(select_options or {}))
    return selected, index_pages


def _sparse_attention_kernel(
    slot_ref, seq_ref, positions_ref, table_ref, blocks_ref, counts_ref, q_ref, kv_ref, out_ref, *, per_unit, rows,
    units_per_kv_head, units_per_index_head, num_kv_heads, block_size, tile, page_size, num_pages, dim, sm_scale,
    interpret,
):
    token, unit = pl.program_id(0), pl.program_id(1)
    seq, position = seq_ref[token], positions_ref[token]
    kv_head, index_head = unit // units_per_kv_head, unit // units_per_index_head
    row = jnp.arange(rows, dtype=jnp.int32)
    row_used = row < per_unit
    head = unit * per_unit + jnp.minimum(row, per_unit - 1)
    store_head = store_index(head, row_used, out_ref.shape[1] - 1, interpret)  # a spare head column
    lane, lane_used = lanes(dim)
    q = plt.load(q_ref.at[jnp.full((rows, 1), token, jnp.int32), head[:, None], lane[None, :]],
                 mask=row_used[:, None] & lane_used[None, :], other=0)
    precise = dict(allow_tf32=False) if q.dtype == jnp.float32 else {}
    offsets = jnp.arange(tile, dtype=jnp.int32)
    kv_columns = jnp.full((tile, 1), kv_head, jnp.int32)
    num_selected = counts_ref[token, index_head]  # valid ids come first (sorted ascending)

    def attend_block(i, carry):
        block = blocks_ref[token, index_head, i]
        key_position = block * block_size + offsets
        key_used = (offsets < block_size) & (key_position <= position)
        entry = page_rows(table_ref, seq, key_position, key_used, slot_ref[0], num_pages, page_size)
        mask = key_used[:, None] & lane_used[None, :]
        k = plt.load(kv_ref.at[entry[:, None], kv_columns, lane[None, :]], mask=mask, other=0)
        v = plt.load(kv_ref.at[entry[:, None], kv_columns + num_kv_heads, lane[None, :]], mask=mask, other=0)
        scores = plt.dot(q, k.astype(q.dtype), trans_b=True, **precise) * sm_scale
        scores = jnp.where(key_used[None, :], scores, -jnp.inf)
        return online_softmax_step(carry, scores, lambda p: plt.dot(p.astype(v.dtype), v, **precise))

    carry = jax.lax.fori_loop(0, num_selected, attend_block, online_softmax_init((rows,), lane.shape[0]))
    out, _ = online_softmax_result(carry)
    plt.store(out_ref.at[jnp.full((rows, 1), token, jnp.int32), store_head[:, None], lane[None, :]],
              out.astype(out_ref.dtype), mask=row_used[:, None] & lane_used[None, :])


def sparse_attention_kernel(
    q: Float[Array, "tokens heads dim"],
    kv_pages: Float[Array, "slots pages page_size kv2 dim"],
    page_indices: Int[Array, "seqs max_pages"],
    selected: Int[Array, "tokens index_heads topk"],
    token_seq_ids: Int[Array, " tokens"],
    token_positions: Int[Array, " tokens"],
    *,
    slot: int | Array,
    sm_scale: float,
    block_size: int,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> Float[Array, "tokens heads dim"]:
    """`block_sparse_attention.sparse_attend_paged` for every token as one kernel: the pages already
    hold this step's K/V; each block of `block_size` keys is one tile (padded to a power of two >= 16)."""
    num_tokens, num_heads, dim = q.shape
    num_slots, num_pages, page_size, kv2, kv_dim = kv_pages.shape
    num_kv_heads, num_index_heads = kv2 // 2, selected.shape[1]
    units = max(num_kv_heads, num_index_heads)
    if kv_dim != dim or num_heads % units or units % num_kv_heads or units % num_index_heads:
        raise KernelShapeError(
            f"sparse_attention_kernel: q {q.shape}, kv_pages {kv_pages.shape} and selected {selected.shape} do not "
            f"fit (head dims must match; {num_heads} heads, {num_kv_heads} KV heads and {num_index_heads} indexer "
            "heads must nest)")
    per_unit = num_heads // units
    # Ascending block order (valid ids first, -1 last): the reference's accumulation order.
    blocks = jnp.sort(jnp.where(selected < 0, _NO_BLOCK, selected), axis=-1)
    blocks = jnp.where(blocks == _NO_BLOCK, -1, blocks).astype(jnp.int32)
    kernel = functools.partial(
        _sparse_attention_kernel, per_unit=per_unit, rows=max(16, next_power_of_two(per_unit)),
        units_per_kv_head=units // num_kv_heads, units_per_index_head=units // num_index_heads,
        num_kv_heads=num_kv_heads, block_size=block_size, tile=max(16, next_power_of_two(block_size)),
        page_size=page_size, num_pages=num_pages, dim=dim, sm_scale=float(sm_scale), interpret=bool(interpret))
    out = triton_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_tokens, num_heads + spare_rows(interpret), dim), q.dtype),
        grid=(num_tokens, units), name="block_sparse_attention", num_warps=num_warps, num_stages=num_stages,
        interpret=interpret,
    )(jnp.asarray(slot, jnp.int32).reshape(1), token_seq_ids.astype(jnp.int32), token_positions.astype(jnp.int32),
      page_indices.astype(jnp.int32), blocks, jnp.sum(blocks >= 0, axis=-1, dtype=jnp.int32), q,
      kv_pages.reshape(num_slots * num_pages * page_size, kv2, dim))
    return out[:, :num_heads]


def block_sparse_attention_kernel(*args, interpret: bool = False, **kwargs):
    """`block_sparse_attention`'s contract (write K/V, attend over the selected blocks) with the
    attention as one kernel (`sparse_attention_kernel`, whose tuning keywords it takes). Each token's
    arithmetic depends only on its own query and blocks."""
    return block_sparse_attention(*args, attend=functools.partial(sparse_attention_kernel, interpret=interpret),
                                  **kwargs)
