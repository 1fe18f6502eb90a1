"""One KDA recurrent state: its page format (the recurrent state and the conv tail in one float32 page, laid
out as pallas_kernels/kda.py's docstring draws it), reading and writing rows' pages, and the one-token gated
delta rule that advances it. Shared by the reference op (kda.py), the state saves (kda_states.py) and the
kernels (kda_kernels.py). Pure jnp.
"""
from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def state_size(num_heads: int, head_dim: int, conv_kernel_size: int) -> int:
    """Floats in one state page: the recurrent state then the conv tail (see the module docstring)."""
    return num_heads * head_dim * head_dim + 3 * num_heads * head_dim * (conv_kernel_size - 1)


def split_state(flat: Float[Array, "... size"], num_heads: int, head_dim: int, conv_kernel_size: int):
    """A flat state (`[..., state_size]`) as `(recurrent [..., H, D, D], conv_tail [..., K-1, 3*H*D])`."""
    lead = flat.shape[:-1]
    split = num_heads * head_dim * head_dim
    recurrent = flat[..., :split].reshape(*lead, num_heads, head_dim, head_dim)
    tail = flat[..., split:].reshape(*lead, conv_kernel_size - 1, 3 * num_heads * head_dim)
    return recurrent, tail


def join_state(recurrent: Float[Array, "... H D D"], tail: Float[Array, "... Km1 C"]) -> Float[Array, "... size"]:
    """The inverse of `split_state`."""
    lead = recurrent.shape[:-3]
    return jnp.concatenate([recurrent.reshape(*lead, -1), tail.reshape(*lead, -1)], axis=-1).astype(jnp.float32)


def row_spans(cu_q_lens: Int[Array, " B1"], kv_lens: Int[Array, " B"]) -> tuple[Array, Array]:
    """`(new tokens, start)` of each row; start = tokens computed before this step."""
    lens = cu_q_lens[1:] - cu_q_lens[:-1]
    return lens, kv_lens - lens


def read_states(state_pages, slot, state_page_ids, starts, num_heads: int, head_dim: int, conv_kernel_size: int):
    """Each row's `(recurrent, conv_tail)` from its state page in layer slot `slot`; zeros where start is 0."""
    flat = state_pages[slot, state_page_ids]
    flat = jnp.where((starts > 0)[:, None], flat, 0.0)
    return split_state(flat, num_heads, head_dim, conv_kernel_size)


def write_states(state_pages, slot, state_page_ids, lens, recurrent, tail):
    """Write each row's state into its page; rows without tokens (padding) write nothing."""
    pages = jnp.where(lens > 0, state_page_ids, state_pages.shape[1])
    return state_pages.at[slot, pages].set(join_state(recurrent, tail), mode="drop")


def delta_rule_step(state, q, k, v, g, beta):
    """One token of the gated delta rule (any leading batch dims): decay, delta write, read.

    `state [..., H, Dk, Dv]`, `q, k, g [..., H, Dk]`, `v [..., H, Dv]`, `beta [..., H]`; q already
    normalised and scaled. Returns `(state, out [..., H, Dv])`. transformers' recurrence
    `S = exp(g) S; S += k ((v - S^T k) beta)^T; o = S^T q`, read in one pass over the old state:
    with a = exp(g), `S^T k = S_old^T (a k)` and `o = S_old^T (a q) + (k . q) delta`.
    """
    decay = jnp.exp(g)
    read = jnp.einsum("...ij,...ci->...cj", state, jnp.stack([decay * k, decay * q], -2))
    delta = (v - read[..., 0, :]) * beta[..., None]
    out = read[..., 1, :] + jnp.sum(k * q, axis=-1, keepdims=True) * delta
    return state * decay[..., None] + k[..., None] * delta[..., None, :], out
