"""The scheduler side of the offload connector (agentjax/kv/offload/connector.py) on a real manager, a
real host index and a real disk tier: lookups per tier, load staging and its page references, failed
pages left uncached, aborts during a load, retention-driven stores, degraded tiers. The worker's part
(moving bytes) is played by the test, which reports completions as the worker would."""
from __future__ import annotations

import numpy as np
import pytest

from agentjax.kv import FullAttentionSpec, KVCacheManager, RecurrentStateSpec
from agentjax.kv.offload.connector import OffloadConnector
from agentjax.kv.offload.disk import DiskTier
from agentjax.kv.offload.host import HostPageIndex
from agentjax.sampling_params import SamplingParams
from agentjax.scheduler.request import AgentHints, Request

BLOCK = 4
FULL = FullAttentionSpec(num_kv_heads=1, head_dim=8, dtype_bytes=2)
STATE = RecurrentStateSpec(bytes_per_state=128, checkpoint_interval=8)


def _request(request_id: str, tokens: list[int], hints=None) -> Request:
    return Request(request_id, list(tokens), SamplingParams(max_tokens=1), frozenset(), hints=hints)


def _run_turn(kv: KVCacheManager, connector: OffloadConnector, request: Request) -> None:
    """Admit, 'compute' every token, end the turn (stores prepared) and free, as the scheduler does."""
    assert kv.allocate(request.request_id, request.all_token_ids)
    kv.cache_blocks(request.request_id, len(request.all_token_ids))
    kv.take_pending_copies()  # the device would run them before the next step
    connector.on_turn_end(request)
    kv.free(request.request_id)


def _evict_everything(kv: KVCacheManager) -> None:
    for page in range(1, kv.pool.num_pages):
        if kv.pool.ref_counts[page] == 0:
            kv.pool.evict(page)


def _complete(connector: OffloadConnector, failed=()) -> None:
    for job in connector.take_transfers().loads:
        connector.results.put(("load", job.job_id, {key: ("checksum", "test") for key in failed}))


@pytest.fixture
def full(tmp_path):
    kv = KVCacheManager.from_specs([FULL], 64, block_size=BLOCK, cache_on_allocate=False)
    host = HostPageIndex(num_groups=1, num_slots=32)
    disk = DiskTier(tmp_path, "ns", 1 << 20)
    return kv, OffloadConnector(kv, host=host, disk=disk)


def test_a_finished_turn_stores_its_cached_pages_to_every_tier(full):
    kv, connector = full
    _run_turn(kv, connector, _request("a", range(100, 118)))  # 4 full pages
    stores = connector.take_transfers().stores
    assert len(stores) == 1
    job = stores[0]
    assert job.keys == kv.prepare(list(range(100, 118)), None)[1][:4]  # the pages in prompt order
    assert len(job.tier_rows("host")) == 4 and job.disk_rows == [0, 1, 2, 3] and job.mooncake_rows == []
    assert sorted(job.host_slots) == [1, 2, 3, 4]  # slot 0 is never handed out


def test_lookup_counts_the_longest_prefix_per_tier(full):
    kv, connector = full
    _run_turn(kv, connector, _request("a", range(100, 118)))
    connector.take_transfers()
    _evict_everything(kv)
    follow_up = list(range(100, 118)) + [7] * 6
    assert connector.lookup(follow_up) == {"device": 0, "host": 4, "disk": 0, "mooncake": 0}
    connector.host.drop((0, kv.prepare(follow_up, None)[1][2]))  # the third page leaves the host tier
    assert connector.lookup(follow_up) == {"device": 0, "host": 2, "disk": 0, "mooncake": 0}


def test_lookup_counts_device_pages_when_no_tier_extends_the_hit(full):
    kv, connector = full
    _run_turn(kv, connector, _request("a", range(100, 118)))
    connector.take_transfers()
    follow_up = list(range(100, 118)) + [7] * 6
    assert connector.lookup(follow_up) == {"device": 4, "host": 0, "disk": 0, "mooncake": 0}
    kv.pool.evict(kv.pool.cached_page(0, kv.prepare(follow_up, None)[1][3]))  # the device loses its last page
    assert connector.lookup(follow_up) == {"device": 3, "host": 1, "disk": 0, "mooncake": 0}


