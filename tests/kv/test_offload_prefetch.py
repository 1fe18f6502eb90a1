"""Prefetch (agentjax/kv/offload/prefetch.py): the real Scheduler, KVCacheManager and hint-aware KV policy
on a test clock, with a host tier. A paused session whose pages left the device gets them back once the
policy says its next turn is near, and that turn then hits on the device; a prefetch never takes pages
the policy pinned. The worker is played by the test, which reports the loads done."""
from __future__ import annotations

from agentjax.config import EngineConfig
from agentjax.kv import FullAttentionSpec, KVCacheManager
from agentjax.kv.offload.connector import OffloadConnector
from agentjax.kv.offload.host import HostPageIndex
from agentjax.kv.policies import HintAwarePolicy
from agentjax.kv.policy_order import PolicyEvictionOrder
from agentjax.sampling_params import SamplingParams
from agentjax.scheduler.request import AgentHints, Request, RequestState
from agentjax.scheduler.scheduler import Scheduler

BLOCK = 4
PROMPT = list(range(100, 117))  # 17 tokens: 4 whole pages


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def setup(num_pages: int = 32):
    clock = Clock()
    policy = HintAwarePolicy(clock, prefetch_lead_s=5.0)
    kv = KVCacheManager.from_specs([FullAttentionSpec()], num_pages, BLOCK, cache_on_allocate=False,
                                   eviction_order=PolicyEvictionOrder(policy))
    connector = OffloadConnector(kv, host=HostPageIndex(1, 64))
    scheduler = Scheduler(EngineConfig(block_size=BLOCK, max_num_batched_tokens=64), kv, offload=connector)
    return clock, policy, kv, connector, scheduler


def step(scheduler: Scheduler, connector: OffloadConnector) -> list:
    """One step; loads complete at once (an idle worker); requests with their reply end. Returns the loads."""
    plan = scheduler.schedule()
    loads = list(plan.kv_transfers.loads) if plan.kv_transfers is not None else []
    for job in loads:
        connector.results.put(("load", job.job_id, {}))
    for request, _ in scheduler.update_from_output(plan, [7] * len(plan.scheduled)):
        if len(request.output_token_ids) >= request.sampling.max_tokens:
            request.state = RequestState.FINISHED
            scheduler.finish(request)
    return loads


def turn(scheduler, connector, request_id: str, prompt: list[int], session: str, **hints) -> Request:
    request = Request(request_id, prompt, SamplingParams(max_tokens=1), frozenset(), session_id=session,
                      hints=AgentHints(session_id=session, **hints))
    scheduler.add(request)
    while scheduler.has_unfinished():
        step(scheduler, connector)
    return request


def evict_device_cache(kv: KVCacheManager) -> None:
    for page in range(1, kv.pool.num_pages):
        if kv.pool.ref_counts[page] == 0:
            kv.pool.evict(page)


def test_a_paused_sessions_pages_come_back_before_its_next_turn_and_the_turn_hits_on_the_device():
    clock, policy, kv, connector, scheduler = setup()
    first = turn(scheduler, connector, "t1", PROMPT, "s", expected_next_turn_s=20.0)
    connector.take_transfers()  # the stores: the host index holds the turn's pages from now on
    evict_device_cache(kv)
    clock.now = 10.0  # 10 s before the expected turn: not due yet
    assert step(scheduler, connector) == []
    clock.now = 16.0  # within the 5 s lead
    [load] = step(scheduler, connector)
    assert load.request_id == ("prefetch", "s") and len(load.pages) == 4
    assert {transfer.tier for transfer in load.pages} == {"host"}
    step(scheduler, connector)  # the load's completion: its pages are cached and pinned for the turn
    assert kv.lookup(first.all_token_ids + [9]) == 16 and policy.num_pinned() >= 4
    snapshot = connector.snapshot()
    assert snapshot["prefetches"] == 1 and snapshot["pages_prefetched"] == 4 and snapshot["pages_loaded"]["host"] == 4
    clock.now = 20.0
    second = turn(scheduler, connector, "t2", first.all_token_ids + [9, 10, 11], "s")
    assert second.num_cached_tokens == 16  # from the device: no load was staged for the turn
    assert connector.stats.get("load_requests", "all") == 0
    assert policy.unpin(("prefetch", "s")) == 0  # the turn's end released the prefetch pin


def test_a_prefetch_takes_no_page_the_policy_pinned():
    clock, policy, kv, connector, scheduler = setup(num_pages=12)  # 11 usable pages
    turn(scheduler, connector, "t1", PROMPT, "s", expected_next_turn_s=20.0)
    connector.take_transfers()
    evict_device_cache(kv)
    # Another session's turn fills the pool, and its soft pin holds every page it leaves cached.
    turn(scheduler, connector, "o1", list(range(500, 537)), "other", expected_next_turn_s=300.0)
    connector.take_transfers()
    free_unpinned = kv.pool.num_free - kv.pool.eviction_order.num_pinned()[1]
    assert free_unpinned < 4 + connector.watermark
    clock.now = 16.0
    assert step(scheduler, connector) == []
    assert connector.stats.get("prefetch_deferred", "all") == 1
    clock.now = 17.0  # still no room: deferred again, never staged
    assert step(scheduler, connector) == [] and connector.stats.get("prefetch_deferred", "all") == 2
