"""Ragged paged attention: the pure-jnp reference that the future Pallas kernel must match.

One call serves a ragged batch of sequences, each with some new query tokens (a prefill chunk or
one decode token) over KV that lives in fixed-size pages. It first writes the new K/V into their
pages, then attends causally (optionally inside a sliding window). The reference streams over KV
pages with an online softmax, so it never materialises a full query-by-key score matrix, and the
per-token arithmetic does not depend on which other tokens share the batch.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

# Rows per block in batch-invariant mode: every block has the same shape whatever the batch,
# so XLA emits the same arithmetic for each row. Measured on XLA's CPU backend for 8..64.
INVARIANT_ROW_BLOCK = 8

# Query tokens per block in the fast path: a block inside one sequence shares its page gathers.
FAST_QUERY_BLOCK = 64

# Finite stand-in for -inf in the running max: a fully masked block then leaves the
# accumulators exactly unchanged (exp(-inf - finite) == 0, exp(0) == 1) instead of making NaN.
_NEG_LARGE = -1e30


def map_row_blocks(fn, *arrays: Array, block: int = INVARIANT_ROW_BLOCK) -> Array:
    """`fn(*arrays)` computed over fixed blocks of `block` leading rows (zero-padded), in order."""
    rows = arrays[0].shape[0]
    pad = (-rows) % block

    def blocked(x):
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(-1, block, *x.shape[1:])

    out = jax.lax.map(lambda xs: fn(*xs), tuple(blocked(x) for x in arrays))
    return out.reshape(-1, *out.shape[2:])[:rows]


def write_kv(
    kv_pages: Float[Array, "layers pages page_size kv2 dim"],
    layer: int,
    k: Float[Array, "tokens kv_heads dim"],
    v: Float[Array, "tokens kv_heads dim"],
    slot_mapping: Int[Array, " tokens"],
) -> Float[Array, "layers pages page_size kv2 dim"]:
    """Scatter one layer's new keys and values into their slots (`page * page_size + offset`).

    The whole multi-layer buffer goes in and out, so a donated buffer is updated in place.
    Padding tokens carry slots of the null page 0, which nothing reads.
    """
    num_layers, num_pages, page_size, kv2, dim = kv_pages.shape
    flat = kv_pages.reshape(num_layers, num_pages * page_size, kv2, dim)
    new = jnp.concatenate([k, v], axis=1).astype(kv_pages.dtype)
    flat = flat.at[layer, slot_mapping].set(new, mode="drop")
    return flat.reshape(num_layers, num_pages, page_size, kv2, dim)


def attend_paged(
    q: Float[Array, "tokens heads dim"],
    kv_pages: Float[Array, "layers pages page_size kv2 dim"],
    layer: int,
    token_page_table: Int[Array, "tokens max_pages"] | Int[Array, " max_pages"],
    token_positions: Int[Array, " tokens"],
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    pages_per_block: int = 4,
) -> Float[Array, "tokens heads dim"]:
    """Causal attention of each query token over its own sequence's pages.

    `token_page_table[t]` is the page table of token t's sequence (padded with page 0) and
    `token_positions[t]` its position; key j is visible when `j <= pos` and, with a window W,
    `j > pos - W`. Streams `pages_per_block` pages per iteration with an online softmax. A 1-D
    `token_page_table` is one table shared by every token (tokens of one sequence): its pages
    are then gathered once, not once per token.
    """
    shared = token_page_table.ndim == 1
    num_tokens, num_heads, dim = q.shape
    _, _, page_size, kv2, _ = kv_pages.shape
    num_kv_heads = kv2 // 2
    group = num_heads // num_kv_heads
    max_pages = token_page_table.shape[-1]
    pages_per_block = max(1, min(pages_per_block, max_pages))
    pad = (-max_pages) % pages_per_block
    if pad:
        token_page_table = jnp.pad(token_page_table, [(0, 0)] * (token_page_table.ndim - 1) + [(0, pad)])
    num_blocks = token_page_table.shape[-1] // pages_per_block
    block_tokens = pages_per_block * page_size

    qg = (q.astype(jnp.float32) * sm_scale).reshape(num_tokens, num_kv_heads, group, dim)
    offsets = jnp.arange(block_tokens, dtype=jnp.int32)

    # Blocks past the furthest query position are fully masked for every token here: skip them
    # (an exact no-op either way), so padded page tables and causal tails cost nothing.
    last_position = token_positions.max()

    def body(block, carry):
        return jax.lax.cond(block * block_tokens <= last_position, attend_block, lambda _, c: c, block, carry)

    def attend_block(block, carry):
        m, denom, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(token_page_table, block * pages_per_block, pages_per_block, -1)
        if shared:
            kv = kv_pages[layer, pages].reshape(1, block_tokens, kv2, dim).astype(jnp.float32)
        else:
            kv = kv_pages[layer, pages].reshape(num_tokens, block_tokens, kv2, dim).astype(jnp.float32)
        k, v = kv[:, :, :num_kv_heads], kv[:, :, num_kv_heads:]
        key_pos = block * block_tokens + offsets
        visible = key_pos[None, :] <= token_positions[:, None]
        if sliding_window is not None:
            visible &= key_pos[None, :] > (token_positions[:, None] - sliding_window)
        scores = jnp.einsum("thgd,ushd->thgs", qg, k) if shared else jnp.einsum("thgd,tshd->thgs", qg, k)
        scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
        m_new = jnp.maximum(m, scores.max(axis=-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(scores - m_new[..., None])
        denom = denom * alpha + p.sum(axis=-1)
        update = jnp.einsum("thgs,ushd->thgd", p, v) if shared else jnp.einsum("thgs,tshd->thgd", p, v)
        acc = acc * alpha[..., None] + update
        return m_new, denom, acc

    init = (
        jnp.full((num_tokens, num_kv_heads, group), _NEG_LARGE, jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group), jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group, dim), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    # Padding tokens see no key at all; keep them finite.
    out = acc / jnp.where(denom == 0, 1.0, denom)[..., None]
    return out.reshape(num_tokens, num_heads, dim).astype(q.dtype)


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
    layer: int,
    token_seq_ids: Int[Array, " tokens"],
    token_positions: Int[Array, " tokens"],
    slot_mapping: Int[Array, " tokens"],
    sm_scale: float,
    sliding_window: int | None = None,
    batch_invariant: bool = False,
) -> tuple[Float[Array, "tokens heads dim"], Float[Array, "layers pages page_size kv2 dim"]]:
    """Write this step's K/V into layer `layer`'s pages, then attend: `(out, kv_pages)`.

    The leading arguments follow the ragged paged attention convention of the JAX serving
    engines. `kv_lens[b]` counts sequence b's KV after this step; its query tokens are
    `q[cu_q_lens[b]:cu_q_lens[b+1]]`. `distribution` (decode, prefill, mixed sequence ends) is
    accepted for kernel compatibility and unused by the reference. The per-token metadata
    (`token_seq_ids`, `token_positions`, `slot_mapping`) is derived from those arrays on the host,
    where it is cheap, and passed in so the device never recomputes it.
    """
    del kv_lens, cu_q_lens, distribution  # encoded in the per-token metadata
    kv_pages = write_kv(kv_pages, layer, k, v, slot_mapping)

    def attend(q_rows, table_rows, position_rows):
        return attend_paged(
            q_rows, kv_pages, layer, table_rows, position_rows, sm_scale=sm_scale, sliding_window=sliding_window
        )

    token_tables = page_indices[token_seq_ids]
    if batch_invariant:
        return map_row_blocks(attend, q, token_tables, token_positions), kv_pages

    def attend_query_block(q_rows, table_rows, position_rows, seq_rows):
        # A block of one sequence's tokens (a prefill chunk) gathers its pages once.
        return jax.lax.cond(
            jnp.all(seq_rows == seq_rows[0]),
            lambda: attend(q_rows, table_rows[0], position_rows),
            lambda: attend(q_rows, table_rows, position_rows),
        )

    block = min(FAST_QUERY_BLOCK, q.shape[0])
    out = map_row_blocks(attend_query_block, q, token_tables, token_positions, token_seq_ids, block=block)
    return out, kv_pages
