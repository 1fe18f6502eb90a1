"""Jitted step functions: one forward over a ragged batch, with the KV pages donated.

`make_step(cfg)` gives `(params, kv_pages, batch) -> (logits, kv_pages)` for experiments;
`make_sampling_step(cfg)` adds the sampler and returns tokens instead, which is what the engine
runs. `nnx.merge` happens inside the traced function, so the graph is split once.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from agentjax.config import ModelConfig
from agentjax.models.params import split_model
from agentjax.runner.batch import RaggedBatch
from agentjax.runner.sampler import SamplingMetadata, apply_token_bitmask, sample_tokens


def make_forward(cfg: ModelConfig, numerics: str = "fast") -> Callable:
    """Pure (unjitted) `(params, kv_pages, batch) -> (hidden of every token, kv_pages)`."""
    graphdef, _ = split_model(cfg)

    def forward(params: nnx.State, kv_pages: jax.Array, batch: RaggedBatch):
        model = nnx.merge(graphdef, params)
        return model(kv_pages, batch, numerics)

    return forward


def make_logits_fn(cfg: ModelConfig, numerics: str = "fast") -> Callable:
    """Pure `(params, hidden) -> logits`."""
    graphdef, _ = split_model(cfg)

    def logits_fn(params: nnx.State, hidden: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, params).logits(hidden, numerics)

    return logits_fn


def make_step(cfg: ModelConfig, numerics: str = "fast", all_positions: bool = False) -> Callable:
    """Jitted `(params, kv_pages, batch) -> (logits, kv_pages)`, KV pages donated.

    Logits are for each row's last token (`[B, vocab]`), or for every token with
    `all_positions=True` (`[T, vocab]`).
    """
    forward = make_forward(cfg, numerics)
    logits_fn = make_logits_fn(cfg, numerics)

    def step(params, kv_pages, batch: RaggedBatch):
        hidden, kv_pages = forward(params, kv_pages, batch)
        if not all_positions:
            hidden = jnp.take(hidden, batch.logits_indices, axis=0)
        return logits_fn(params, hidden), kv_pages

    return jax.jit(step, donate_argnums=(1,))


@functools.lru_cache(maxsize=32)
def make_sampling_step(cfg: ModelConfig, numerics: str = "fast", greedy_only: bool = False) -> Callable:
    """Jitted `(params, kv_pages, batch, sampling) -> (tokens [B], kv_pages)`, KV pages donated.

    `greedy_only` compiles a variant that skips the sort behind top-k/top-p. Both apply the
    sampling metadata's token bitmask first. Cached per config,
    so engines over the same model share compiled executables.
    """
    forward = make_forward(cfg, numerics)
    logits_fn = make_logits_fn(cfg, numerics)

    def step(params, kv_pages, batch: RaggedBatch, sampling: SamplingMetadata):
        hidden, kv_pages = forward(params, kv_pages, batch)
        logits = logits_fn(params, jnp.take(hidden, batch.logits_indices, axis=0))
        logits = apply_token_bitmask(logits, sampling.token_bitmask)
        if greedy_only:
            tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        else:
            tokens = sample_tokens(logits, sampling)
        return tokens, kv_pages

    return jax.jit(step, donate_argnums=(1,))
