"""The ragged batch: the int32 metadata pytree that one jitted step reads.

Built on the host with numpy and padded to shape buckets, so steady state never recompiles.
Each sequence row contributes its new tokens (a prefill chunk or one decode token); the device
sees flat token arrays plus per-sequence offsets, KV lengths and one page table per KV group.
A neutral type: the models, the runner and the kernels read it; it imports none of them.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np

from agentjax.buckets import PAGE_BUCKETS, SEQ_BUCKETS, STATE_SAVE_BUCKETS, TOKEN_BUCKETS, bucket  # noqa: F401
from agentjax.errors import InvalidRequestError
from agentjax.page_table_rows import PageTableRows


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class RaggedBatch:
    """Metadata of one step. T = padded token count, B = padded sequences, P = pages per row."""

    token_ids: np.ndarray  # [T] input token of each position
    positions: np.ndarray  # [T] position of each token in its sequence
    seq_ids: np.ndarray  # [T] row of each token (padding tokens: row B-1 or any, writes go to page 0)
    slot_mapping: tuple[np.ndarray, ...]  # per KV group, [T]: page * (its page size) + offset of its entry
    cu_q_lens: np.ndarray  # [B+1] start offset of each row's tokens
    kv_lens: np.ndarray  # [B] KV length of each row after this step
    page_indices: tuple[np.ndarray, ...]  # per KV group, [B, P_g]: page table of each row, 0-padded
    # [S] flat index of each sampled token: each row's last token ([B], S = B), or with speculative
    # decoding each row's last `sample_counts[row]` tokens, row after row (S a bucket of their sum)
    logits_indices: np.ndarray
    # [S] index of each sampled token among its row's samples (0 = the row's first; a decode row's real
    # token), -1 for padding samples
    sample_offsets: np.ndarray
    # [V] recurrent-state checkpoints inside prefill chunks: save v keeps the state after flat token
    # `state_save_tokens[v]` in column `state_save_cols[v]` of its row's state tables (column 0, the
    # running page, means no save; padding saves point past the tokens)
    state_save_tokens: np.ndarray | None = None
    state_save_cols: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.kv_lens.shape[0])

    @property
    def num_samples(self) -> int:
        """S: the (padded) token positions whose logits the step samples."""
        return int(self.logits_indices.shape[0])

    @property
    def num_groups(self) -> int:
        return len(self.page_indices)

    def shape_key(self) -> tuple[int, int, tuple[int, ...]]:
        """(T, B, pages per row of each group): the compiled shape this batch needs."""
        return self.num_tokens, self.num_seqs, tuple(int(table.shape[1]) for table in self.page_indices)

    @staticmethod
    def build(
        rows: Sequence[tuple[Sequence[int], int, Sequence]],
        page_size: int | Sequence[int],
        *,
        state_groups: Sequence[int] = (),
        token_buckets: Sequence[int] = TOKEN_BUCKETS,
        seq_buckets: Sequence[int] = SEQ_BUCKETS,
        page_buckets: Sequence[int] = PAGE_BUCKETS,
        sample_counts: Sequence[int] | None = None,
        state_interval: int = 0,
        page_table_rows: PageTableRows | None = None,
    ) -> "RaggedBatch":
        """A padded batch from rows of `(new_token_ids, num_computed_tokens, page_tables)`.

        `sample_counts` (speculative decoding) gives per row how many of its last tokens get logits (a
        decode row's real token and its draft tokens); by default one, the last.

        `page_size` is the tokens per page of every group, or one value per group (a "pool" KV layout
        gives each page group its own). `num_computed_tokens` is how many of the row's tokens already
        sit in its pages; the new tokens take the positions after them. `page_tables` holds one page list per KV group (a
        plain list of ints is one group); each must cover every new token, except the groups in
        `state_groups`, whose table is the one page holding the row's recurrent state, then (a prefill
        chunk) one page per multiple of `state_interval` strictly inside the chunk, in order: the state
        after that many tokens is saved there (the null page: not saved).

        With `page_table_rows` (the runner's, kept between steps) the page tables are written only where
        they changed since its last batch, and `page_indices` are views of its buffers, valid until the
        next build with it; page lists must not be edited in place once passed (the KV manager's hold).
        """
        if not rows:
            raise InvalidRequestError("a batch needs at least one row")
        num_rows = len(rows)
        counts = np.fromiter((len(r[0]) for r in rows), np.int64, num_rows)
        if not counts.all():
            raise InvalidRequestError("every batch row needs at least one new token")
        num_tokens = int(counts.sum())
        tables_per_row = [_group_tables(r[2]) for r in rows]
        num_groups = len(tables_per_row[0])
        if any(len(tables) != num_groups for tables in tables_per_row):
            raise InvalidRequestError("every batch row needs a page table for each KV group")
        padded_tokens = bucket(num_tokens, token_buckets)
        padded_seqs = bucket(num_rows, seq_buckets)
        sizes = [page_size] * num_groups if isinstance(page_size, (int, np.integer)) else list(page_size)
        if len(sizes) != num_groups:
            raise InvalidRequestError(f"{len(sizes)} page sizes for {num_groups} KV groups")
        if sample_counts is not None and len(sample_counts) != num_rows:
            raise InvalidRequestError(f"sample_counts has {len(sample_counts)} entries for {num_rows} rows")

        # per row: first flat token, tokens already in its pages, KV length after the step
        computed = np.fromiter((r[1] for r in rows), np.int64, num_rows)
        starts = np.cumsum(counts) - counts
        ends = computed + counts
        row_of_token = np.repeat(np.arange(num_rows), counts)
        pos = (np.arange(num_tokens) - starts[row_of_token] + computed[row_of_token]).astype(np.int32)

        token_ids = np.zeros(padded_tokens, np.int32)
        token_ids[:num_tokens] = np.fromiter(itertools.chain.from_iterable(r[0] for r in rows), np.int64, num_tokens)
        positions = np.zeros(padded_tokens, np.int32)
        positions[:num_tokens] = pos
        seq_ids = np.full(padded_tokens, padded_seqs - 1, np.int32)
        seq_ids[:num_tokens] = row_of_token
        cu_q_lens = np.full(padded_seqs + 1, num_tokens, np.int32)
        cu_q_lens[:num_rows] = starts
        kv_lens = np.zeros(padded_seqs, np.int32)
        kv_lens[:num_rows] = ends

        lengths = np.fromiter(map(len, itertools.chain.from_iterable(tables_per_row)), np.int64,
                              num_rows * num_groups).reshape(num_rows, num_groups)
        widths = [bucket(max(1, int(lengths[:, g].max())), page_buckets) for g in range(num_groups)]
        if page_table_rows is not None:
            page_indices = page_table_rows.update(tables_per_row, padded_seqs, widths)
        else:
            page_indices = tuple(np.zeros((padded_seqs, width), np.int32) for width in widths)
            for row, tables in enumerate(tables_per_row):
                for g in range(num_groups):
                    page_indices[g][row, : len(tables[g])] = tables[g]
        # Padding tokens write into the null page; their slot index stays inside it.
        slot_mapping = []
        for g in range(num_groups):
            size = sizes[g]
            slots = np.arange(padded_tokens, dtype=np.int32) % size
            if g not in state_groups:
                needed = -(-ends // size)
                short = np.flatnonzero(lengths[:, g] < needed)
                if len(short):
                    row = int(short[0])
                    raise InvalidRequestError(
                        f"row {row} needs {needed[row]} pages for {ends[row]} tokens, "
                        f"its page table for KV group {g} has {lengths[row, g]}"
                    )
                slots[:num_tokens] = page_indices[g][row_of_token, pos // size] * size + pos % size
            slot_mapping.append(slots)

        if sample_counts is None or all(c == 1 for c in sample_counts):
            logits_indices = np.zeros(padded_seqs, np.int32)
            logits_indices[:num_rows] = starts + counts - 1
            sample_offsets = np.full(padded_seqs, -1, np.int32)
            sample_offsets[:num_rows] = 0
        else:
            samples = np.asarray(sample_counts, np.int64)
            if ((samples < 1) | (samples > counts)).any():
                raise InvalidRequestError("each row samples between 1 and all of its new tokens")
            num_sampled = int(samples.sum())
            logits_indices = np.zeros(bucket(max(num_sampled, padded_seqs), seq_buckets), np.int32)
            sample_offsets = np.full(len(logits_indices), -1, np.int32)
            # the i-th sample of a row is its token (count - samples + i)
            offsets = np.arange(num_sampled) - np.repeat(np.cumsum(samples) - samples, samples)
            logits_indices[:num_sampled] = np.repeat(starts + counts - samples, samples) + offsets
            sample_offsets[:num_sampled] = offsets
        saves: list[tuple[int, int]] = []  # (flat token index, state table column)
        if state_interval and state_groups:
            for row in np.flatnonzero(counts > 1).tolist():
                saves += _state_saves(int(computed[row]), int(ends[row]), int(starts[row]), state_interval,
                                      tables_per_row[row][state_groups[0]])
        num_saves = bucket(max(1, len(saves)), STATE_SAVE_BUCKETS)
        state_save_tokens = np.full(num_saves, padded_tokens, np.int32)
        state_save_cols = np.zeros(num_saves, np.int32)
        if saves:
            state_save_tokens[:len(saves)], state_save_cols[:len(saves)] = zip(*saves)
        return RaggedBatch(
            token_ids=token_ids,
            positions=positions,
            seq_ids=seq_ids,
            slot_mapping=tuple(slot_mapping),
            cu_q_lens=cu_q_lens,
            kv_lens=kv_lens,
            page_indices=tuple(page_indices),
            logits_indices=logits_indices,
            sample_offsets=sample_offsets,
            state_save_tokens=state_save_tokens,
            state_save_cols=state_save_cols,
        )

    def for_groups(self, num_groups: int) -> "RaggedBatch":
        """This batch with its one page table shared by `num_groups` KV groups (notebooks: every
        group's buffer spans all page ids, so one table can serve them all; a recurrent-state group
        keeps its state in the row's first page)."""
        if self.num_groups == num_groups:
            return self
        if self.num_groups != 1:
            raise InvalidRequestError(f"the batch has {self.num_groups} page tables, the model {num_groups} KV groups")
        return self.replace(page_indices=self.page_indices * num_groups, slot_mapping=self.slot_mapping * num_groups)

    @staticmethod
    def from_prompts(prompts: Sequence[Sequence[int]], page_size: int, first_page: int = 1) -> "RaggedBatch":
        """A prefill batch for fresh prompts, with pages handed out in order from `first_page`,
        one page table per row (the step shares it among the model's KV groups).

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


def _state_saves(num_computed: int, end: int, first_token: int, interval: int, state_table: Sequence[int]):
    """(flat token index, column) of each checkpoint a prefill chunk of tokens [num_computed, end) saves:
    the multiples of `interval` strictly inside it, column 1 on, where the row's state table names a page."""
    saves = []
    for column, boundary in enumerate(range((num_computed // interval + 1) * interval, end, interval), start=1):
        if column < len(state_table) and state_table[column]:
            saves.append((first_token + boundary - num_computed - 1, column))
    return saves


def _group_tables(page_tables: Sequence) -> list[Sequence[int]]:
    """A row's tables, one per group: a flat list of page ids is the table of a single group."""
    if len(page_tables) and not isinstance(page_tables[0], (int, np.integer)):
        return list(page_tables)
    return [page_tables]
