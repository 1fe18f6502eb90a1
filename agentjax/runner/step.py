"""Jitted step functions: one forward over a ragged batch, with the KV pages donated.

`make_step(cfg)` gives `(params, kv_pages, batch) -> (logits, kv_pages)` for experiments;
`make_sampling_step(cfg)` adds the sampler and returns tokens instead, which is what the engine
runs; its variants with penalties, log probabilities of the sampled tokens (always the top
`MAX_LOGPROBS`) or of prompt positions run only for steps whose rows ask, so plain steps trace
exactly as before. `nnx.merge` happens inside the traced function, so the graph is split once.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from agentjax.config import ModelConfig
from agentjax.models.params import split_model
from agentjax.numerics import map_row_blocks
from agentjax.ragged_batch import RaggedBatch
from agentjax.logprobs import LOGPROBS_MODES
from agentjax.runner.extras import PromptLogprobInputs
from agentjax.runner.sampler import (
    PenaltyInputs,
    SamplingMetadata,
    apply_penalties,
    apply_token_bitmask,
    gather_logprobs,
    log_probabilities,
    sample_tokens,
    sample_tokens_and_logits,
)
from agentjax.sampling_params import MAX_LOGPROBS

# Prompt positions whose logits are computed at once (bounds the [block, vocab] temporary).
PROMPT_LOGPROB_BLOCK = 128


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


@functools.lru_cache(maxsize=64)
def make_sampling_step(cfg: ModelConfig, numerics: str = "fast", greedy_only: bool = False, *,
                       penalties: bool = False, logprobs_mode: str | None = None,
                       prompt_logprobs: bool = False, drafter=None) -> Callable:
    """Jitted `(params, kv_pages, batch, sampling) -> (tokens [B], kv_pages)`, KV pages donated.

    `greedy_only` compiles a variant that skips the sort behind top-k/top-p. Both apply the
    sampling metadata's token bitmask first. Cached per config,
    so engines over the same model share compiled executables.

    The extended variants (`penalties`, `logprobs_mode` set, or `prompt_logprobs`) take
    `(params, kv_pages, batch, sampling, penalty_inputs, prompt_inputs)` (None where off) and return
    `(tokens, aux, kv_pages)`: `aux["sampled"]` holds `gather_logprobs` of each row's token, from the
    logits before penalties and sampling ("raw_*") or after them ("processed_*"); `aux["prompt"]` the
    same for the prompt inputs' positions, always raw log probabilities.

    With a `drafter` (agentjax/runner/drafters.py: speculative decoding's "mtp" or "draft_model") the
    step takes a last argument, the drafter's `SpecInputs`, and returns `((tokens, drafts [B, k]), ...)`
    in place of the tokens: the drafter may replace tokens (rejection sampling) and proposes each row's
    next drafts from its last accepted position.
    """
    if drafter is not None:
        forward, logits_fn = drafter.forward, drafter.logits
    else:
        forward, logits_fn = make_forward(cfg, numerics), make_logits_fn(cfg, numerics)
    step = sampling_step_function(forward, logits_fn, greedy_only, penalties=penalties, logprobs_mode=logprobs_mode,
                                  prompt_logprobs=prompt_logprobs, drafter=drafter, numerics=numerics)
    return jax.jit(step, donate_argnums=(1,))


def sampling_step_function(forward: Callable, logits_fn: Callable, greedy_only: bool = False, *,
                           penalties: bool = False, logprobs_mode: str | None = None,
                           prompt_logprobs: bool = False, drafter=None, numerics: str = "fast") -> Callable:
    """The unjitted function behind `make_sampling_step`, over any `forward` and `logits_fn`. With a
    `drafter`, `forward` returns `(hidden, context, kv_pages)` and the drafter's `finish` runs after
    sampling. In "batch_invariant" `numerics` the log-softmax runs over fixed row blocks too, so a
    row's log probabilities do not depend on how many rows share the step."""
    if logprobs_mode is not None and logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")

    def run_forward(params, kv_pages, batch):
        if drafter is None:
            hidden, kv_pages = forward(params, kv_pages, batch)
            return hidden, None, kv_pages
        return forward(params, kv_pages, batch)

    def finish(params, kv_pages, batch, sampling, spec, context, processed, tokens):
        if drafter is None:
            return tokens, kv_pages
        tokens, drafts, kv_pages = drafter.finish(params, kv_pages, batch, sampling, spec, context, processed,
                                                  tokens, greedy_only)
        return (tokens, drafts), kv_pages

    def step(params, kv_pages, batch: RaggedBatch, sampling: SamplingMetadata, spec=None):
        hidden, context, kv_pages = run_forward(params, kv_pages, batch)
        logits = logits_fn(params, jnp.take(hidden, batch.logits_indices, axis=0))
        logits = apply_token_bitmask(logits, sampling.token_bitmask)
        if greedy_only:
            tokens, processed = jnp.argmax(logits, axis=-1).astype(jnp.int32), logits
        elif drafter is None:
            tokens, processed = sample_tokens(logits, sampling), None
        else:
            tokens, processed = sample_tokens_and_logits(logits, sampling)
        return finish(params, kv_pages, batch, sampling, spec, context, processed, tokens)

    def extended_step(params, kv_pages, batch: RaggedBatch, sampling: SamplingMetadata,
                      penalty_inputs: PenaltyInputs | None, prompt_inputs: PromptLogprobInputs | None, spec=None):
        hidden, context, kv_pages = run_forward(params, kv_pages, batch)
        raw = logits_fn(params, jnp.take(hidden, batch.logits_indices, axis=0)).astype(jnp.float32)
        raw = apply_token_bitmask(raw, sampling.token_bitmask)
        logits = apply_penalties(raw, penalty_inputs) if penalties else raw
        if greedy_only:
            tokens, processed = jnp.argmax(logits, axis=-1).astype(jnp.int32), logits
        else:
            tokens, processed = sample_tokens_and_logits(logits, sampling)
        tokens, kv_pages = finish(params, kv_pages, batch, sampling, spec, context, processed, tokens)
        sampled_tokens = tokens[0] if drafter is not None else tokens
        aux = {}
        if logprobs_mode is not None:
            source = raw if logprobs_mode.startswith("raw") else processed
            values = row_log_probabilities(source, logprobs_mode.endswith("logprobs"), numerics)
            aux["sampled"] = gather_logprobs(values, sampled_tokens, MAX_LOGPROBS)
        if prompt_logprobs:
            aux["prompt"] = _prompt_logprobs(logits_fn, params, hidden, prompt_inputs, numerics)
        return tokens, aux, kv_pages

    if penalties or logprobs_mode is not None or prompt_logprobs:
        return extended_step
    return step


def row_log_probabilities(logits: jax.Array, as_logprobs: bool, numerics: str) -> jax.Array:
    """`log_probabilities` of each row; in "batch_invariant" numerics over fixed row blocks (the
    log-softmax's reductions over the vocabulary are ordered by XLA according to the row count)."""
    if numerics != "batch_invariant":
        return log_probabilities(logits, as_logprobs)
    return map_row_blocks(lambda rows: log_probabilities(rows, as_logprobs), logits)


def _prompt_logprobs(logits_fn: Callable, params, hidden: jax.Array, inputs: PromptLogprobInputs, numerics: str):
    """`gather_logprobs` of raw log probabilities at the inputs' positions, a block of positions at a
    time (the logits of every position would be `[tokens, vocab]`)."""
    size = inputs.indices.shape[0]
    block = min(size, PROMPT_LOGPROB_BLOCK)
    chosen_hidden = jnp.take(hidden, inputs.indices, axis=0).reshape(size // block, block, hidden.shape[-1])
    targets = inputs.targets.reshape(size // block, block)

    def one_block(args):
        block_hidden, block_targets = args
        values = row_log_probabilities(logits_fn(params, block_hidden), True, numerics)
        return gather_logprobs(values, block_targets, MAX_LOGPROBS)

    chosen, ranks, top_ids, top_values = jax.lax.map(one_block, (chosen_hidden, targets))
    return (chosen.reshape(size), ranks.reshape(size), top_ids.reshape(size, -1), top_values.reshape(size, -1))
