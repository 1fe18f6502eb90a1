"""Token sampling on the device: greedy, temperature, top-k and top-p, seeded per request; penalties
and log probabilities for the rows that ask.

Each row draws with the key `fold_in(PRNGKey(seed), num_generated)`, so a request's samples do
not depend on which other requests share the batch. A per-row token bitmask (structured output)
comes in as an input array: all ones for free rows, so constraining a request never recompiles.
Penalties follow vLLM's order and formulas (logit bias, then repetition, frequency and presence),
from per-row inputs (`PenaltyInputs`); log probabilities are the chosen token's value, its rank
and the top `MAX_LOGPROBS` (`gather_logprobs`). Stop conditions are checked on the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from agentjax.structured.backend import all_allowed


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling settings, padded to the batch's rows."""

    temperature: np.ndarray  # [B] float32; 0 means greedy
    top_k: np.ndarray  # [B] int32; 0 means off
    top_p: np.ndarray  # [B] float32; 1 means off
    seeds: np.ndarray  # [B] uint32
    num_generated: np.ndarray  # [B] int32: tokens the row has sampled so far
    token_bitmask: np.ndarray  # [B, ceil(vocab / 32)] int32: bit t of a row set = token t allowed

    @staticmethod
    def greedy(num_rows: int, vocab_size: int) -> "SamplingMetadata":
        return SamplingMetadata(
            temperature=np.zeros(num_rows, np.float32),
            top_k=np.zeros(num_rows, np.int32),
            top_p=np.ones(num_rows, np.float32),
            seeds=np.zeros(num_rows, np.uint32),
            num_generated=np.zeros(num_rows, np.int32),
            token_bitmask=all_allowed(num_rows, vocab_size),
        )


def apply_token_bitmask(
    logits: Float[Array, "rows vocab"], bitmask: Int[Array, "rows words"]
) -> Float[Array, "rows vocab"]:
    """Disallowed tokens get -inf; a row of all ones leaves its logits bit-identical."""
    token = jnp.arange(logits.shape[-1], dtype=jnp.int32)
    words = jnp.take(bitmask, token // 32, axis=1)
    allowed = ((words >> (token % 32)) & 1).astype(bool)
    return jnp.where(allowed, logits, -jnp.inf)


def _filter_top_k_top_p(logits: Float[Array, " vocab"], top_k: Array, top_p: Array) -> Float[Array, " vocab"]:
    sorted_desc = jnp.sort(logits)[::-1]
    vocab = logits.shape[0]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth_value = sorted_desc[k - 1]
    logits = jnp.where(logits < kth_value, -jnp.inf, logits)
    sorted_desc = jnp.where(jnp.arange(vocab) < k, sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(sorted_desc)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    mass_before = jnp.cumsum(probs) - probs
    cutoff_index = jnp.maximum(jnp.sum(mass_before < top_p) - 1, 0)
    cutoff_value = sorted_desc[cutoff_index]
    return jnp.where(logits < cutoff_value, -jnp.inf, logits)


def sample_tokens_and_logits(logits: Float[Array, "rows vocab"], meta: SamplingMetadata
                             ) -> tuple[Int[Array, " rows"], Float[Array, "rows vocab"]]:
    """One token per row (argmax where temperature is 0, else a seeded draw) and the logits it was
    chosen from: scaled by the temperature and cut by top-k/top-p for drawn rows, as given for greedy
    rows (vLLM's "processed" logits)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(row_logits, temperature, top_k, top_p, seed, count):
        scaled = row_logits / jnp.maximum(temperature, 1e-6)
        filtered = _filter_top_k_top_p(scaled, top_k, top_p)
        key = jax.random.fold_in(jax.random.PRNGKey(seed), count)
        return jax.random.categorical(key, filtered).astype(jnp.int32), filtered

    drawn, filtered = jax.vmap(draw)(logits, meta.temperature, meta.top_k, meta.top_p, meta.seeds,
                                     meta.num_generated)
    sampled = meta.temperature > 0
    return jnp.where(sampled, drawn, greedy), jnp.where(sampled[:, None], filtered, logits)


def sample_tokens(logits: Float[Array, "rows vocab"], meta: SamplingMetadata) -> Int[Array, " rows"]:
    """One token per row: argmax where temperature is 0, else a seeded draw."""
    return sample_tokens_and_logits(logits, meta)[0]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PenaltyInputs:
    """Per-row penalties and, padded to `[B, K]`, the tokens they touch (padding entries: token 0 with
    no count, not seen, no bias). Rows without penalties hold 0, 0, 1 and no entries."""

    presence: np.ndarray  # [B] float32
    frequency: np.ndarray  # [B] float32
    repetition: np.ndarray  # [B] float32; 1 means off
    token_ids: np.ndarray  # [B, K] int32
    output_counts: np.ndarray  # [B, K] int32: how often the row generated the token
    seen: np.ndarray  # [B, K] int32: 1 if the token is in the row's prompt or output (repetition)
    bias: np.ndarray  # [B, K] float32: logit bias


def apply_penalties(logits: Float[Array, "rows vocab"], inputs: PenaltyInputs) -> Float[Array, "rows vocab"]:
    """vLLM's order and formulas: add the logit bias; divide positive (multiply negative) logits of
    tokens seen in the prompt or output by the repetition penalty; subtract frequency x count and
    presence x (count > 0) for output tokens. A row with no penalties keeps its logits' values."""
    rows = jnp.arange(logits.shape[0])[:, None]
    bias = jnp.zeros(logits.shape, logits.dtype).at[rows, inputs.token_ids].add(inputs.bias)
    counts = jnp.zeros(logits.shape, jnp.int32).at[rows, inputs.token_ids].add(inputs.output_counts)
    seen = jnp.zeros(logits.shape, jnp.int32).at[rows, inputs.token_ids].max(inputs.seen) > 0
    logits = logits + bias
    scale = jnp.where(seen, inputs.repetition[:, None], 1.0).astype(logits.dtype)
    logits = jnp.where(logits > 0, logits / scale, logits * scale)
    logits = logits - inputs.frequency[:, None] * counts.astype(logits.dtype)
    return logits - inputs.presence[:, None] * (counts > 0).astype(logits.dtype)


def log_probabilities(logits: Float[Array, "rows vocab"], as_logprobs: bool = True) -> Float[Array, "rows vocab"]:
    """Float32 log-softmax of each row (or the float32 logits themselves, for the `*_logits` modes)."""
    logits = logits.astype(jnp.float32)
    return jax.nn.log_softmax(logits, axis=-1) if as_logprobs else logits


def gather_logprobs(values: Float[Array, "rows vocab"], token_ids: Int[Array, " rows"], num_top: int
                    ) -> tuple[Array, Array, Array, Array]:
    """(value of each row's token [rows], its rank [rows] (1 + how many tokens beat it), the `num_top`
    best token ids [rows, num_top] and their values [rows, num_top], best first)."""
    chosen = jnp.take_along_axis(values, token_ids[:, None].astype(jnp.int32), axis=1)[:, 0]
    ranks = jnp.sum(values > chosen[:, None], axis=1).astype(jnp.int32) + 1
    top_values, top_ids = jax.lax.top_k(values, min(num_top, values.shape[-1]))
    return chosen, ranks, top_ids.astype(jnp.int32), top_values