def test_a_load_holds_pages_then_the_admission_hits_the_whole_prefix(full):
    kv, connector = full
    _run_turn(kv, connector, _request("a", range(100, 118)))
    connector.take_transfers()
    _evict_everything(kv)
    follow = _request("b", list(range(100, 118)) + [7] * 6)
    free_before = kv.pool.num_free
    assert connector.hold(follow) is True
    assert kv.pool.num_free == free_before - 4  # staged pages are held while the worker copies
    assert connector.poll() == []  # nothing finished yet
    assert kv.lookup(follow.all_token_ids) == 0
    _complete(connector)
    assert connector.poll() == [follow]
    assert connector.hold(follow) is False  # loaded: admit it now
    assert kv.lookup(follow.all_token_ids) == 16
    assert kv.allocate("b", follow.all_token_ids) and kv.num_cached_tokens("b") == 16
    connector.on_admitted(follow)
    assert connector.stats.get("pages_loaded", "host") == 4
    kv.free("b")
    kv.check_invariants()
    assert kv.pool.num_free == kv.pool.num_pages - 1


def test_a_page_that_failed_to_load_stays_uncached_and_the_hit_stops_before_it(full):
    kv, connector = full
    _run_turn(kv, connector, _request("a", range(100, 118)))
    connector.take_transfers()
    _evict_everything(kv)
    follow = _request("b", list(range(100, 118)) + [7] * 6)
    hashes = kv.prepare(follow.all_token_ids, None)[1]
    assert connector.hold(follow)
    _complete(connector, failed=[(0, hashes[2])])
    connector.poll()
    assert kv.lookup(follow.all_token_ids) == 8
    assert kv.allocate("b", follow.all_token_ids)
    connector.on_admitted(follow)
    kv.free("b")
    kv.check_invariants()


def test_an_abort_during_a_load_releases_the_staged_pages_only_when_the_copy_is_done(full):
    kv, connector = full
    _run_turn(kv, connector, _request("a", range(100, 118)))
    connector.take_transfers()
    _evict_everything(kv)
    follow = _request("b", list(range(100, 118)) + [7] * 6)
    assert connector.hold(follow)
    connector.drop(follow)
    assert kv.pool.num_free == kv.pool.num_pages - 1 - 4  # the worker may still write them
    _complete(connector)
    assert connector.poll() == []
    assert kv.pool.num_free == kv.pool.num_pages - 1 and connector.num_held == 0
    kv.check_invariants()


def test_no_room_to_stage_means_no_load(tmp_path):
    kv = KVCacheManager.from_specs([FULL], 8, block_size=BLOCK, cache_on_allocate=False)
    connector = OffloadConnector(kv, host=HostPageIndex(1, 32))
    _run_turn(kv, connector, _request("a", range(100, 124)))  # 6 pages of a 7-page pool
    connector.take_transfers()
    _evict_everything(kv)
    assert kv.allocate("other", list(range(500, 512)))  # 3 pages held elsewhere: 4 free, 6 needed
    assert connector.hold(_request("b", list(range(100, 124)) + [1])) is False


def test_one_load_attempt_per_admission(full):
    kv, connector = full
    _run_turn(kv, connector, _request("a", range(100, 118)))
    connector.take_transfers()
    _evict_everything(kv)
    follow = _request("b", list(range(100, 118)) + [7] * 6)
    assert connector.hold(follow)
    _complete(connector, failed=[(0, h) for h in kv.prepare(follow.all_token_ids, None)[1]])
    connector.poll()
    assert connector.hold(follow) is False  # every page failed: it recomputes instead of retrying


def test_pages_a_tier_holds_are_not_stored_again_and_a_degraded_disk_takes_no_stores(full):
    kv, connector = full
    _run_turn(kv, connector, _request("a", range(100, 118)))
    connector.take_transfers()
    connector.disk.write((0, kv.prepare(list(range(100, 118)), None)[1][0]), b"x" * 16)
    connector.health["disk"].fail("disk_full", "test", stores_only=True)
    _run_turn(kv, connector, _request("b", list(range(100, 118)) + list(range(200, 208))))
    stores = connector.take_transfers().stores
    assert len(stores[0].keys) == 2 and stores[0].disk_rows == []  # only the 2 new pages, host only
    assert connector.health["disk"].usable()  # a full disk still serves the pages it has


def test_marconi_retention_stores_only_the_prefix_a_second_turn_shared(tmp_path):
    kv = KVCacheManager.from_specs([FULL], 64, block_size=BLOCK, cache_on_allocate=False)
    connector = OffloadConnector(kv, host=HostPageIndex(1, 32), retention="marconi")
    _run_turn(kv, connector, _request("a", range(100, 116)))
    assert connector.take_transfers() is None  # seen once: nothing stored
    _run_turn(kv, connector, _request("b", list(range(100, 108)) + list(range(300, 308))))
    stores = connector.take_transfers().stores
    assert len(stores[0].keys) == 2  # the 2 shared pages
    _run_turn(kv, connector, _request("c", list(range(400, 412)), hints=AgentHints(branch_point=True)))
    assert len(connector.take_transfers().stores[0].keys) == 3  # a branch point stores its whole prompt


