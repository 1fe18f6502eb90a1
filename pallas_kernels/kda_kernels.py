"""Kimi delta attention's gated delta rule as Triton-style Pallas kernels over the state pages.

The kernels match `pallas_kernels.kda.kimi_delta_attention` in "fast" numerics: the short conv,
SiLU and the q/k l2 norms stay in jnp (elementwise, cheap), the recurrence runs in a kernel that
reads each row's recurrent state straight from its state page and writes the new state back in
place (the page buffer is aliased), and the conv tail is then written by jnp. Two kernels, both one
program per (row, head, block of value channels), the state block `[D, value_block]` in registers:
  * `delta_rule_decode_kernel`: one token per row (decode), the recurrent step, no matmul;
  * `delta_rule_chunk_kernel`: any number of tokens per row (prefill chunks beside decodes), the
    chunked form (chunks of 16 from each row's own first token: in-chunk decayed key products by
    exact pairwise log-decay differences, a forward substitution for (I + M)^-1, then matmuls).
Batch-invariant numerics keep the reference (token-sequential by contract). Pallas' Triton backend
on a GPU; interpret mode on a CPU (the CPU runner never uses these kernels).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from agentjax.errors import KernelShapeError
from pallas_kernels import kda, kda_states
from pallas_kernels.ragged_work import next_power_of_two
from pallas_kernels.triton_call import contract_arguments, lanes, spare_rows, triton_call

# Tokens per chunk of the chunked kernel: the smallest dot a Triton kernel takes.
KERNEL_CHUNK = 16


def _state_tile(head, dim, key_lane, value_lane):
    """Flat offsets of state entries S[head, i, j] (i: key channel, j: value channel) in a page."""
    return head * dim * dim + key_lane[:, None] * dim + value_lane[None, :]


def _row_program(slot_ref, cu_q_lens_ref, kv_lens_ref, page_ids_ref, pages_ref, *, dim, value_block, num_pages,
                 key_lanes_at_least):
    """This program's row, head and block of value channels, and its state block read from the row's page
    (zeros for a row that starts at 0 or holds no token)."""
    row, head, value_tile = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    first, end = cu_q_lens_ref[row], cu_q_lens_ref[row + 1]
    has_token = end > first
    resumes = kv_lens_ref[row] - (end - first) > 0
    page = slot_ref[0] * num_pages + page_ids_ref[row]
    key_lane, key_used = lanes(dim, minimum=key_lanes_at_least)
    value_lane = value_tile * value_block + jnp.arange(value_block, dtype=jnp.int32)
    value_used = value_lane < dim
    tile_used = key_used[:, None] & value_used[None, :]
    tile = _state_tile(head, dim, key_lane, value_lane)
    state = plt.load(pages_ref.at[page, tile], mask=tile_used & has_token & resumes, other=0.0)
    return _RowProgram(head, first, end, has_token, page, key_lane, key_used, value_lane, value_used, tile,
                       tile_used, state)


class _RowProgram(NamedTuple):
    head: Array
    first: Array
    end: Array
    has_token: Array
    page: Array
    key_lane: Array
    key_used: Array
    value_lane: Array
    value_used: Array
    tile: Array
    tile_used: Array
    state: Array


def _decode_kernel(slot_ref, cu_q_lens_ref, kv_lens_ref, page_ids_ref, q_ref, k_ref, v_ref, g_ref, beta_ref,
                   pages_in_ref, out_ref, pages_ref, *, dim, value_block, num_pages):
    del pages_in_ref  # aliased with pages_ref
    (head, first, _, has_token, page, key_lane, key_used, value_lane, value_used, tile, tile_used,
     state) = _row_program(slot_ref, cu_q_lens_ref, kv_lens_ref, page_ids_ref, pages_ref, dim=dim,
                           value_block=value_block, num_pages=num_pages, key_lanes_at_least=1)
    token = jnp.where(has_token, first, out_ref.shape[0] - 1)  # a row without a token stores nothing

    def vector(ref, lane, used):
        return plt.load(ref.at[token, head, lane], mask=used & has_token, other=0.0).astype(jnp.float32)

    q, k, g = (vector(ref, key_lane, key_used) for ref in (q_ref, k_ref, g_ref))
    v = vector(v_ref, value_lane, value_used)
    beta = plt.load(beta_ref.at[token, head], mask=has_token, other=0.0).astype(jnp.float32)
    decay = jnp.exp(g)
    read_k = jnp.sum(state * (decay * k)[:, None], axis=0)
    read_q = jnp.sum(state * (decay * q)[:, None], axis=0)
    delta = (v - read_k) * beta
    out = read_q + jnp.sum(k * q) * delta
    state = state * decay[:, None] + k[:, None] * delta[None, :]
    plt.store(out_ref.at[token, head, value_lane], out, mask=value_used & has_token)
    plt.store(pages_ref.at[page, tile], state, mask=tile_used & has_token)


def _chunk_kernel(slot_ref, cu_q_lens_ref, kv_lens_ref, page_ids_ref, q_ref, k_ref, v_ref, g_ref, beta_ref,
                  pages_in_ref, out_ref, pages_ref, *, dim, value_block, chunk, num_pages):
    del pages_in_ref  # aliased with pages_ref
    (head, first, end, has_token, page, key_lane, key_used, value_lane, value_used, tile, tile_used,
     state) = _row_program(slot_ref, cu_q_lens_ref, kv_lens_ref, page_ids_ref, pages_ref, dim=dim,
                           value_block=value_block, num_pages=num_pages, key_lanes_at_least=16)

    position = jnp.arange(chunk, dtype=jnp.int32)
    later = position[:, None] > position[None, :]  # [r, s]: s strictly before r
    precise = dict(allow_tf32=False)

    def pick_row(x, r):  # row r of a register tile, exactly (adds zeros)
        return jnp.sum(jnp.where(position[:, None] == r, x, 0.0), axis=0)

    def chunk_step(index, state):
        token = first + index * chunk + position
        used = token < end
        load_token = jnp.where(used, token, out_ref.shape[0] - 1)  # spare (interpret) or masked

        def tile_of(ref, lane, lane_used):
            return plt.load(ref.at[load_token[:, None], head, lane[None, :]], mask=used[:, None] & lane_used[None, :],
                            other=0.0).astype(jnp.float32)

        q, k, g = (tile_of(ref, key_lane, key_used) for ref in (q_ref, k_ref, g_ref))
        v = tile_of(v_ref, value_lane, value_used)
        beta = plt.load(beta_ref.at[load_token, head], mask=used, other=0.0).astype(jnp.float32)
        cum = jnp.cumsum(g, axis=0)  # in-chunk cumulative log-decay; padding tokens add 0

        # Column s of M[r, s] = beta_r sum_c k_r k_s exp(G_r - G_s) and of A[r, s] = sum_c q_r k_s exp(G_r - G_s),
        # from exact differences of log-decays (exp <= 1 where used; clamped where masked).
        def column(s, carry):
            mix, attend = carry
            decayed = jnp.exp(jnp.minimum(cum - pick_row(cum, s)[None, :], 0.0)) * pick_row(k, s)[None, :]
            here = position[None, :] == s
            mix = jnp.where(here, (jnp.sum(k * decayed, axis=1) * beta)[:, None], mix)
            attend = jnp.where(here, jnp.sum(q * decayed, axis=1)[:, None], attend)
            return mix, attend

        zeros = jnp.zeros((chunk, chunk), jnp.float32)
        mix, attend = jax.lax.fori_loop(0, chunk, column, (zeros, zeros))
        mix = jnp.where(later, mix, 0.0)
        attend = jnp.where(later | (position[:, None] == position[None, :]), attend, 0.0)

        # (I + mix) [U | W] = [beta v | beta k exp(G)] by forward substitution, row by row.
        def substitute(r, solved):
            u, w = solved
            weights, strength = pick_row(mix, r)[:, None], pick_row(beta[:, None], r)
            here = position[:, None] == r
            u = jnp.where(here, (pick_row(v, r) * strength - jnp.sum(weights * u, axis=0))[None, :], u)
            w = jnp.where(here, (pick_row(k * jnp.exp(cum), r) * strength - jnp.sum(weights * w, axis=0))[None, :], w)
            return u, w

        u, w = jax.lax.fori_loop(0, chunk, substitute, (jnp.zeros_like(v), jnp.zeros_like(k)))
        v_new = u - plt.dot(w, state, **precise)
        out = plt.dot(q * jnp.exp(cum), state, **precise) + plt.dot(attend, v_new, **precise)
        last = pick_row(cum, chunk - 1)
        state = state * jnp.exp(last)[:, None] + plt.dot(k * jnp.exp(last[None, :] - cum), v_new, trans_a=True,
                                                         **precise)
        plt.store(out_ref.at[load_token[:, None], head, value_lane[None, :]], out,
                  mask=used[:, None] & value_used[None, :])
        return state

    state = jax.lax.fori_loop(0, (end - first + chunk - 1) // chunk, chunk_step, state)
    plt.store(pages_ref.at[page, tile], state, mask=tile_used & has_token)


def delta_rule_kernel(
    q: Float[Array, "T H D"],
    k: Float[Array, "T H D"],
    v: Float[Array, "T H D"],
    g: Float[Array, "T H D"],
    beta: Float[Array, "T H"],
    state_pages: Float[Array, "slots pages size"],
    cu_q_lens: Int[Array, " B1"],
    kv_lens: Int[Array, " B"],
    state_page_ids: Int[Array, " B"],
    *,
    slot: Int[Array, ""] | int,
    decode: bool,
    value_block: int | None = None,
    num_warps: int = 4,
    num_stages: int = 1,
    interpret: bool = False,
) -> tuple[Float[Array, "T H D"], Float[Array, "slots pages size"]]:
    """The gated delta rule of a ragged batch, each row's recurrent state read from and written to
    its state page (the first `H*D*D` floats; the rest of the page is untouched): `(out, state_pages)`.

    q, k are normed (q scaled), g <= 0 the log-decay. `decode=True` runs the one-token-per-row step
    (every row must hold at most one token); otherwise the chunked kernel. A row whose start is 0
    begins from a zero state. `value_block` value channels per program (a power of two; default
    min(D, 64), at least 16 for the chunked kernel). Padding tokens get zeros."""
    num_tokens, num_heads, dim = q.shape
    num_slots, num_pages, size = state_pages.shape
    if size < num_heads * dim * dim or v.shape != q.shape:
        raise KernelShapeError(f"delta_rule_kernel: q {q.shape}, v {v.shape} and state pages {state_pages.shape} "
                               f"do not fit (a page holds at least {num_heads * dim * dim} floats)")
    if value_block is None:
        value_block = min(next_power_of_two(dim), 64)
    if not decode:
        value_block = max(value_block, 16)
    if value_block != next_power_of_two(value_block):
        raise KernelShapeError(f"delta_rule_kernel: value_block={value_block} must be a power of two")
    num_seqs = kv_lens.shape[0]
    options = dict(dim=dim, value_block=value_block, num_pages=num_pages)
    kernel = (functools.partial(_decode_kernel, **options) if decode
              else functools.partial(_chunk_kernel, chunk=KERNEL_CHUNK, **options))
    spare = spare_rows(interpret)
    pad = lambda x: jnp.pad(x, [(0, spare)] + [(0, 0)] * (x.ndim - 1)) if spare else x  # noqa: E731
    out, pages = triton_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((num_tokens + spare, num_heads, dim), jnp.float32),
                   jax.ShapeDtypeStruct((num_slots * num_pages, size), jnp.float32)),
        grid=(num_seqs, num_heads, pl.cdiv(dim, value_block)), name="kda_decode_step" if decode else "kda_chunk_scan",
        num_warps=num_warps, num_stages=num_stages, interpret=interpret, input_output_aliases={9: 1},
    )(
        jnp.asarray(slot, jnp.int32).reshape(1), cu_q_lens.astype(jnp.int32), kv_lens.astype(jnp.int32),
        state_page_ids.astype(jnp.int32), *(pad(x.astype(jnp.float32)) for x in (q, k, v, g, beta)),
        state_pages.reshape(num_slots * num_pages, size),
    )
    valid = (jnp.arange(num_tokens) < cu_q_lens[-1])[:, None, None]
    return jnp.where(valid, out[:num_tokens], 0.0), pages.reshape(state_pages.shape)


def kimi_delta_attention_kernel(*args, interpret: bool = False, **kwargs):
    """`kda.kimi_delta_attention`'s contract (its arguments) with the delta rule in the kernels: the
    decode step when no row holds more than one token, the chunked kernel otherwise (chosen at run
    time). In batch-invariant numerics the reference runs (token-sequential by contract), and so does a
    step that saves states inside a chunk (`state_saves`: the kernels keep only each row's last state).
    Other keywords tune `delta_rule_kernel`."""
    call, options = contract_arguments(kda.kimi_delta_attention, args, kwargs)
    operands = (call.mixed_qkv, call.g, call.beta, call.conv_weight, call.state_pages, call.cu_q_lens, call.kv_lens,
                call.state_page_ids)
    shared = dict(slot=call.slot, token_seq_ids=call.token_seq_ids, num_heads=call.num_heads, head_dim=call.head_dim,
                  chunk_size=call.chunk_size, draft_states=call.draft_states)
    reference = functools.partial(kda.kimi_delta_attention, **shared)
    if call.batch_invariant:
        return reference(*operands, batch_invariant=True, state_saves=call.state_saves)
    if call.state_saves is not None:
        kernel_run = functools.partial(kimi_delta_attention_kernel, **shared, interpret=interpret, **options)
        saving = jnp.any(jnp.asarray(call.state_saves[1]) < call.state_pages.shape[1])
        return jax.lax.cond(saving, lambda *a: reference(*a, state_saves=call.state_saves), kernel_run, *operands)
    slot, num_heads, head_dim = call.slot, call.num_heads, call.head_dim
    q, k, v, inputs = kda.mixer_inputs(call.mixed_qkv, call.conv_weight, call.state_pages, call.cu_q_lens,
                                       call.kv_lens, call.state_page_ids, call.token_seq_ids, slot=slot,
                                       num_heads=num_heads, head_dim=head_dim, batch_invariant=False)
    g, beta = jnp.asarray(call.g, jnp.float32), jnp.asarray(call.beta, jnp.float32)
    run = functools.partial(delta_rule_kernel, slot=slot, interpret=interpret, **options)
    args = (q, k, v, g, beta, call.state_pages, inputs.cu_q_lens, inputs.kv_lens, inputs.state_page_ids)
    out, state_pages = jax.lax.cond(jnp.max(inputs.lens) <= 1, functools.partial(run, decode=True),
                                    functools.partial(run, decode=False), *args)
    recurrent = num_heads * head_dim * head_dim
    rows = jnp.where(inputs.lens > 0, inputs.state_page_ids, state_pages.shape[1])
    state_pages = state_pages.at[slot, rows, recurrent:].set(inputs.tails.reshape(inputs.tails.shape[0], -1),
                                                              mode="drop")
    if call.draft_states is not None:
        state_pages = kda_states.save_draft_states(state_pages, slot, call.draft_states, (q, k, v, g, beta),
                                                   inputs.initial, inputs.old_tails, call.mixed_qkv, inputs.cu_q_lens)
    return out, state_pages
