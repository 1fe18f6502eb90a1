"""Step buckets pinned for test engines of tiny models (`EngineConfig.step_buckets`): each step shape an
engine reaches is a whole-model compile (seconds to tens of seconds for a tiny preset on this CPU) while
its steps run in milliseconds whatever their padding, so a test engine pads every step to one token bucket, one row
bucket and one page-table width. Never for a test whose property is about shapes or buckets (batch
invariance across padded shapes, warm-up, compile counts, the scheduler's trim to a bucket).
"""
from __future__ import annotations

ROWS = 8     # rows of a step: most tests run at most 8 sequences at once (past 8 a size doubles)
PAGES = 32   # page-table width per KV group: contexts of up to 32 pages share one width


def pinned_buckets(*tokens: int, rows: int = ROWS, pages: int = PAGES) -> dict[str, list[int]]:
    """One row bucket, one page-table width and the token buckets given (default 128): the largest
    should hold the engine's largest step (its max_num_batched_tokens, or less where its prompts are short)."""
    return {"tokens": list(tokens or (128,)), "rows": [rows], "pages": [pages]}


STEP_BUCKETS = pinned_buckets(128)
# A real model's steps cost more than their padding: decodes keep a small bucket, prefills one large one.
REAL_MODEL_BUCKETS = pinned_buckets(8, 256)