def test_a_recurrent_state_checkpoint_goes_through_the_tiers_under_its_checkpoint_hash():
    kv = KVCacheManager.from_specs([FULL, STATE], 64, block_size=BLOCK, cache_on_allocate=False)
    connector = OffloadConnector(kv, host=HostPageIndex(2, 32))
    turn = _request("a", range(100, 118))  # checkpoints at 8 and 16 tokens
    assert kv.allocate("a", turn.all_token_ids)
    for computed in (8, 16, 18):  # as the scheduler caches blocks step by step
        kv.cache_blocks("a", computed)
        kv.take_pending_copies()
    connector.on_turn_end(turn)
    kv.free("a")
    stores = connector.take_transfers().stores
    state_group = next(g.group_id for g in kv.groups if g.group.spec.hit_rule == "checkpoint")
    hashes = kv.prepare(turn.all_token_ids, None)[1]
    state_keys = [key for job in stores if job.group == state_group for key in job.keys]
    assert state_keys == [hashes[3]]  # interval retention keeps the last checkpoint: 16 tokens
    _evict_everything(kv)
    follow = _request("b", list(range(100, 118)) + [5] * 5)
    assert connector.lookup(follow.all_token_ids)["host"] == 5  # 4 attention pages + the state at 16
    assert connector.hold(follow)
    _complete(connector)
    connector.poll()
    assert kv.allocate("b", follow.all_token_ids) and kv.num_cached_tokens("b") == 16
    copies = kv.take_pending_copies()
    assert len(copies) == 1 and copies[0][0] == state_group  # restored into the running page as any hit
    connector.on_admitted(follow)
    kv.free("b")
    kv.check_invariants()
    assert np.count_nonzero(kv.pool.ref_counts[1:]) == 0


def test_a_load_waits_for_room_counting_the_free_resident_pages_it_holds_too():
    kv = KVCacheManager.from_specs([FULL], 17, block_size=BLOCK, cache_on_allocate=False)  # 16 usable pages
    connector = OffloadConnector(kv, host=HostPageIndex(1, 32))
    _run_turn(kv, connector, _request("a", range(100, 140)))  # 10 pages, stored to the host
    connector.take_transfers()
    assert kv.allocate("other", list(range(500, 532)))  # 8 pages held: 2 of a's are evicted
    for page in list(kv.pool.cached[0].values())[5:]:
        kv.pool.evict(page)  # a's first 5 pages stay resident (and free), the rest only in the host tier
    follow = _request("b", list(range(100, 140)) + [1])
    assert kv.pool.num_free == 8 and connector.lookup(follow.all_token_ids)["host"] == 5
    # 5 resident pages to hold + 5 to stage + a 1-page watermark > 8 free: not now (and no OutOfPagesError).
    assert connector.hold(follow) is False
    kv.check_invariants()
    # Still no room: the deferred load is not planned again at every admission attempt.
    assert connector.hold(follow) is False and connector.hold(follow) is False
    assert connector.stats.get("load_deferred", "all") == 1
    kv.free("other")  # room again: the next admission attempt stages the load
    assert connector.hold(follow) is True
    assert connector.stats.get("load_deferred", "all") == 1 and not connector._deferred


def _small_pool_with_a_stored_turn() -> tuple[KVCacheManager, OffloadConnector, list[int]]:
    """A 7-page pool whose 6-page turn went to the host tier and left the device."""
    kv = KVCacheManager.from_specs([FULL], 8, block_size=BLOCK, cache_on_allocate=False)
    connector = OffloadConnector(kv, host=HostPageIndex(1, 32))
    _run_turn(kv, connector, _request("a", range(100, 124)))
    connector.take_transfers()
    _evict_everything(kv)
    return kv, connector, list(range(100, 124)) + [1]


def test_a_failed_load_releases_every_page_it_held_at_once():
    kv, connector, tokens = _small_pool_with_a_stored_turn()
    follow = _request("b", tokens)
    hashes = kv.prepare(tokens, None)[1]
    assert connector.hold(follow) and kv.pool.num_free == 1  # 6 staged pages of 7
    _complete(connector, failed=[(0, hashes[2])])
    assert connector.poll() == [follow]
    assert kv.pool.num_free == kv.pool.num_pages - 1  # nothing held: the recompute has the whole pool
    assert kv.lookup(tokens) == 2 * BLOCK  # the pages loaded before the failed one stay cached
    assert connector.hold(follow) is False  # no second load of the same pages
    assert kv.allocate("b", tokens) and kv.num_cached_tokens("b") == 2 * BLOCK  # 7 pages: 5 new, 2 hit
    connector.on_admitted(follow)
    kv.free("b")
    kv.check_invariants()
    assert connector.stats.get("failed_loads", "all") == 1


