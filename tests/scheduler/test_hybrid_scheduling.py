"""The scheduler on a hybrid KV plan, without a model: page tables per group in its output, window
groups reserved chunk by chunk, prefill chunks cut on recurrent-state boundaries, and the state
saves and restores it hands the device as copies."""
from __future__ import annotations

from agentjax.config import EngineConfig
from agentjax.kv import KVCacheManager
from agentjax.kv.specs import FullAttentionSpec, RecurrentStateSpec, SlidingWindowSpec
from agentjax.sampling_params import SamplingParams
from agentjax.scheduler.request import Request
from agentjax.scheduler.scheduler import Scheduler

BLOCK = 16
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def _scheduler(specs, num_blocks=256, **settings) -> Scheduler:
    kv = KVCacheManager.from_specs(specs, num_blocks, BLOCK, scale_tokens_per_page=False, cache_on_allocate=False)
    return Scheduler(EngineConfig(block_size=BLOCK, **settings), kv)


def _request(request_id: str, prompt: list[int], arrival: int = 0) -> Request:
    return Request(request_id, prompt, GREEDY, frozenset(), arrival_index=arrival)


def _run(scheduler: Scheduler, request: Request, on_step=None) -> list:
    """Schedule until the request has its tokens; returns the scheduler outputs."""
    scheduler.add(request)
    plans = []
    while len(request.output_token_ids) < GREEDY.max_tokens:
        plan = scheduler.schedule()
        plans.append(plan)
        scheduler.update_from_output(plan, [7] * len(plan.scheduled))
        if on_step is not None:
            on_step(plan)
    scheduler.finish(request)
    return plans


def test_rows_carry_one_page_table_per_group_and_a_state_group_holds_its_running_page():
    specs = [FullAttentionSpec(), RecurrentStateSpec(bytes_per_state=64, checkpoint_interval=64)]
    scheduler = _scheduler(specs)
    plan = _run(scheduler, _request("a", list(range(1, 41))))[0]
    full, state = plan.scheduled[0].page_tables
    assert len(full) == 3 and all(full)  # 40 prompt tokens in 16-token pages
    assert len(state) == 1 and state[0] not in full  # one running state page, a page of its own


def test_prefill_chunks_end_on_recurrent_state_boundaries_and_a_later_turn_restores_the_last_one():
    specs = [FullAttentionSpec(), RecurrentStateSpec(bytes_per_state=64, checkpoint_interval=64)]
    scheduler = _scheduler(specs, max_num_batched_tokens=2048)
    prompt = list(range(1, 201))
    plans = _run(scheduler, _request("a", prompt))
    assert [p.scheduled[0].num_new_tokens for p in plans[:2]] == [192, 8]  # cut at 192 = 3 x 64
    saves = [copy for p in plans for copy in p.kv_copies]
    assert len(saves) == 1 and saves[0][0] == 1  # the state after 192 tokens, saved once (group 1)
    running_page, checkpoint_page = saves[0][1], saves[0][2]
    assert running_page == plans[0].scheduled[0].page_tables[1][0]

    second = _request("b", prompt + [5] * 40, arrival=1)
    scheduler.add(second)
    plan = scheduler.schedule()
    assert second.num_cached_tokens == 192  # the hit lands on the saved state, not at 200
    restore = [c for c in plan.kv_copies if c[1] == checkpoint_page]
    assert restore == [(1, checkpoint_page, plan.scheduled[0].page_tables[1][0])]


def test_a_sliding_window_group_is_reserved_chunk_by_chunk_and_released_behind_the_window():
    window = 32
    specs = [FullAttentionSpec(), SlidingWindowSpec(sliding_window=window)]
    scheduler = _scheduler(specs, long_prefill_token_threshold=64)
    prompt = list(range(1, 301))
    during, after = [], []

    def held(plan):
        during.append(sum(1 for page in plan.scheduled[0].page_tables[1] if page))
        request = plan.scheduled[0].request
        if not request.is_finished:
            after.append(sum(1 for page in scheduler.kv.block_ids(request.request_id)[1] if page))

    plans = _run(scheduler, _request("a", prompt), on_step=held)
    assert [p.scheduled[0].num_new_tokens for p in plans[:5]] == [64] * 4 + [44]
    chunk_pages = 64 // BLOCK
    assert max(during) <= window // BLOCK + chunk_pages + 1  # the window, the chunk, one partial page
    assert max(after) <= window // BLOCK + 2
    assert scheduler.kv.stats()["running_requests"] == 0  # finished: every page released
    scheduler.kv.check_invariants()
