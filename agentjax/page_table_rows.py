"""Page tables kept from step to step: one int32 buffer per KV group, row r holding batch row r's table.

Each step a row's table is written only where it changed: the KV manager hands out a table as a list it
never edits again (`KVCacheManager.block_ids`), so the same list object means the same table and costs
nothing, and its edited copy (`agentjax.kv.groups.PageList`) says which leading pages it shares with the
list written before, so only the pages after them are written. Other lists are compared with the row's
last list (grown: only its new pages; shrunk: its dropped tail zeroed). A request that moved up a row
is copied from its old row. The buffers' width is the step's page
bucket, so `view` hands out a contiguous `[rows, pages]` array without a copy. Host only: numpy, no jax;
never keeps a table it was not handed this step (rows past the batch are zeroed).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class GroupTableRows:
    """The rows of one KV group's page table."""

    def __init__(self) -> None:
        self.buffer = np.zeros((0, 0), np.int32)
        self.sources: list = []  # per row: the list written there (None: the row is all zeros)
        self.lengths: list[int] = []  # per row: entries written (the rest of the row is 0)

    def reshape(self, rows: int, width: int) -> None:
        """Make the buffer `[rows, width]`, keeping what fits (a wider table bucket or more rows)."""
        old_rows, old_width = self.buffer.shape
        if (old_rows, old_width) == (rows, width):
            return
        keep_rows = min(rows, old_rows)
        buffer = np.zeros((rows, width), np.int32)
        keep = min(width, old_width)
        buffer[:keep_rows, :keep] = self.buffer[:keep_rows, :keep]
        for row in range(keep_rows):
            if self.lengths[row] > width:  # the table no longer fits: forget the row (rewritten by `write`)
                buffer[row] = 0
                self.sources[row], self.lengths[row] = None, 0
        self.buffer = buffer
        self.sources = self.sources[:keep_rows] + [None] * (rows - keep_rows)
        self.lengths = self.lengths[:keep_rows] + [0] * (rows - keep_rows)

    def write(self, tables: Sequence[Sequence[int]]) -> None:
        """Row r holds `tables[r]` (then zeros); rows past them hold zeros."""
        buffer, sources, lengths = self.buffer, self.sources, self.lengths
        where = None  # row of each list written before, built when a row's list is new to it
        for row, table in enumerate(tables):
            old, length, written = sources[row], len(table), lengths[row]
            if old is table and length == written:
                continue
            if old is not None and getattr(table, "parent", None) is old:
                shared = min(table.shared, written, length)  # the KV manager's copy of `old`, edited from here
                buffer[row, shared:length] = table[shared:]
                if length < written:
                    buffer[row, length:written] = 0
                sources[row], lengths[row] = table, length
                continue
            if where is None:
                where = {id(source): r for r, source in enumerate(sources) if source is not None}
            moved = where.get(id(table))
            if moved is not None and moved > row and sources[moved] is table and lengths[moved] == length:
                # the request moved up (a row before it left): its old row is not rewritten yet this step
                buffer[row, :length] = buffer[moved, :length]
            elif old is not None and written <= length and table[:written] == old:
                buffer[row, written:length] = table[written:]  # grew: only the new pages
            elif old is not None and length < written and old[:length] == table:
                pass  # shrank: the tail is zeroed below
            else:
                buffer[row, :length] = table
            if length < written:
                buffer[row, length:written] = 0
            sources[row], lengths[row] = table, length
        for row in range(len(tables), len(sources)):
            if sources[row] is not None:
                buffer[row, :lengths[row]] = 0
                sources[row], lengths[row] = None, 0


class PageTableRows:
    """Per KV group, the step's page tables as rows of a buffer kept between steps (see the module)."""

    def __init__(self) -> None:
        self.groups: list[GroupTableRows] = []

    def update(self, tables_per_row: Sequence[Sequence[Sequence[int]]], rows: int, widths: Sequence[int]
               ) -> tuple[np.ndarray, ...]:
        """`[rows, widths[g]]` page tables of each group g: row r is `tables_per_row[r][g]`, 0-padded.
        The arrays are views of the kept buffers: valid until the next `update`."""
        while len(self.groups) < len(widths):
            self.groups.append(GroupTableRows())
        del self.groups[len(widths):]
        views = []
        for g, (group, width) in enumerate(zip(self.groups, widths)):
            group.reshape(max(rows, len(group.sources)), width)
            group.write([tables[g] for tables in tables_per_row])
            views.append(group.buffer[:rows])
        return tuple(views)
