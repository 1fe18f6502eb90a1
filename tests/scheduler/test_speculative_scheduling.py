"""The scheduler with speculative decoding, without a model: decode rows carry n-gram drafts that the
token budget counts, the target's tokens decide how many stay, and rejected drafts leave no pages and
no cached hashes behind."""
from __future__ import annotations

from agentjax.config import EngineConfig
from agentjax.kv import KVCacheManager
from agentjax.kv.specs import FullAttentionSpec
from agentjax.sampling_params import SamplingParams
from agentjax.scheduler.request import Request
from agentjax.scheduler.scheduler import Scheduler
from agentjax.spec_decode import SpeculativeConfig, Speculator

BLOCK = 4
LOOP = [11, 12, 13, 14, 15]


def _scheduler(k=3, **settings) -> Scheduler:
    kv = KVCacheManager.from_specs([FullAttentionSpec()], 64, BLOCK, scale_tokens_per_page=False,
                                   cache_on_allocate=False)
    speculator = Speculator(SpeculativeConfig("ngram", k, prompt_lookup_min=2, prompt_lookup_max=3))
    return Scheduler(EngineConfig(block_size=BLOCK, **settings), kv, speculator=speculator, max_model_len=64)


def _request(request_id="a", max_tokens=12, arrival=0) -> Request:
    return Request(request_id, LOOP * 2 + LOOP[:2], SamplingParams(max_tokens=max_tokens, temperature=0.0),
                   frozenset(), arrival_index=arrival)


def _prefill(scheduler: Scheduler, request: Request, token: int) -> None:
    scheduler.add(request)
    plan = scheduler.schedule()
    assert plan.scheduled[0].is_prefill and not plan.scheduled[0].draft_token_ids
    scheduler.update_from_output(plan, [token])


def test_a_decode_row_carries_the_ngram_drafts_and_keeps_those_the_target_confirms():
    scheduler = _scheduler(k=3)
    request = _request()
    _prefill(scheduler, request, 13)  # ... 11 12 | 13: the loop continues with 14 15 11
    plan = scheduler.schedule()
    item = plan.scheduled[0]
    assert item.draft_token_ids == [14, 15, 11] and item.num_new_tokens == 4
    computed, length = request.num_computed_tokens, request.num_tokens
    produced = scheduler.update_from_output(plan, [[14, 15, 99, 5]])  # the target parts at the third
    assert produced == [(request, [14, 15, 99])]
    assert request.output_token_ids == [13, 14, 15, 99]
    assert request.num_computed_tokens == computed + 3  # 13 and the two accepted drafts
    assert request.num_tokens == length + 3 and scheduler.kv.num_tokens("a") == request.num_computed_tokens
    assert scheduler.speculator.stats.snapshot()["accepted_per_position"] == [1, 1, 0]
    scheduler.kv.check_invariants()


def _loop_continuation(plan) -> list[list[int]]:
    """A target that continues the loop: every n-gram draft confirmed, then the token after them."""
    rows = []
    for item in plan.scheduled:
        last, tokens = item.request.all_token_ids[-1], []
        for _ in range(1 + len(item.draft_token_ids)):
            last = LOOP[(LOOP.index(last) + 1) % len(LOOP)]
            tokens.append(last)
        rows.append(tokens)
    return rows


def test_the_token_budget_counts_draft_tokens():
    scheduler = _scheduler(k=3, max_num_batched_tokens=6)
    first, second = _request("a", max_tokens=40), _request("b", max_tokens=40, arrival=1)
    scheduler.add(first)
    scheduler.add(second)
    plan = scheduler.schedule()  # two prompts of 12 tokens under a budget of 6: chunks, and drafts in between
    while any(item.is_prefill for item in plan.scheduled):
        assert plan.num_tokens <= 6
        scheduler.update_from_output(plan, _loop_continuation(plan))
        plan = scheduler.schedule()
    counts = [item.num_new_tokens for item in plan.scheduled]
    assert counts == [4, 2]  # the first row's token and 3 drafts, the second's token and the 1 draft left
    assert [len(item.draft_token_ids) for item in plan.scheduled] == [3, 1]
    assert scheduler.speculator.stats.num_accepted_tokens == scheduler.speculator.stats.num_draft_tokens > 0


def test_drafts_never_run_past_max_tokens():
    scheduler = _scheduler(k=3)
    request = _request(max_tokens=3)
    _prefill(scheduler, request, 13)
    plan = scheduler.schedule()
    assert plan.scheduled[0].draft_token_ids == [14]  # 1 generated + 1 sampled + 1 draft = max_tokens


def test_rejected_drafts_release_their_pages_and_never_reach_the_prefix_cache():
    scheduler = _scheduler(k=5)
    request = _request()
    _prefill(scheduler, request, 13)  # 12 prompt tokens computed; token 13 goes at position 12
    plan = scheduler.schedule()
    assert plan.scheduled[0].draft_token_ids == [14, 15, 11, 12, 13]
    assert len(plan.scheduled[0].page_tables[0]) == 5  # positions 12..17 reach page 4
    scheduler.update_from_output(plan, [[7] * 6])  # every draft rejected
    assert len(scheduler.kv.block_ids("a")[0]) == 4  # the page that only drafts reached went back
    assert request.output_token_ids == [13, 7] and request.num_computed_tokens == 13
    scheduler.finish(request)
    kv = scheduler.kv
    assert kv.lookup(request.prompt_token_ids + [13, 14, 15, 11, 12]) == 12  # the prompt's pages, no draft's
    kv.check_invariants()
