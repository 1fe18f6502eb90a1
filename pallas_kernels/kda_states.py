"""KDA states saved beside a row's running state: after draft tokens, and at interval checkpoints.

A step writes each row's final state into its running page (`pallas_kernels.kda`). These save more:
the states after a decode row's draft tokens (speculative decoding keeps the one after the last
accepted draft) and the states after chosen tokens inside a prefill chunk (recurrent-state
checkpoints a later prompt resumes from). A saved page holds the recurrent state and the conv tail
of the K-1 inputs up to its token. Pure jnp; it reads a step's inputs and never the pool itself.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kda_recurrence import delta_rule_step, join_state


def tails_after(token_index, rows, old_tails, mixed_qkv, cu_q_lens):
    """The conv tail after token `token_index[s]` of row `rows[s]`: its last K-1 inputs, from the step's
    tokens where the row has them and from the row's tail before the step otherwise. `[S, K-1, C]`."""
    num_tokens, kernel = mixed_qkv.shape[0], old_tails.shape[1] + 1
    x = jnp.asarray(mixed_qkv, jnp.float32)
    local = token_index - cu_q_lens[rows]
    back = local[:, None] - (kernel - 2) + jnp.arange(kernel - 1)[None, :]  # [S, K-1] local index of each entry
    from_batch = x[jnp.clip(cu_q_lens[rows][:, None] + back, 0, num_tokens - 1)]
    from_tail = old_tails[rows[:, None], jnp.clip(kernel - 1 + back, 0, kernel - 2)]
    return jnp.where((back >= 0)[..., None], from_batch, from_tail)


def snapshot_index(save_tokens, save_pages, num_tokens: int, num_pages: int):
    """`[T]`: for each token, the index of the save after it (`len(save_tokens)`: none). A save whose
    page is past the buffer (`>= num_pages`) is no save."""
    none = save_tokens.shape[0]
    tokens = jnp.where(save_pages < num_pages, save_tokens, num_tokens)
    return jnp.full(num_tokens, none, jnp.int32).at[tokens].set(jnp.arange(none, dtype=jnp.int32), mode="drop")


def write_snapshots(state_pages, slot, save_tokens, save_pages, snapshots, old_tails, mixed_qkv, cu_q_lens,
                    token_seq_ids):
    """Write the recurrent `snapshots [S, H, Dk, Dv]` taken after `save_tokens` (with their conv tails)
    into `save_pages` of layer slot `slot`; pages past the buffer write nothing."""
    num_tokens = mixed_qkv.shape[0]
    rows = token_seq_ids[jnp.clip(save_tokens, 0, num_tokens - 1)]
    tails = tails_after(save_tokens, rows, old_tails, mixed_qkv, cu_q_lens)
    return state_pages.at[slot, save_pages].set(join_state(snapshots, tails), mode="drop")


def save_draft_states(state_pages, slot, draft_states, inputs, initial, old_tails, mixed_qkv, cu_q_lens):
    """Speculative decoding: for rows whose tokens are a real token and its draft tokens (all sampled), the
    state after each of them, so that rollback keeps the one after the last accepted draft.

    `draft_states = (token_index [S], rows [S], page_ids [S])`: sample s is token `token_index[s]` of row
    `rows[s]`, and the state after it goes to page `page_ids[s]` (past the buffer: not saved). A saved
    row's samples run in token order from the row's state before this step, one `delta_rule_step` each
    (the batch-invariant path's arithmetic, so the saved states equal the states it reaches there); each
    page gets its recurrent state and the conv tail of the last K-1 inputs up to its token."""
    token_index, rows, page_ids = (jnp.asarray(x, jnp.int32) for x in draft_states)
    q, k, v, g, beta = inputs
    tails = tails_after(token_index, rows, old_tails, mixed_qkv, cu_q_lens)
    num_pages = state_pages.shape[1]

    def save(s, carry):
        states, pages = carry
        row, token = rows[s], token_index[s]

        def step(states, pages):
            state, _ = delta_rule_step(states[row], q[token], k[token], v[token], g[token], beta[token])
            pages = pages.at[slot, page_ids[s]].set(join_state(state, tails[s]))
            return states.at[row].set(state), pages

        return jax.lax.cond(page_ids[s] < num_pages, step, lambda states, pages: (states, pages), states, pages)

    return jax.lax.cond(jnp.any(page_ids < num_pages),
                        lambda pages: jax.lax.fori_loop(0, token_index.shape[0], save, (initial, pages))[1],
                        lambda pages: pages, state_pages)
