"""Kimi delta attention (KDA) over a ragged, paged batch: the pure-jnp reference a Pallas kernel must match.

One call runs the sequence-mixing core of one KDA layer for every row of a ragged batch: the causal
short convolution (continuing from the conv tail in the row's state page), SiLU, the q/k l2 norms and
the gated delta rule with per-channel decay; then it writes each row's final state back. It reads and
writes only each row's running state page (`page_indices[g][:, 0]`), never another page, and a row
whose start is 0 begins from a zero state whatever its (recycled) page holds.

State page (float32, `KDAConfig.state_size` values; H heads, D head dim, K conv width, P = H*D):
  [0, H*D*D)               recurrent state S[h, i, j] at h*D*D + i*D + j (i: key channel, j: value channel)
  [H*D*D, H*D*D+(K-1)*3P)  conv tail[m, c] at H*D*D + m*3P + c: projection channel c (q | k | v, before
                           the conv and its activation) of the token K-1-m places before the row's next
                           token (m = 0 is the oldest); zeros before the sequence's first token.

Numerics. "batch_invariant": one token-sequential recurrent update per token for every token, on
`[H, D, D]` shapes that never depend on the batch, so prefill, chunked prefill, resumes and decode give
bitwise the same states. "fast": the chunked parallel form (transformers' chunk_kimi_delta_attention,
with chunks aligned to each row's own first token) for prefill, and one row-parallel recurrent step
when no row has more than one token (decode).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from agentjax.numerics import map_row_blocks
from pallas_kernels import kda_states
from pallas_kernels.kda_recurrence import delta_rule_step, read_states, row_spans, write_states

# Tokens per chunk of the fast prefill form (transformers uses 64). On CPU at Kimi-Linear's shapes 16
# was fastest (the in-chunk [C, C, D] decay tensor grows with C), and it wastes less on each row's last chunk.
CHUNK_SIZE = 16

# l2norm(x) = x / sqrt(sum(x^2) + eps), eps inside the sqrt as in transformers and FLA.
L2NORM_EPS = 1e-6


def ragged_causal_conv(
    x: Float[Array, "T C"],
    weight: Float[Array, "C K"],
    tails: Float[Array, "B Km1 C"],
    cu_q_lens: Int[Array, " B1"],
    token_seq_ids: Int[Array, " T"],
) -> tuple[Float[Array, "T C"], Float[Array, "B Km1 C"]]:
    """Depthwise causal convolution of each row's tokens, continuing from its conv tail: `(y, new_tails)`.

    `y[t, c] = sum_j weight[c, j] * x[t - (K-1) + j, c]`, where a tap before the row's first new token
    reads the row's tail. Per token and channel, in a fixed order of taps (batch-invariant). The new tail
    of a row holds its last K-1 inputs (from the old tail where the row has fewer new tokens).
    """
    num_tokens, _ = x.shape
    kernel = weight.shape[1]
    x, weight, tails = (jnp.asarray(a, jnp.float32) for a in (x, weight, tails))
    local = jnp.arange(num_tokens, dtype=jnp.int32) - cu_q_lens[token_seq_ids]
    shifted = jnp.pad(x, [(kernel - 1, 0), (0, 0)])
    y = None
    for j in range(kernel):
        back = kernel - 1 - j
        tap = shifted[j:j + num_tokens]
        if back:
            source = local - back
            from_tail = tails[token_seq_ids, jnp.clip(source + kernel - 1, 0, kernel - 2)]
            tap = jnp.where((source >= 0)[:, None], tap, from_tail)
        term = tap * weight[:, j]
        y = term if y is None else y + term
    if kernel == 1:
        return y, tails
    lens = cu_q_lens[1:] - cu_q_lens[:-1]
    offsets = jnp.arange(kernel - 1, dtype=jnp.int32)
    source = lens[:, None] - (kernel - 1) + offsets[None, :]  # [B, K-1] local index of each tail entry
    from_batch = x[jnp.clip(cu_q_lens[:-1, None] + source, 0, num_tokens - 1)]
    from_tail = jnp.take_along_axis(tails, jnp.clip(lens[:, None] + offsets[None, :], 0, kernel - 2)[..., None], 1)
    return y, jnp.where((source >= 0)[..., None], from_batch, from_tail)


def recurrent_delta_rule(q, k, v, g, beta, states, token_seq_ids, num_tokens, snapshot_of_token=None,
                         num_snapshots: int = 0):
    """Token-sequential gated delta rule over the first `num_tokens` tokens (in order), each updating
    its row's state: `(out [T, H, Dv], states [B, H, Dk, Dv], snapshots [S, H, Dk, Dv])`. Every token
    runs the same `[H, D, D]` arithmetic whatever the batch holds (the batch-invariant path). With
    `snapshot_of_token` ([T], `num_snapshots` for none) snapshot s is the state after the token marked s."""
    out = jnp.zeros(v.shape, jnp.float32)
    snapshots = jnp.zeros((num_snapshots, *states.shape[1:]), jnp.float32)

    def body(t, carry):
        states, out, snapshots = carry
        row = token_seq_ids[t]
        state, o = delta_rule_step(jax.lax.dynamic_index_in_dim(states, row, keepdims=False), q[t], k[t], v[t], g[t],
                                   beta[t])
        states = jax.lax.dynamic_update_index_in_dim(states, state, row, 0)
        if snapshot_of_token is not None:
            snapshots = snapshots.at[snapshot_of_token[t]].set(state, mode="drop")
        return states, jax.lax.dynamic_update_index_in_dim(out, o, t, 0), snapshots

    states, out, snapshots = jax.lax.fori_loop(0, num_tokens, body, (states, out, snapshots))
    return out, states, snapshots


def decode_delta_rule(q, k, v, g, beta, states, cu_q_lens):
    """One recurrent step for every row at once, for batches whose rows have at most one token."""
    num_tokens = q.shape[0]
    has_token = cu_q_lens[1:] > cu_q_lens[:-1]
    index = jnp.minimum(cu_q_lens[:-1], num_tokens - 1)
    new_states, o = delta_rule_step(states, q[index], k[index], v[index], g[index], beta[index])
    states = jnp.where(has_token[:, None, None, None], new_states, states)
    out = jnp.zeros(v.shape, jnp.float32).at[jnp.where(has_token, index, num_tokens)].set(o, mode="drop")
    return out, states


def unit_lower_solve(strict: Float[Array, "H C C"], rhs: Float[Array, "H C N"]) -> Float[Array, "H C N"]:
    """`X` with `(I + strict) X = rhs` for a strictly lower triangular `strict`, by forward substitution
    row by row (XLA's CPU triangular_solve is ~100x slower at these sizes)."""

    def row(r, solved):
        value = rhs[:, r] - jnp.einsum("hs,hsn->hn", strict[:, r], solved)
        return jax.lax.dynamic_update_index_in_dim(solved, value, r, 1)

    return jax.lax.fori_loop(0, rhs.shape[1], row, jnp.zeros_like(rhs))


def chunk_delta_rule(q, k, v, g, beta, state):
    """The gated delta rule over one chunk of C tokens, in parallel form: `(out [C, H, Dv], state)`.

    Per head, with G the in-chunk cumulative log-decay: M[r, s] = sum_c beta_r k_r[c] k_s[c]
    exp(G_r[c] - G_s[c]) (s < r); (I + M) U = beta v and (I + M) W = beta k exp(G) (forward
    substitution); Vn = U - W S; out = (q exp(G)) S + Aq Vn, Aq[r, s] = sum_c q_r[c] k_s[c]
    exp(G_r[c] - G_s[c]) (s <= r); S' = exp(G_last) S + (k exp(G_last - G))^T Vn. Every exponent is
    <= 0. Padding tokens of a partial chunk must come with k = v = q = g = beta = 0.
    """
    size = q.shape[0]
    q, k, v, g = (x.transpose(1, 0, 2) for x in (q, k, v, g))  # [H, C, D]
    beta = beta.T[..., None]  # [H, C, 1]
    cum = jnp.cumsum(g, axis=1)
    rows = jnp.arange(size)
    causal = rows[:, None] >= rows[None, :]
    diff = cum[:, :, None, :] - cum[:, None, :, :]  # [H, r, s, D]
    decayed_keys = jnp.exp(jnp.where(causal[None, :, :, None], diff, -jnp.inf)) * k[:, None, :, :]  # [H, r, s, D]
    k_beta = k * beta
    # Both score matrices from one decayed-key tensor (a 3-operand einsum is ~50x slower on CPU at C=32).
    scores = jnp.einsum("hxrd,hrsd->hxrs", jnp.stack([k_beta, q], 1), decayed_keys)
    mix = scores[:, 0] * (rows[:, None] > rows[None, :])
    attend = scores[:, 1]
    rhs = jnp.concatenate([v * beta, k_beta * jnp.exp(cum)], axis=-1)
    solved = unit_lower_solve(mix, rhs)
    u, w = solved[..., :v.shape[-1]], solved[..., v.shape[-1]:]
    v_new = u - w @ state
    out = (q * jnp.exp(cum)) @ state + attend @ v_new
    last = cum[:, -1]  # [H, D]
    state = state * jnp.exp(last)[..., None] + jnp.einsum("hcd,hce->hde", k * jnp.exp(last[:, None] - cum), v_new)
    return out.transpose(1, 0, 2), state


def chunked_delta_rule(q, k, v, g, beta, states, cu_q_lens, chunk_size: int = CHUNK_SIZE, snapshot_of_token=None,
                       num_snapshots: int = 0):
    """The chunked form over a ragged batch: each row is cut into chunks from its own first token
    (the last one partial), chunks run in token order, each carrying its row's state. Snapshots as in
    `recurrent_delta_rule`: a chunk holding a marked token runs once more up to that token."""
    num_tokens = q.shape[0]
    lens = cu_q_lens[1:] - cu_q_lens[:-1]
    row_chunks = (lens + chunk_size - 1) // chunk_size
    first_chunk = jnp.cumsum(row_chunks) - row_chunks
    total_chunks = jnp.sum(row_chunks)
    pad = lambda x: jnp.pad(x.astype(jnp.float32), [(0, chunk_size)] + [(0, 0)] * (x.ndim - 1))  # noqa: E731
    q, k, v, g, beta = (pad(x) for x in (q, k, v, g, beta))
    marks = None if snapshot_of_token is None else jnp.pad(snapshot_of_token, (0, chunk_size),
                                                            constant_values=num_snapshots)
    out = jnp.zeros(v.shape, jnp.float32)
    snapshots = jnp.zeros((num_snapshots, *states.shape[1:]), jnp.float32)
    positions = jnp.arange(chunk_size)

    def body(chunk, carry):
        states, out, snapshots = carry
        row = jnp.searchsorted(first_chunk, chunk, side="right") - 1
        start = cu_q_lens[row] + (chunk - first_chunk[row]) * chunk_size
        valid = positions < (cu_q_lens[row + 1] - start)

        def take(x, keep):
            part = jax.lax.dynamic_slice_in_dim(x, start, chunk_size, 0)
            return jnp.where(keep.reshape(-1, *([1] * (x.ndim - 1))), part, 0.0)

        before = jax.lax.dynamic_index_in_dim(states, row, keepdims=False)
        o, state = chunk_delta_rule(*(take(x, valid) for x in (q, k, v, g, beta)), before)
        old = jax.lax.dynamic_slice_in_dim(out, start, chunk_size, 0)
        out = jax.lax.dynamic_update_slice_in_dim(out, jnp.where(valid[:, None, None], o, old), start, 0)
        if marks is not None:
            marked = jnp.where(valid, jax.lax.dynamic_slice_in_dim(marks, start, chunk_size, 0), num_snapshots)

            def snap(p, snapshots):
                def run(snapshots):  # the chunk's tokens up to p only: later ones as padding (zeros)
                    _, partial = chunk_delta_rule(*(take(x, valid & (positions <= p)) for x in (q, k, v, g, beta)),
                                                  before)
                    return snapshots.at[marked[p]].set(partial, mode="drop")

                return jax.lax.cond(marked[p] < num_snapshots, run, lambda s: s, snapshots)

            snapshots = jax.lax.fori_loop(0, chunk_size, snap, snapshots)
        return jax.lax.dynamic_update_index_in_dim(states, state, row, 0), out, snapshots

    states, out, snapshots = jax.lax.fori_loop(0, total_chunks, body, (states, out, snapshots))
    return out[:num_tokens], states, snapshots


def gated_delta_rule(q, k, v, g, beta, states, cu_q_lens, token_seq_ids, *, batch_invariant: bool,
                     chunk_size: int = CHUNK_SIZE, snapshot_of_token=None, num_snapshots: int = 0):
    """The delta rule of a ragged batch: token-sequential when batch-invariant; otherwise one
    row-parallel step for decode batches and the chunked form for anything longer. Returns
    `(out, states, snapshots)` (see `recurrent_delta_rule`; a decode batch marks no token)."""
    num_tokens = cu_q_lens[-1]
    snap = dict(snapshot_of_token=snapshot_of_token, num_snapshots=num_snapshots)
    if batch_invariant:
        return recurrent_delta_rule(q, k, v, g, beta, states, token_seq_ids, num_tokens, **snap)
    lens = cu_q_lens[1:] - cu_q_lens[:-1]
    empty = jnp.zeros((num_snapshots, *states.shape[1:]), jnp.float32)
    return jax.lax.cond(
        jnp.max(lens) <= 1,
        lambda: (*decode_delta_rule(q, k, v, g, beta, states, cu_q_lens), empty),
        lambda: chunked_delta_rule(q, k, v, g, beta, states, cu_q_lens, chunk_size, **snap),
    )


def l2norm(x: Float[Array, "... D"]) -> Float[Array, "... D"]:
    return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


class MixerInputs(NamedTuple):
    """What a KDA step reads besides q, k, v: the int32 row metadata, each row's new token count
    `lens`, its state before the step (`initial`, `old_tails`) and its conv tail after it (`tails`)."""

    cu_q_lens: Array
    kv_lens: Array
    state_page_ids: Array
    token_seq_ids: Array
    lens: Array
    initial: Array
    old_tails: Array
    tails: Array


def mixer_inputs(mixed_qkv, conv_weight, state_pages, cu_q_lens, kv_lens, state_page_ids, token_seq_ids, *, slot,
                 num_heads: int, head_dim: int, batch_invariant: bool):
    """The step's q (normed, scaled), k (normed) and v `[T, H, D]` after the short conv (from each
    row's conv tail in its state page) and SiLU, and the `MixerInputs` around them."""
    num_tokens = mixed_qkv.shape[0]
    width = num_heads * head_dim
    cu_q_lens, kv_lens, state_page_ids, token_seq_ids = (
        jnp.asarray(x, jnp.int32) for x in (cu_q_lens, kv_lens, state_page_ids, token_seq_ids))
    lens, starts = row_spans(cu_q_lens, kv_lens)
    initial, old_tails = read_states(state_pages, slot, state_page_ids, starts, num_heads, head_dim,
                                     conv_weight.shape[1])
    mixed, tails = ragged_causal_conv(mixed_qkv, conv_weight, old_tails, cu_q_lens, token_seq_ids)
    mixed = jax.nn.silu(mixed)
    q, k, v = (mixed[:, i * width:(i + 1) * width].reshape(num_tokens, num_heads, head_dim) for i in range(3))
    if batch_invariant:  # a reduction over D whose order XLA would otherwise pick by row count
        q, k = map_row_blocks(l2norm, q), map_row_blocks(l2norm, k)
    else:
        q, k = l2norm(q), l2norm(k)
    return q * (head_dim ** -0.5), k, v, MixerInputs(cu_q_lens, kv_lens, state_page_ids, token_seq_ids, lens,
                                                    initial, old_tails, tails)


def kimi_delta_attention(
    mixed_qkv: Float[Array, "T C"],
    g: Float[Array, "T H D"],
    beta: Float[Array, "T H"],
    conv_weight: Float[Array, "C K"],
    state_pages: Float[Array, "slots pages size"],
    cu_q_lens: Int[Array, " B1"],
    kv_lens: Int[Array, " B"],
    state_page_ids: Int[Array, " B"],
    *,
    slot: Int[Array, ""] | int,
    token_seq_ids: Int[Array, " T"],
    num_heads: int,
    head_dim: int,
    batch_invariant: bool = False,
    chunk_size: int = CHUNK_SIZE,
    draft_states: tuple | None = None,
    state_saves: tuple | None = None,
) -> tuple[Float[Array, "T H D"], Float[Array, "slots pages size"]]:
    """KDA's sequence mixing for a ragged batch, state in pages: `(out [T, H, D] float32, state_pages)`.

    `mixed_qkv` holds each token's q | k | v projections (C = 3*H*D channels, before the conv),
    `g` the per-channel log-decay (<= 0), `beta` the write strength, `conv_weight [C, K]` the
    depthwise conv (`weight[c, K-1]` multiplies the current token). Row b's tokens are
    `cu_q_lens[b]:cu_q_lens[b+1]`, `kv_lens[b]` its length after this step, `state_page_ids[b]` its
    running state page in layer slot `slot` of `state_pages`. Padding tokens get zeros (their rows
    write nothing). `draft_states` (speculative decoding) saves the states after draft tokens too
    (`kda_states.save_draft_states`). `state_saves = (token_index [S], page_ids [S])` saves the state
    after token `token_index[s]` of its row into page `page_ids[s]` (past the buffer: no save): the
    recurrent-state checkpoints inside a prefill chunk, equal to the state a run that ends there keeps.
    """
    num_tokens = mixed_qkv.shape[0]
    q, k, v, inputs = mixer_inputs(mixed_qkv, conv_weight, state_pages, cu_q_lens, kv_lens, state_page_ids,
                                   token_seq_ids, slot=slot, num_heads=num_heads, head_dim=head_dim,
                                   batch_invariant=batch_invariant)
    cu_q_lens, state_page_ids, token_seq_ids = inputs.cu_q_lens, inputs.state_page_ids, inputs.token_seq_ids
    initial, old_tails = inputs.initial, inputs.old_tails
    g, beta = jnp.asarray(g, jnp.float32), jnp.asarray(beta, jnp.float32)
    snap = {}
    if state_saves is not None:
        save_tokens, save_pages = (jnp.asarray(x, jnp.int32) for x in state_saves)
        snap = dict(snapshot_of_token=kda_states.snapshot_index(save_tokens, save_pages, num_tokens,
                                                                state_pages.shape[1]),
                    num_snapshots=save_tokens.shape[0])
    out, recurrent, snapshots = gated_delta_rule(q, k, v, g, beta, initial, cu_q_lens, token_seq_ids,
                                                 batch_invariant=batch_invariant, chunk_size=chunk_size, **snap)
    valid = (jnp.arange(num_tokens) < cu_q_lens[-1])[:, None, None]
    state_pages = write_states(state_pages, slot, state_page_ids, inputs.lens, recurrent, inputs.tails)
    if state_saves is not None:
        state_pages = kda_states.write_snapshots(state_pages, slot, save_tokens, save_pages, snapshots, old_tails,
                                                 mixed_qkv, cu_q_lens, token_seq_ids)
    if draft_states is not None:
        state_pages = kda_states.save_draft_states(state_pages, slot, draft_states, (q, k, v, g, beta), initial,
                                                   old_tails, mixed_qkv, cu_q_lens)
    return jnp.where(valid, out, 0.0), state_pages
