"""Tests of agentjax/scheduler/scheduler.py that no feature file owns: the waiting queue's head."""
from agentjax.config import EngineConfig
from agentjax.kv import KVCacheManager
from agentjax.sampling_params import SamplingParams
from agentjax.scheduler import Request, Scheduler


def _request(req_id, prompt, max_tokens, arrival):
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0),
                   stop_token_ids=frozenset(), arrival_index=arrival)


def test_a_head_that_waits_for_pages_offers_one_token_list_until_it_is_admitted():
    config = EngineConfig(block_size=4, num_kv_blocks=12, max_num_batched_tokens=64, max_num_seqs=8,
                          max_model_len=256)
    kv = KVCacheManager.full_attention(num_blocks=12, block_size=4, cache_on_allocate=False)
    scheduler = Scheduler(config, kv, watermark=0.0)
    offered = []
    prepare = kv.prepare
    kv.prepare = lambda token_ids, cache_salt=None: (offered.append(token_ids), prepare(token_ids, cache_salt))[1]
    running = _request("a", list(range(100, 132)), 3, 0)  # 8 of the 11 pages
    waiting = _request("b", list(range(200, 224)), 1, 1)  # 6 pages: waits until "a" is done
    scheduler.add(running)
    scheduler.add(waiting)
    for _ in range(3):
        plan = scheduler.schedule()
        assert [item.request.request_id for item in plan.scheduled] == ["a"]
        scheduler.update_from_output(plan, [7] * len(plan.scheduled))
    waits = [tokens for tokens in offered if tokens[0] == 200]
    assert len(waits) >= 6 and all(tokens is waits[0] for tokens in waits)  # lookup + can_allocate, each step
    assert waits[0] == waiting.all_token_ids
    scheduler.remove(running)
    plan = scheduler.schedule()
    assert plan.admitted == ["b"] and plan.scheduled[0].num_new_tokens == 24
