"""Tests of agentjax/kv/known_runs.py: a prefix group's remembered runs answer the next turn's lookup
without index reads, and stop at the first page unmapped since they were read."""
import numpy as np

from agentjax.kv import KVCacheManager, block_hashes
from agentjax.kv.block_pool import BlockPool
from agentjax.kv.known_runs import KnownRuns


def _index_run(group, keys):
    run = []
    for key in keys:
        page = group.index.get(key)
        if page is None:
            break
        run.append(page)
    return run


def _turn(m, req_id, prompt, output=8):
    assert m.allocate(req_id, prompt)
    assert m.append(req_id, [7] * output)
    m.free(req_id)


def test_the_next_turn_reads_its_prefix_from_the_remembered_run():
    m = KVCacheManager.full_attention(num_blocks=64, block_size=4)
    group = m.groups[0]
    prompt = list(range(100, 140))
    _turn(m, "t1", prompt)
    history = prompt + [7] * 8
    assert m.lookup(history + [1, 2, 3]) == 48  # the first read of the whole history: all index reads
    reused = group.known_runs.pages_reused
    keys = block_hashes(history + [1, 2, 3], 4)
    assert group.cached_run(keys, len(keys)) == _index_run(group, keys)  # a new list: no last-run shortcut
    assert group.known_runs.pages_reused - reused == 12  # every page came from the remembered run


def test_a_run_stops_at_the_first_page_unmapped_since_and_reads_the_index_past_it():
    m = KVCacheManager.full_attention(num_blocks=64, block_size=4)
    group, pool = m.groups[0], m.pool
    prompt = list(range(100, 148))  # 12 pages
    _turn(m, "t1", prompt, output=0)
    keys = block_hashes(prompt, 4)
    first = group.cached_run(list(keys), len(keys))
    assert len(first) == 12
    pool.evict(first[5])  # page 5 is unmapped: the run is good for pages 0-4 only
    assert group.cached_run(list(keys), len(keys)) == first[:5] == _index_run(group, keys)
    assert m.lookup(prompt) == 20
    # the same block cached again, on another page: the run must give the page the index holds now
    _turn(m, "t2", prompt, output=0)
    again = group.cached_run(list(keys), len(keys))
    assert again == _index_run(group, keys) and len(again) == 12
    assert again[:5] == first[:5] and again[6:] == first[6:]  # blocks 6-11 stayed on their pages


def test_runs_are_kept_per_first_key_and_bounded():
    pool = BlockPool(32)
    runs = KnownRuns(pool, max_pages=10, per_key=2)
    a, b = [bytes([1, i]) for i in range(8)], [bytes([2, i]) for i in range(8)]
    runs.remember(a, [1, 2, 3], np.array([1, 2, 3], dtype=np.int32))
    runs.remember(a, [1, 2, 3, 4, 5], np.array([1, 2, 3, 4, 5], dtype=np.int32))  # extends the first: replaces it
    assert runs.known_prefix(a, 8)[0] == [1, 2, 3, 4, 5]
    assert runs.known_prefix(a[:4], 8)[0] == []  # the remembered run is longer than these keys
    assert runs.known_prefix(a, 2)[0] == [1, 2]
    runs.remember(b, [6, 7, 8, 9, 10, 11], np.arange(6, 12, dtype=np.int32))  # 11 entries > 10: a's run goes
    assert runs.known_prefix(a, 8)[0] == [] and runs.known_prefix(b, 8)[0] == [6, 7, 8, 9, 10, 11]
    assert runs.known_prefix([bytes([3])] + b[1:], 8)[0] == []  # another first key
    runs.remember(a, list(range(11)), np.arange(11, dtype=np.int32))  # larger than the bound: not kept
    assert runs.known_prefix(a, 11)[0] == []


def test_leading_cached_stops_at_the_first_missing_key_like_a_probe_per_key():
    from agentjax.kv.groups import leading_cached

    rng = np.random.default_rng(5)
    keys = [bytes([i % 256, i // 256]) for i in range(300)]
    for _ in range(200):
        index = {key: page for page, key in enumerate(keys) if rng.random() < 0.97}
        start = int(rng.integers(0, 300))
        stop = int(rng.integers(start, 301))
        expected = []
        for key in keys[start:stop]:
            if key not in index:
                break
            expected.append(index[key])
        assert leading_cached(index, keys, start, stop) == expected


def test_the_page_array_of_a_handed_out_run_equals_its_pages():
    m = KVCacheManager.full_attention(num_blocks=64, block_size=4)
    group = m.groups[0]
    prompt = list(range(100, 148))
    _turn(m, "t1", prompt, output=0)
    keys = block_hashes(prompt, 4)
    for limit in (12, 7, 12):  # read from the index, then from the last run, then from the known run
        run = group.cached_run(list(keys), limit)
        array = group.page_array(run)
        assert array.dtype == np.int64 and array.tolist() == run == _index_run(group, keys)[:limit]
    assert group.page_array(list(run)).tolist() == run  # any other list is converted