def test_a_failed_load_is_recomputed_in_the_same_scheduling_pass_and_the_request_behind_it_follows():
    from agentjax.config import EngineConfig
    from agentjax.scheduler.scheduler import Scheduler

    kv, connector, tokens = _small_pool_with_a_stored_turn()
    scheduler = Scheduler(EngineConfig(block_size=BLOCK, max_num_batched_tokens=64), kv, offload=connector)
    first, behind = _request("b", tokens), _request("c", range(300, 310))
    behind.arrival_index = 1
    scheduler.add(first)
    scheduler.add(behind)
    out = scheduler.schedule()
    assert out.scheduled == [] and connector.num_held == 1 and scheduler.num_waiting == 2  # b parked, c behind
    [job] = out.kv_transfers.loads  # the worker reports its third page corrupt
    connector.results.put(("load", job.job_id, {(0, kv.prepare(tokens, None)[1][2]): ("checksum", "test")}))
    out = scheduler.schedule()  # the failure, its release and b's admission: one pass
    assert [item.request.request_id for item in out.scheduled] == ["b"]
    assert first.num_computed_tokens == 2 * BLOCK and scheduler.num_waiting == 1
    scheduler.update_from_output(out, [0])
    scheduler.finish(first)
    out = scheduler.schedule()
    assert [item.request.request_id for item in out.scheduled] == ["c"]
    scheduler.update_from_output(out, [0])
    scheduler.finish(behind)
    connector.take_transfers()
    kv.check_invariants()
    assert np.count_nonzero(kv.pool.ref_counts[1:]) == 0 and not scheduler.has_unfinished()


def test_num_held_counts_only_the_requests_out_of_the_waiting_queue(full):
    kv, connector = full
    _run_turn(kv, connector, _request("a", range(100, 118)))
    connector.take_transfers()
    _evict_everything(kv)
    follow = _request("b", list(range(100, 118)) + [7] * 6)
    assert connector.hold(follow) and connector.num_held == 1 and connector.waiting_on_tiers
    _complete(connector)
    assert connector.poll() == [follow]
    assert connector.num_held == 0 and not connector.waiting_on_tiers  # back in the queue: counted there only
    connector.on_admitted(follow)


def test_a_loaded_request_never_holds_pages_a_request_ahead_of_it_needs():
    """A request that goes ahead of a loaded one (a higher priority, or a preempted request's earlier
    arrival) and needs the pool finds the loaded pages free: the load released them when it finished."""
    from agentjax.config import EngineConfig
    from agentjax.scheduler.scheduler import Scheduler

    kv = KVCacheManager.from_specs([FULL], 12, block_size=BLOCK, cache_on_allocate=False)  # 11 usable pages
    connector = OffloadConnector(kv, host=HostPageIndex(1, 32))
    _run_turn(kv, connector, _request("a", range(100, 120)))  # 5 pages, stored to the host tier
    connector.take_transfers()
    _evict_everything(kv)
    scheduler = Scheduler(EngineConfig(block_size=BLOCK, max_num_batched_tokens=64), kv, offload=connector)
    loaded = _request("x", list(range(100, 120)) + [1])
    scheduler.add(loaded)
    out = scheduler.schedule()
    assert connector.num_held == 1 and kv.pool.num_free == 6
    urgent = _request("z", range(500, 532))  # 8 pages: more than are free while the load runs
    urgent.priority, urgent.arrival_index = -1, 1
    scheduler.add(urgent)
    assert scheduler.schedule().scheduled == []
    [job] = out.kv_transfers.loads
    connector.results.put(("load", job.job_id, {}))
    out = scheduler.schedule()  # the load is done and holds nothing: z goes first
    assert [item.request.request_id for item in out.scheduled] == ["z"]
    assert connector.stats.get("pages_loaded", "host") == 5
    scheduler.update_from_output(out, [0])
    scheduler.finish(urgent)
    out = scheduler.schedule()  # then x, on what z left of its loaded pages
    assert [item.request.request_id for item in out.scheduled] == ["x"]
    scheduler.update_from_output(out, [0])
    scheduler.finish(loaded)
    connector.take_transfers()
    kv.check_invariants()
    assert np.count_nonzero(kv.pool.ref_counts[1:]) == 0 and not scheduler.has_unfinished()
