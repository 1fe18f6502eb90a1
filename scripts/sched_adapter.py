"""agentjax's scheduler behind the sched-mode interface of the vLLM baseline harness (no model).

`../shared/bench/vllm_baseline/bench.py::run_sched_closed_loop` drives any object with

    add_turn(req_id, token_ids, output_len)     submit one turn
    has_unfinished() -> bool
    step() -> StepResult                        one schedule() + fake model + update_from_output()
    stats() -> dict

`AgentjaxSchedulerAdapter` runs `agentjax.scheduler.Scheduler` on a single-group
`agentjax.kv.KVCacheManager` with the engine's semantics (`cache_on_allocate=False`: pages become
hittable only when `update_from_output` calls `cache_blocks`). The fake model returns token 7 for
every scheduled row; `update_from_output` keeps it only for rows that finished their prefill (or
decode), exactly what vLLM's harness does with `not request.is_prefill_chunk`.

Timing has the scope of vLLM's step: `schedule_ns` is `Scheduler.schedule()`, `update_ns` is
`Scheduler.update_from_output()` plus the finish handling (length check, `Scheduler.remove`, which
frees the pages), as vLLM's `update_from_output` also frees finished requests. Building the fake
output and the `Request` objects is outside both, as in the vLLM adapter.

Host only: needs numpy but not jax, so it runs in the harness's Python 3.11 venv with the repo on
PYTHONPATH (agentjax itself declares Python >= 3.12 for installation).
"""
from __future__ import annotations

import time

from agentjax.config import EngineConfig
from agentjax.kv import KVCacheManager
from agentjax.sampling_params import SamplingParams
from agentjax.scheduler import Request, RequestState, Scheduler

try:  # the harness's result type, when its folder is on sys.path (bench_scheduler.py puts it there)
    from common import StepResult
except ImportError:  # same fields, so the adapter also works on its own (tests)
    from dataclasses import dataclass

    @dataclass
    class StepResult:
        finished: list[str]
        schedule_ns: int
        update_ns: int
        num_scheduled_tokens: int
        num_scheduled_reqs: int
        num_preempted: int

FAKE_TOKEN_ID = 7


class AgentjaxSchedulerAdapter:
    name = "agentjax-scheduler"

    def __init__(self, num_blocks: int, block_size: int = 16, max_num_batched_tokens: int = 8192,
                 long_prefill_token_threshold: int = 0, max_num_seqs: int = 256,
                 max_model_len: int = 1 << 20, enable_prefix_caching: bool = True,
                 watermark: float | None = None):
        """`watermark=None` keeps the scheduler's default (the engine's); vLLM v1 has none (0.0)."""
        self.config = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks,
                                   max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                   max_model_len=max_model_len,
                                   long_prefill_token_threshold=long_prefill_token_threshold,
                                   enable_prefix_caching=enable_prefix_caching)
        self.max_model_len = max_model_len
        self.kv = KVCacheManager.full_attention(num_blocks=num_blocks, block_size=block_size,
                                                enable_caching=enable_prefix_caching, cache_on_allocate=False)
        kw = {} if watermark is None else {"watermark": watermark}
        self.scheduler = Scheduler(self.config, self.kv, **kw)
        self._arrivals = 0
        self.t_make_ns = 0
        self.t_add_ns = 0
        # vLLM's PrefixCacheStats definition: at each admission, queries += request.num_tokens and
        # hits += the cached tokens it starts from; re-admissions after a preemption apart.
        self.hits = self.queries = self.requests = 0
        self.pre_hits = self.pre_queries = self.pre_requests = 0
        self.preemptions = 0
        self.max_running = 0
        self.max_waiting = 0
        self.finished_turns = 0

    def add_turn(self, req_id: str, token_ids: list[int], output_len: int) -> None:
        t0 = time.perf_counter_ns()
        request = Request(req_id, list(token_ids), SamplingParams(max_tokens=output_len, ignore_eos=True,
                                                                   temperature=0.0),
                          stop_token_ids=frozenset(), arrival_index=self._arrivals)
        self._arrivals += 1
        t1 = time.perf_counter_ns()
        self.scheduler.add(request)
        self.t_make_ns += t1 - t0
        self.t_add_ns += time.perf_counter_ns() - t1

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> StepResult:
        s = self.scheduler
        t0 = time.perf_counter_ns()
        plan = s.schedule()
        t1 = time.perf_counter_ns()
        # Bookkeeping and the fake model, untimed. Admitted rows come last in plan.scheduled; their
        # num_computed_tokens is still the prefix hit (update_from_output has not advanced it).
        if plan.admitted:
            for item in plan.scheduled[len(plan.scheduled) - len(plan.admitted):]:
                r = item.request
                if r.num_preemptions:
                    self.pre_requests += 1
                    self.pre_queries += r.num_tokens
                    self.pre_hits += r.num_computed_tokens
                else:
                    self.requests += 1
                    self.queries += r.num_tokens
                    self.hits += r.num_computed_tokens
        sampled = [FAKE_TOKEN_ID] * len(plan.scheduled)
        t2 = time.perf_counter_ns()
        produced = s.update_from_output(plan, sampled)
        finished: list[str] = []
        for request, _ in produced:
            if (len(request.output_token_ids) >= request.sampling.max_tokens
                    or request.num_tokens >= self.max_model_len):
                request.finish_reason = "length"
                request.state = RequestState.FINISHED
                s.remove(request)
                finished.append(request.request_id)
        t3 = time.perf_counter_ns()
        self.finished_turns += len(finished)
        n_pre = len(plan.preempted)
        self.preemptions += n_pre
        self.max_running = max(self.max_running, len(s.running))
        self.max_waiting = max(self.max_waiting, len(s._waiting))
        return StepResult(finished, t1 - t0, t3 - t2, plan.num_tokens, len(plan.scheduled), n_pre)

    def stats(self) -> dict:
        kv = self.kv.stats()
        return {
            "prefix_hit_tokens": self.hits,
            "prefix_query_tokens": self.queries,
            "prefix_hit_rate": self.hits / max(1, self.queries),
            "prefix_requests": self.requests,
            "preempted_resume_hit_rate": self.pre_hits / max(1, self.pre_queries),
            "preempted_resumes": self.pre_requests,
            "preemptions": self.preemptions,
            "scheduler_num_preemptions": self.scheduler.num_preemptions,
            "max_running": self.max_running,
            "max_waiting": self.max_waiting,
            "make_request_total_s": self.t_make_ns / 1e9,
            "add_request_total_s": self.t_add_ns / 1e9,
            # agentjax's own counters: tokens of every successful allocation, re-admissions included
            "kv_queries": kv["queries"], "kv_hits": kv["hits"], "kv_hit_rate": kv["hit_rate"],
            "kv_evictions": kv["evictions"], "kv_rollbacks": kv["rollbacks"],
            "kv_blocks_hashed": kv["blocks_hashed"], "kv_blocks_hash_reused": kv["blocks_hash_reused"],
        }


if __name__ == "__main__":  # selftest, mirrors vllm_adapter.py's
    sa = AgentjaxSchedulerAdapter(num_blocks=64, max_model_len=256)
    sa.add_turn("x", list(range(100, 140)), 3)
    steps = 0
    while sa.has_unfinished():
        r = sa.step()
        steps += 1
    assert steps == 3, steps
    assert r.finished == ["x"], r
    sa.add_turn("y", list(range(100, 140)), 1)
    r = sa.step()
    assert r.finished == ["y"] and sa.hits == 32, (r, sa.hits)
    print(f"selftest OK steps={steps} hit={sa.stats()['prefix_hit_rate']:.3f}")
