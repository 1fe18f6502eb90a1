"""Whether a request could ever fit in the KV pool, and an error that names why not.

A request that needs more pages at its longest than the whole pool holds is refused before it is
queued; the error says whether the prompt itself is too long for the pool or the output budget on top
of it, and how much output would fit. Host only: never imports jax.
"""
from __future__ import annotations

from collections.abc import Callable

from agentjax.errors import OutOfPagesError

GROW_THE_POOL = "raise --kv-cache-memory-gb or --num-kv-blocks (LLM: kv_cache_memory_gb, num_kv_blocks)"


def largest_fitting(fits: Callable[[int], bool], upper: int) -> int:
    """The largest n in [1, upper) with fits(n), for a monotone `fits` true at 1 and false at `upper`."""
    low, high = 1, upper
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def check_pool_fits(kv, prompt_tokens: int, max_tokens: int, max_model_len: int, chunk_tokens: int) -> None:
    """`OutOfPagesError` (cause "prompt" or "max_tokens") when `kv`'s whole pool could not hold a request of
    `prompt_tokens` plus `max_tokens` (capped at `max_model_len`); `chunk_tokens`: a step's token budget."""
    pool = kv.capacity_units  # pages, or for a pool of per-group page sizes the units it counts in
    unit = "KV pages" if kv.units_are_pages else "KV page units"

    def pages(tokens: int) -> int:
        return kv.max_pages_for(min(tokens, max_model_len), chunk_tokens)

    needed = pages(prompt_tokens + max_tokens)
    if needed <= pool:
        return
    if pages(prompt_tokens + 1) > pool:
        raise OutOfPagesError(f"the prompt of {prompt_tokens} tokens needs {pages(prompt_tokens + 1)} {unit} "
                              f"but the pool has {pool}; shorten the prompt or {GROW_THE_POOL}", cause="prompt")
    fits = largest_fitting(lambda output: pages(prompt_tokens + output) <= pool, max_tokens)
    raise OutOfPagesError(f"the prompt of {prompt_tokens} tokens plus max_tokens={max_tokens} need {needed} "
                          f"{unit} but the pool has {pool}; lower max_tokens to at most {fits} or {GROW_THE_POOL}",
                          cause="max_tokens")


def request_token_capacity(kv, max_model_len: int, chunk_tokens: int) -> int:
    """The most tokens (prompt plus output, at most `max_model_len`) one request alone fits in `kv`'s pool,
    by the rule `check_pool_fits` applies."""

    def fits(tokens: int) -> bool:
        return kv.max_pages_for(tokens, chunk_tokens) <= kv.capacity_units

    return max_model_len if fits(max_model_len) else largest_fitting(fits, max_model_len)
