"""The ragged batch: the int32 metadata pytree that one jitted step reads.

Built on the host with numpy and padded to shape buckets, so steady state never recompiles.
Each sequence row contributes its new tokens (a prefill chunk or one decode token); the device
sees flat token arrays plus per-sequence offsets, KV lengths and page tables.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np

from agentjax.errors import InvalidRequestError

# Few buckets: each (tokens, rows, pages) shape is one compilation of the whole model (seconds
# on a CPU). Small rows and tokens share one bucket; padding a decode batch of 1 row to 8 costs
# little next to the weights every row reads.
TOKEN_BUCKETS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
SEQ_BUCKETS = (8, 32, 64, 128, 256)
PAGE_BUCKETS = (8, 32, 128, 512, 2048, 8192, 32768, 131072)


def bucket(value: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds `value`, or the next power of two above the largest."""
    for size in buckets:
        if value <= size:
            return size
    size = buckets[-1]
    while size < value:
        size *= 2
    return size


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class RaggedBatch:
    """Metadata of one step. T = padded token count, B = padded sequences, P = pages per row."""

    token_ids: np.ndarray  # [T] input token of each position
    positions: np.ndarray  # [T] position of each token in its sequence
    seq_ids: np.ndarray  # [T] row of each token (padding tokens: row B-1 or any, writes go to page 0)
    slot_mapping: np.ndarray  # [T] page * page_size + offset where its K/V is written
    cu_q_lens: np.ndarray  # [B+1] start offset of each row's tokens
    kv_lens: np.ndarray  # [B] KV length of each row after this step
    page_indices: np.ndarray  # [B, P] page table of each row, padded with the null page 0
    logits_indices: np.ndarray  # [B] flat index of each row's last token

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.kv_lens.shape[0])

    def shape_key(self) -> tuple[int, int, int]:
        """(T, B, P): the compiled shape this batch needs."""
        return self.num_tokens, self.num_seqs, int(self.page_indices.shape[1])

    @staticmethod
    def build(
        rows: Sequence[tuple[Sequence[int], int, Sequence[int]]],
        page_size: int,
        *,
        token_buckets: Sequence[int] = TOKEN_BUCKETS,
        seq_buckets: Sequence[int] = SEQ_BUCKETS,
        page_buckets: Sequence[int] = PAGE_BUCKETS,
    ) -> "RaggedBatch":
        """A padded batch from rows of `(new_token_ids, num_computed_tokens, page_table)`.

        `num_computed_tokens` is how many of the row's tokens already sit in its pages; the new
        tokens take the positions after them. The page table must cover every new token.
        """
        if not rows:
            raise InvalidRequestError("a batch needs at least one row")
        num_tokens = sum(len(r[0]) for r in rows)
        if any(len(r[0]) == 0 for r in rows):
            raise InvalidRequestError("every batch row needs at least one new token")
        padded_tokens = bucket(num_tokens, token_buckets)
        padded_seqs = bucket(len(rows), seq_buckets)
        max_pages = max(len(r[2]) for r in rows)
        padded_pages = bucket(max(max_pages, 1), page_buckets)

        token_ids = np.zeros(padded_tokens, np.int32)
        positions = np.zeros(padded_tokens, np.int32)
        seq_ids = np.full(padded_tokens, padded_seqs - 1, np.int32)
        # Padding tokens write into the null page; their slot index stays inside it.
        slot_mapping = np.arange(padded_tokens, dtype=np.int32) % page_size
        cu_q_lens = np.full(padded_seqs + 1, num_tokens, np.int32)
        kv_lens = np.zeros(padded_seqs, np.int32)
        page_indices = np.zeros((padded_seqs, padded_pages), np.int32)
        logits_indices = np.zeros(padded_seqs, np.int32)

        start = 0
        for row, (new_tokens, num_computed, page_table) in enumerate(rows):
            count = len(new_tokens)
            end_pos = num_computed + count
            needed_pages = -(-end_pos // page_size)
            if len(page_table) < needed_pages:
                raise InvalidRequestError(
                    f"row {row} needs {needed_pages} pages for {end_pos} tokens, "
                    f"its page table has {len(page_table)}"
                )
            table = np.asarray(page_table, np.int32)
            pos = np.arange(num_computed, end_pos, dtype=np.int32)
            token_ids[start : start + count] = new_tokens
            positions[start : start + count] = pos
            seq_ids[start : start + count] = row
            slot_mapping[start : start + count] = table[pos // page_size] * page_size + pos % page_size
            cu_q_lens[row] = start
            kv_lens[row] = end_pos
            page_indices[row, : len(table)] = table
            logits_indices[row] = start + count - 1
            start += count
        return RaggedBatch(
            token_ids=token_ids,
            positions=positions,
            seq_ids=seq_ids,
            slot_mapping=slot_mapping,
            cu_q_lens=cu_q_lens,
            kv_lens=kv_lens,
            page_indices=page_indices,
            logits_indices=logits_indices,
        )

    @staticmethod
    def from_prompts(prompts: Sequence[Sequence[int]], page_size: int, first_page: int = 1) -> "RaggedBatch":
        """A prefill batch for fresh prompts, with pages handed out in order from `first_page`.

        For notebooks: `kv_pages` must have at least `first_page + total pages` pages.
        """
        rows = []
        next_page = first_page
        for prompt in prompts:
            num_pages = -(-len(prompt) // page_size)
            rows.append((list(prompt), 0, list(range(next_page, next_page + num_pages))))
            next_page += num_pages
        return RaggedBatch.build(rows, page_size)

    def replace(self, **changes) -> "RaggedBatch":
        return dataclasses.replace(self, **changes)
