"""Token sampling on the device: greedy, temperature, top-k and top-p, seeded per request.

Each row draws with the key `fold_in(PRNGKey(seed), num_generated)`, so a request's samples do
not depend on which other requests share the batch. A per-row token bitmask (structured output)
comes in as an input array: all ones for free rows, so constraining a request never recompiles.
Stop conditions are checked on the host.
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


def sample_tokens(logits: Float[Array, "rows vocab"], meta: SamplingMetadata) -> Int[Array, " rows"]:
    """One token per row: argmax where temperature is 0, else a seeded draw."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(row_logits, temperature, top_k, top_p, seed, count):
        scaled = row_logits / jnp.maximum(temperature, 1e-6)
        filtered = _filter_top_k_top_p(scaled, top_k, top_p)
        key = jax.random.fold_in(jax.random.PRNGKey(seed), count)
        return jax.random.categorical(key, filtered).astype(jnp.int32)

    drawn = jax.vmap(draw)(logits, meta.temperature, meta.top_k, meta.top_p, meta.seeds, meta.num_generated)
    return jnp.where(meta.temperature > 0, drawn, greedy)
