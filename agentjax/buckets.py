"""The shape buckets of a step: how many tokens, rows and pages per row a compiled step is padded to.

Few buckets: each (tokens, rows, pages) shape is one compilation of the whole model (seconds on a
CPU). The runner pads every batch to them (`agentjax.ragged_batch`), and the scheduler reads the
token buckets to avoid steps that pad far past one. Host only: never imports jax.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentjax.errors import InvalidRequestError
from agentjax.json_setting import json_setting

# Small rows and tokens share one bucket: padding a decode batch of 1 row to 8 costs little next to
# the weights every row reads, and padding rows reach no expert (agentjax/models/moe.py). Up to 256 the
# token buckets include every row bucket, so a decode step pads its tokens no further than its rows.
TOKEN_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
SEQ_BUCKETS = (8, 16, 32, 64, 128, 256)
PAGE_BUCKETS = (8, 32, 128, 512, 2048, 8192, 32768, 131072)
# Recurrent-state checkpoints saved inside a step's prefill chunks (most steps: none, one bucket).
STATE_SAVE_BUCKETS = (8, 64, 512)


def bucket(value: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds `value`, or the next power of two above the largest."""
    for size in buckets:
        if value <= size:
            return size
    size = buckets[-1]
    while size < value:
        size *= 2
    return size


@dataclass(frozen=True)
class StepBuckets:
    """One engine's buckets (`EngineConfig.step_buckets`): the defaults above, or fewer where compiles
    cost more than padding (a test of a tiny model pins one token bucket: each step shape it would
    reach is a whole-model compile, and its steps cost milliseconds whatever their padding). Past the
    largest bucket a size doubles (`bucket`)."""

    tokens: tuple[int, ...] = TOKEN_BUCKETS
    rows: tuple[int, ...] = SEQ_BUCKETS
    pages: tuple[int, ...] = PAGE_BUCKETS

    def __post_init__(self) -> None:
        for name in ("tokens", "rows", "pages"):
            sizes = tuple(getattr(self, name))
            if not sizes or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in sizes) \
                    or list(sizes) != sorted(set(sizes)):
                raise InvalidRequestError(
                    f"step_buckets {name!r} must be increasing positive integers, got {list(sizes)}")
            object.__setattr__(self, name, sizes)

    @classmethod
    def parse(cls, value: Any) -> "StepBuckets":
        """From None (the defaults), a StepBuckets, or a dict (or its JSON text) with any of "tokens",
        "rows" and "pages"; an `InvalidRequestError` names what is wrong."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        value = json_setting(value, "step_buckets", example='{"tokens": [256], "rows": [8]}')
        if set(value) - {"tokens", "rows", "pages"}:
            raise InvalidRequestError(
                f'step_buckets takes a dict of "tokens", "rows" and "pages" lists, got {value!r}')
        return cls(**{name: tuple(sizes) for name, sizes in value.items()})


def lockstep_buckets(token_counts: Sequence[int], row_counts: Sequence[int],
                     buckets: StepBuckets = StepBuckets()) -> tuple[int, int]:
    """The (tokens, rows) buckets of one step whose ranks run in lockstep (one rank: its own batch's):
    every rank is padded to the largest rank's counts, bucketed. The runners pad to them and the
    planner charges them (agentjax/bench/costmodel.py)."""
    return bucket(max(1, *token_counts), buckets.tokens), bucket(max(1, *row_counts), buckets.rows)


def bucket_below(value: int, buckets: Sequence[int]) -> int:
    """The largest bucket smaller than `value` (0 when none is)."""
    below = 0
    size = bucket(1, buckets)
    while size < value:
        below = size
        size = bucket(size + 1, buckets)
    return below
