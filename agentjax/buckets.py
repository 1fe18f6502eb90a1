"""The shape buckets of a step: how many tokens, rows and pages per row a compiled step is padded to.

Few buckets: each (tokens, rows, pages) shape is one compilation of the whole model (seconds on a
CPU). The runner pads every batch to them (`agentjax.ragged_batch`), and the scheduler reads the
token buckets to avoid steps that pad far past one. Host only: never imports jax.
"""
from __future__ import annotations

from collections.abc import Sequence

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


def lockstep_buckets(token_counts: Sequence[int], row_counts: Sequence[int]) -> tuple[int, int]:
    """The (tokens, rows) buckets of one step whose ranks run in lockstep (one rank: its own batch's):
    every rank is padded to the largest rank's counts, bucketed. The runners pad to them and the
    planner charges them (agentjax/bench/costmodel.py)."""
    return bucket(max(1, *token_counts), TOKEN_BUCKETS), bucket(max(1, *row_counts), SEQ_BUCKETS)


def bucket_below(value: int, buckets: Sequence[int]) -> int:
    """The largest bucket smaller than `value` (0 when none is)."""
    below = 0
    size = bucket(1, buckets)
    while size < value:
        below = size
        size = bucket(size + 1, buckets)
    return below
