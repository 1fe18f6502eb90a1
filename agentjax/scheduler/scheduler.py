"""The scheduler: which requests run how many tokens this step, and which pages they hold.

Host only: never imports jax. Each step it serves running requests first (decodes, then the next
chunk of unfinished prefills), then admits waiting requests by priority and arrival, all under a
token budget and a sequence cap. A request that cannot grow is handled by preemption: the
lowest-priority, latest request gives its pages back and is recomputed later.
"""
from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass, field

from agentjax.config import EngineConfig
from agentjax.kv import KVCacheManager
from agentjax.scheduler.request import Request, RequestState

logger = logging.getLogger(__name__)

# Smallest prefill chunk the adaptive threshold hands out, so long prompts still progress.
ADAPTIVE_MIN_CHUNK = 32


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    is_prefill: bool


@dataclass
class SchedulerOutput:
    step_index: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    admissions_allowed: bool = True

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Token-budget scheduler with chunked prefill, prefill caps, admission cadence and preemption.

    `long_prefill_token_threshold` > 0 caps the prefill tokens one request may run in a step;
    -1 selects the adaptive cap: the budget shared evenly among the requests that want tokens
    this step (never below `ADAPTIVE_MIN_CHUNK`), so a long prompt yields to many short turns
    and runs at full width when alone. `prefill_schedule_interval=N` admits new requests only on
    steps whose index is a multiple of N; the steps between are pure decode and continuation.
    """

    def __init__(self, config: EngineConfig, kv: KVCacheManager, watermark: float = 0.01):
        self.config = config
        self.kv = kv
        self.watermark_blocks = int(watermark * kv.pool.num_pages)
        self.running: list[Request] = []
        self._waiting: list[tuple[int, int, Request]] = []  # heap of (priority, arrival_index, request)
        self.step_index = 0
        self.num_preemptions = 0

    # -- queues ----------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.state = RequestState.WAITING
        heapq.heappush(self._waiting, (request.priority, request.arrival_index, request))

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)  # `remove` takes finished and aborted requests out at once

    def has_unfinished(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    def remove(self, request: Request) -> None:
        """Drop a request from the queues and release its pages (finish or abort)."""
        if request in self.running:
            self.running.remove(request)
        self._waiting = [entry for entry in self._waiting if entry[2] is not request]
        heapq.heapify(self._waiting)
        self.kv.free(request.request_id)

    # -- one step --------------------------------------------------------------------------------
    def _prefill_cap(self, wanting: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0:
            return threshold
        if threshold < 0:  # adaptive
            return max(ADAPTIVE_MIN_CHUNK, self.config.max_num_batched_tokens // max(1, wanting))
        return self.config.max_num_batched_tokens

    def _preempt_one(self, candidates: list[Request]) -> Request | None:
        """Free the lowest-priority, latest of `candidates` (running, not yet scheduled this step)."""
        if not candidates:
            return None
        victim = max(candidates, key=lambda r: (r.priority, r.arrival_index))
        candidates.remove(victim)
        self._requeue(victim)
        return victim

    def _requeue(self, request: Request) -> None:
        """Preemption by recompute: release the pages, go back to waiting from token 0."""
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.state = RequestState.PREEMPTED
        heapq.heappush(self._waiting, (request.priority, request.arrival_index, request))
        self.num_preemptions += 1

    def _grow(self, request: Request, unscheduled: list[Request], out: SchedulerOutput) -> bool:
        """Give `request` pages for every token it holds, preempting later requests if needed."""
        have = self.kv.num_tokens(request.request_id)
        prompt_len = len(request.prompt_token_ids)
        if have >= request.num_tokens:
            return True
        if have >= prompt_len:
            missing = request.output_token_ids[have - prompt_len :]
        else:
            missing = request.prompt_token_ids[have:] + request.output_token_ids
        while not self.kv.append(request.request_id, missing):
            victim = self._preempt_one(unscheduled)
            if victim is None:
                return False
            out.preempted.append(victim.request_id)
        return True

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(self.step_index)
        budget = self.config.max_num_batched_tokens
        wanting = len(self.running) + min(self.num_waiting, self.config.max_num_seqs)
        cap = self._prefill_cap(wanting)
        unscheduled = sorted(self.running, key=lambda r: (r.priority, r.arrival_index))
        while unscheduled:
            if budget <= 0 or len(out.scheduled) >= self.config.max_num_seqs:
                break
            request = unscheduled.pop(0)
            remaining = request.num_tokens - request.num_computed_tokens
            prefill = remaining > 1 or not request.output_token_ids
            count = min(remaining, budget, cap if prefill else remaining)
            if not self._grow(request, unscheduled, out):
                self._requeue(request)  # nothing later to preempt: this one waits
                out.preempted.append(request.request_id)
                continue
            out.scheduled.append(ScheduledRequest(request, count, prefill))
            budget -= count

        out.admissions_allowed = self.step_index % self.config.prefill_schedule_interval == 0
        while out.admissions_allowed and self._waiting and budget > 0 and len(out.scheduled) < self.config.max_num_seqs:
            _, _, request = self._waiting[0]
            if request.is_finished:
                heapq.heappop(self._waiting)
                continue
            if not self._admit(request):
                break
            heapq.heappop(self._waiting)
            remaining = request.num_tokens - request.num_computed_tokens
            count = min(remaining, budget, cap)
            self.running.append(request)
            out.admitted.append(request.request_id)
            out.scheduled.append(ScheduledRequest(request, count, True))
            budget -= count
        self.step_index += 1
        return out

    def update_from_output(self, out: SchedulerOutput, sampled: list[int]) -> list[tuple[Request, int]]:
        """Advance the scheduled requests after the model ran; `sampled` has a token per row.

        Written pages become cacheable. Rows that finished their tokens get the sampled token
        appended and are returned as `(request, token)`; the sample of a prefill chunk that is not
        the last is discarded. Finishing (stop checks) is the caller's job, via `remove`.
        """
        produced = []
        block_size = self.kv.block_size
        for item, token in zip(out.scheduled, sampled):
            request = item.request
            before = request.num_computed_tokens
            request.num_computed_tokens += item.num_new_tokens
            if request.num_computed_tokens // block_size > before // block_size:  # a page filled up
                self.kv.cache_blocks(request.request_id, request.num_computed_tokens)
            if request.num_computed_tokens == request.num_tokens:
                request.output_token_ids.append(int(token))
                produced.append((request, int(token)))
        return produced

    def _admit(self, request: Request) -> bool:
        """Reserve pages for all the request's tokens (cached prefix reused), keeping a watermark."""
        tokens = request.all_token_ids
        kv = self.kv
        if not kv.can_allocate(tokens, request.cache_salt):
            return False
        hit = kv.lookup(tokens, request.cache_salt)
        new_pages = -(-len(tokens) // kv.block_size) - hit // kv.block_size
        if self.running and kv.num_free_blocks - new_pages < self.watermark_blocks:
            return False
        if not kv.allocate(request.request_id, tokens, request.cache_salt):
            return False
        cached = kv.num_cached_tokens(request.request_id)
        request.num_computed_tokens = cached
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = cached
        request.state = RequestState.RUNNING
        return True
