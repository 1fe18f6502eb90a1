"""The page tables kept between steps equal tables built from scratch, step after step, whatever changed."""
from __future__ import annotations

import random

import numpy as np
import pytest

from agentjax.errors import InvalidRequestError
from agentjax.page_table_rows import PageTableRows
from agentjax.ragged_batch import RaggedBatch


def fresh(tables_per_row, rows, widths):
    out = [np.zeros((rows, w), np.int32) for w in widths]
    for r, tables in enumerate(tables_per_row):
        for g, table in enumerate(tables):
            out[g][r, :len(table)] = table
    return out


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_kept_rows_match_fresh_tables_through_growth_shrinking_moves_and_leaves(seed):
    rng = random.Random(seed)
    kept = PageTableRows()
    # each request: one list per group, replaced (never edited) when it changes, as the KV manager does
    requests = {i: [list(range(100 * i + 1, 100 * i + 1 + rng.randrange(1, 20))) for _ in range(2)] for i in range(6)}
    order = list(requests)
    next_id = 6
    for step in range(400):
        action = rng.random()
        victim = rng.choice(order)
        if action < 0.3:  # a table grows
            g = rng.randrange(2)
            requests[victim][g] = requests[victim][g] + [rng.randrange(1, 5000) for _ in range(rng.randrange(1, 4))]
        elif action < 0.4:  # a table shrinks (lookahead pages released)
            g = rng.randrange(2)
            requests[victim][g] = requests[victim][g][:max(1, len(requests[victim][g]) - 2)]
        elif action < 0.5:  # leading pages leave a window (edited in the middle)
            requests[victim][0] = [0] + requests[victim][0][1:]
        elif action < 0.6 and len(order) > 1:  # a request leaves: the rows after it move up
            order.remove(victim)
        elif action < 0.7:  # a request arrives
            requests[next_id] = [[rng.randrange(1, 5000) for _ in range(rng.randrange(1, 30))] for _ in range(2)]
            order.append(next_id)
            next_id += 1
        elif action < 0.75:  # the order changes
            rng.shuffle(order)
        tables = [requests[i] for i in order]
        rows = 8 * -(-len(order) // 8)
        widths = [32 if max(len(t[g]) for t in tables) <= 32 else 128 for g in range(2)]
        views = kept.update(tables, rows, widths)
        for view, want in zip(views, fresh(tables, rows, widths)):
            np.testing.assert_array_equal(view, want, err_msg=f"step {step}")
            assert view.flags.c_contiguous


def test_build_with_kept_rows_equals_build_without():
    kept = PageTableRows()
    rows = [([5, 6, 7], 0, [[1], [2]]), ([9], 20, [[3, 4], [5, 6]])]
    for step in range(3):
        with_rows = RaggedBatch.build(rows, [16, 16], page_table_rows=kept)
        plain = RaggedBatch.build(rows, [16, 16])
        for a, b in zip(with_rows.page_indices + with_rows.slot_mapping, plain.page_indices + plain.slot_mapping):
            np.testing.assert_array_equal(a, b)
        rows = [(r[0], r[1] + len(r[0]), [list(t) + [40 + step] for t in r[2]]) for r in rows]


def test_build_slot_mapping_and_samples():
    batch = RaggedBatch.build([([5, 6, 7], 15, [1, 2]), ([9, 8], 4, [3])], 16, sample_counts=[2, 1])
    assert batch.positions[:5].tolist() == [15, 16, 17, 4, 5]
    assert batch.slot_mapping[0][:5].tolist() == [1 * 16 + 15, 2 * 16, 2 * 16 + 1, 3 * 16 + 4, 3 * 16 + 5]
    assert batch.logits_indices[:3].tolist() == [1, 2, 4]
    assert batch.sample_offsets[:4].tolist() == [0, 1, 0, -1]
    assert batch.cu_q_lens[:3].tolist() == [0, 3, 5] and batch.kv_lens[:3].tolist() == [18, 6, 0]


def test_build_names_the_row_whose_table_is_short():
    with pytest.raises(InvalidRequestError, match="row 1 needs 2 pages for 17 tokens"):
        RaggedBatch.build([([1], 0, [1]), ([2], 16, [3])], 16)


def test_kept_rows_follow_the_kv_managers_edited_copies():
    """Tables edited through `GroupTable.own_pages` (appends, pops, window drops, saves) are written from
    the first page they no longer share, and equal fresh tables after every edit."""
    from agentjax.kv.groups import GroupTable, PageList

    rng = random.Random(7)
    tables = [GroupTable(list(range(1 + 50 * i, 1 + 50 * i + rng.randrange(1, 30)))) for i in range(5)]
    kept = PageTableRows()
    for step in range(300):
        for table in rng.sample(tables, 2):
            edit = rng.random()
            if edit < 0.4:
                table.own_pages(len(table.pages)).extend(rng.randrange(1, 9000) for _ in range(rng.randrange(1, 3)))
            elif edit < 0.6 and len(table.pages) > 1:
                table.own_pages(len(table.pages) - 1).pop()
            elif edit < 0.8:
                j = rng.randrange(len(table.pages))
                table.own_pages(j)[j] = 0
            elif len(table.pages) > 1:
                del table.own_pages(1)[1:]
        handed = []
        for table in tables:
            table.handed_out = True
            handed.append([table.pages])
        views = kept.update(handed, 8, [128])
        np.testing.assert_array_equal(views[0], fresh(handed, 8, [128])[0], err_msg=f"step {step}")
    assert any(isinstance(table.pages, PageList) for table in tables)
