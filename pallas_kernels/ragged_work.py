"""How the Triton-style Pallas kernels cut a ragged batch into work items (a few consecutive query
tokens of one sequence each) and merge the partial results of split-KV programs by their log-sum-exp.
Shared by the attention, indexer, recurrence and MoE kernels; no kernel lives here.
"""
from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def next_power_of_two(value: int) -> int:
    """The smallest power of two >= `value` (1 for values below 2)."""
    return 1 << max(0, int(value) - 1).bit_length()


def work_items(
    cu_q_lens: Int[Array, " seqs_plus_1"], num_tokens: int, tokens_per_item: int
) -> tuple[Int[Array, " items"], Int[Array, " items"], Int[Array, " items"]]:
    """Cut every row's query tokens into items of at most `tokens_per_item`: `(seq, start, count)`.

    The item count is static (`cdiv(num_tokens, tokens_per_item) + seqs`, enough for any split);
    items past the last one have count 0. `start` is a flat token index.
    """
    seqs = cu_q_lens.shape[0] - 1
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    items_per_seq = (q_lens + tokens_per_item - 1) // tokens_per_item
    ends = jnp.cumsum(items_per_seq)
    item = jnp.arange(-(-num_tokens // tokens_per_item) + seqs, dtype=jnp.int32)
    seq = jnp.searchsorted(ends, item, side="right").astype(jnp.int32)
    used = seq < seqs
    seq = jnp.minimum(seq, seqs - 1)
    local = item - (ends[seq] - items_per_seq[seq])
    start = cu_q_lens[seq] + local * tokens_per_item
    count = jnp.where(used, jnp.clip(q_lens[seq] - local * tokens_per_item, 0, tokens_per_item), 0)
    return seq, start.astype(jnp.int32), count.astype(jnp.int32)


def merge_attention_partials(
    outs: Float[Array, "parts tokens heads dim"], lses: Float[Array, "parts tokens heads"]
) -> tuple[Float[Array, "tokens heads dim"], Float[Array, "tokens heads"]]:
    """Combine attention over disjoint key sets from each part's normalised output and LSE.

    The merge a split-KV decode or a decode-context-parallel step needs: float32 out and LSE; a
    part with LSE -inf (no key) weighs nothing, and a token no part saw gets out 0, LSE -inf.
    """
    top = lses.max(axis=0)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weights = jnp.exp(lses - top)
    total = weights.sum(axis=0)
    safe_total = jnp.where(total == 0, 1.0, total)
    out = (weights[..., None] * outs.astype(jnp.float32)).sum(axis=0) / safe_total[..., None]
    lse = jnp.where(total == 0, -jnp.inf, top + jnp.log(safe_total))
    return out, lse


def with_sink_partial(outs: Float[Array, "parts tokens heads dim"], lses: Float[Array, "parts tokens heads"],
                      sinks: Float[Array, " heads"] | None):
    """The partials with each head's sink as one more part (LSE the sink logit, out 0), so a merge
    counts the sink in the denominator; unchanged without sinks."""
    if sinks is None:
        return outs, lses
    _, tokens, heads = lses.shape
    outs = jnp.concatenate([outs, jnp.zeros((1, *outs.shape[1:]), outs.dtype)])
    return outs, jnp.concatenate([lses, jnp.broadcast_to(sinks.astype(jnp.float32), (1, tokens, heads))])


def merge_split_partials(outs, lses, num_tokens: int, cu_q_lens: Int[Array, " seqs_plus_1"], dtype, sinks=None):
    """A split-KV kernel's `[splits, tokens (+ a spare row), heads, ...]` partials as `(out, lse)`: one
    split as it is (without `sinks` to add), more merged by LSE; padding tokens (past `cu_q_lens[-1]`)
    get out 0 and LSE -inf. `out` in `dtype`."""
    outs, lses = outs[:, :num_tokens], lses[:, :num_tokens]
    if outs.shape[0] == 1 and sinks is None:
        out, lse = outs[0], lses[0]
    else:
        out, lse = merge_attention_partials(*with_sink_partial(outs, lses, sinks))
    real = jnp.arange(num_tokens) < cu_q_lens[-1]
    return jnp.where(real[:, None, None], out, 0).astype(dtype), jnp.where(real[:, None], lse, -jnp.inf)
