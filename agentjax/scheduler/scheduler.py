"""The scheduler: which requests run how many tokens this step, and which pages they hold.

Host only: never imports jax. Each step it serves running requests first (decodes, then the next
chunk of unfinished prefills), then admits waiting requests by priority and arrival, all under a
token budget and a sequence cap. A request that cannot grow is handled by preemption: the
lowest-priority, latest request gives its pages back and is recomputed later. On the step path it
is the KV manager's one caller: its output carries each row's page tables (one per KV group) and
the state-page copies the device runs first; session turn ends reach the KV policy through it
(`sessions.py`), and prefix pins go through it too.
"""
from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass, field

import numpy as np

from agentjax.buckets import bucket, bucket_below
from agentjax.config import EngineConfig
from agentjax.kv import KVCacheManager
from agentjax.scheduler.request import Request, RequestState
from agentjax.scheduler.sessions import SessionTable

logger = logging.getLogger(__name__)

# Smallest prefill chunk the adaptive threshold hands out, so long prompts still progress.
ADAPTIVE_MIN_CHUNK = 32
# A step is trimmed only to a token bucket of at least this many tokens. Smaller steps are bound by
# reading the weights on a GPU, so their padding costs little there, and a trimmed row always waits a step.
MIN_TRIM_BUCKET = 256


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # the row's tokens, draft tokens included (what the budget counts)
    is_prefill: bool
    page_tables: list[list[int]] = field(default_factory=list)  # one page list per KV group
    # Speculative decoding: draft tokens that follow the row's one real token (a decode row only).
    draft_token_ids: list[int] = field(default_factory=list)
    # Positions after the row's tokens that got pages for this step only (drafts, a device drafter's chain).
    num_lookahead_tokens: int = 0


@dataclass
class SchedulerOutput:
    step_index: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    admissions_allowed: bool = True
    # (group, source page, destination page): recurrent-state saves and restores to run, in order,
    # before this step's forward.
    kv_copies: list[tuple[int, int, int]] = field(default_factory=list)
    # Page stores and loads for the KV offload worker (agentjax.kv.offload.connector.KVTransfers),
    # dispatched before the copies; None without offload tiers.
    kv_transfers: object = None

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
    `trim_prefill_to_buckets` shortens a step's last prefill chunks when its tokens overflow a token
    bucket by less than the padding to the next one (`_trim_to_bucket`).
    """

    def __init__(self, config: EngineConfig, kv: KVCacheManager, watermark: float = 0.01, offload=None,
                 speculator=None, max_model_len: int | None = None):
        self.config = config
        self.kv = kv
        # Speculative decoding (agentjax.spec_decode.Speculator) or None: draft tokens for decode rows.
        self.speculator = speculator
        self.max_model_len = max_model_len
        # The KV offload connector's scheduler side (agentjax.kv.offload.connector), or None. A waiting
        # request whose prefix sits in a tier is parked there while the worker loads it.
        self.offload = offload
        # Session turn ends go to the KV policy behind the pool's eviction order (the engine's kv_policy);
        # the block hashes it keeps for prefetch are only of use to an offload tier.
        self.sessions = SessionTable(kv, kv.kv_policy,
                                     keep_block_hashes=offload is not None)
        # Recurrent states are saved at these token boundaries: prefill chunks end on them.
        self.checkpoint_tokens = min((g.tokens_per_page for g in kv.plan.groups if g.spec.hit_rule == "checkpoint"),
                                     default=0)
        self.watermark_blocks = int(watermark * (kv.capacity_units + 1))  # capacity units (pages of one size)
        self.running: list[Request] = []
        self._waiting: list[tuple[int, int, Request]] = []  # heap of (priority, arrival_index, request)
        self._head: tuple[Request, list[int]] | None = None  # the waiting head's token list (`_tokens_of`)
        self.step_index = 0
        self.num_preemptions = 0

    # -- queues ----------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.state = RequestState.WAITING
        if request.session_id is not None:
            self.sessions.on_turn_start(request.session_id, request, request.hints)
        if self.offload is not None:
            self.offload.on_request_added(request)
        heapq.heappush(self._waiting, (request.priority, request.arrival_index, request))

    def finish(self, request: Request) -> None:
        """A request ended normally: pin what its session and its marked prefixes keep, then release it."""
        if request.session_id is not None:
            self.sessions.on_turn_end(request)
        if self.offload is not None and request in self.running:
            self.offload.on_turn_end(request)  # stores run after the turn, from the pages it leaves cached
        for num_tokens, ttl_s in request.pin_prefixes:
            prefix = request.prompt_token_ids[:num_tokens]
            self.kv.pin_prefix(("prefix", request.cache_salt, num_tokens, hash(tuple(prefix))), prefix,
                               ttl_s=ttl_s, cache_salt=request.cache_salt)
        self.remove(request)

    def end_session(self, session_id: str) -> None:
        """Release a session's pins now (the agent said it is done)."""
        self.sessions.end(session_id)

    @property
    def num_waiting(self) -> int:
        held = self.offload.num_held if self.offload is not None else 0  # parked while a tier loads
        return len(self._waiting) + held  # `remove` takes finished and aborted requests out at once

    def has_unfinished(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    def remove(self, request: Request) -> None:
        """Drop a request from the queues and release its pages (finish or abort). A waiting request
        (never admitted, or preempted) holds no pages."""
        holds_pages = request in self.running
        if holds_pages:
            self.running.remove(request)
        self._waiting = [entry for entry in self._waiting if entry[2] is not request]
        heapq.heapify(self._waiting)
        if self.offload is not None:
            self.offload.drop(request)
        if self.speculator is not None:
            self.speculator.forget(request.request_id)
        if holds_pages:
            if request.num_computed_tokens > 0:  # the next turn may resume from where this one stopped
                self.kv.end_turn(request.request_id, request.num_computed_tokens)
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

    def _grow(self, request: Request, count: int, unscheduled: list[Request], out: SchedulerOutput,
              num_drafts: int = 0, num_chain: int = 0) -> tuple[int, int] | None:
        """Give `request` pages for every token it holds and for this step's `count` tokens (window
        groups reserve chunk by chunk), preempting later requests if needed. Pages for `num_drafts` draft
        tokens after them (and a state page per draft), then for the `num_chain` positions a device
        drafter writes after those, are reserved only if free pages allow (never by preempting). Returns
        `(draft tokens that got pages, lookahead positions reserved)`, None if the request cannot grow."""
        kv, req_id = self.kv, request.request_id
        have = kv.num_tokens(req_id)
        prompt_len = len(request.prompt_token_ids)
        if have < request.num_tokens:
            if have >= prompt_len:
                missing = request.output_token_ids[have - prompt_len :]
            else:
                missing = request.prompt_token_ids[have:] + request.output_token_ids
            while not kv.append(req_id, missing):
                if not self._preempt_for(unscheduled, out):
                    return None
        end = request.num_computed_tokens + count
        for drafts, lookahead in ((num_drafts, num_drafts + num_chain), (num_drafts, num_drafts)):
            if lookahead and kv.reserve(req_id, end, num_lookahead_tokens=lookahead, num_draft_states=drafts):
                return drafts, lookahead
        while not kv.reserve(req_id, end):
            if not self._preempt_for(unscheduled, out):
                return None
        return 0, 0

    def _preempt_for(self, unscheduled: list[Request], out: SchedulerOutput) -> bool:
        victim = self._preempt_one(unscheduled)
        if victim is None:
            return False
        out.preempted.append(victim.request_id)
        return True

    def _draft_room(self, request: Request, spare_budget: int) -> int:
        """Draft tokens a decode row may carry: within the step's spare budget, and never more than the
        request may still generate after the token it samples anyway (max_tokens, the context)."""
        room = min(spare_budget, request.sampling.max_tokens - len(request.output_token_ids) - 1)
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - request.num_tokens - 1)
        interval = self.checkpoint_tokens
        if interval:  # never step over a recurrent-state boundary: the state saved there stays reachable
            computed = request.num_computed_tokens
            room = min(room, (computed // interval + 1) * interval - computed - 1)
        return room

    def _chain(self, samples_kept: bool) -> int:
        """Positions a device drafter writes after a row whose sample is kept (0 otherwise, or for n-gram)."""
        return self.speculator.chain_tokens if samples_kept and self.speculator is not None else 0

    def _chunk(self, request: Request, count: int) -> int:
        """End a prefill chunk on the last recurrent-state boundary inside it, so the state there is saved,
        or at the request's branch point (where its cached prefix ends: the KV manager saves a state there)."""
        interval = self.checkpoint_tokens
        start = request.num_computed_tokens
        end = start + count
        if not interval:
            return count
        if request.state == RequestState.RUNNING:
            branch = self.kv.branch_point(request.request_id)
            if start < branch < end:
                return branch - start
        if end % interval and end // interval * interval > start:
            return end // interval * interval - start
        return count

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(self.step_index)
        if self.offload is not None:
            for request in self.offload.poll():  # their prefix is loaded (or their probe answered)
                if not request.is_finished:
                    heapq.heappush(self._waiting, (request.priority, request.arrival_index, request))
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
            count = self._chunk(request, min(remaining, budget, cap if prefill else remaining))
            drafts = [] if prefill or self.speculator is None else \
                self.speculator.propose(request, self._draft_room(request, budget - count))
            grown = self._grow(request, count, unscheduled, out, len(drafts), self._chain(count == remaining))
            if grown is None:
                self._requeue(request)  # nothing later to preempt: this one waits
                out.preempted.append(request.request_id)
                continue
            drafts = drafts[:grown[0]]
            out.scheduled.append(ScheduledRequest(request, count + len(drafts), prefill, draft_token_ids=drafts,
                                                  num_lookahead_tokens=grown[1]))
            budget -= count + len(drafts)

        out.admissions_allowed = self.step_index % self.config.prefill_schedule_interval == 0
        while out.admissions_allowed and self._waiting and budget > 0 and len(out.scheduled) < self.config.max_num_seqs:
            _, _, request = self._waiting[0]
            if request.is_finished:
                heapq.heappop(self._waiting)
                continue
            tokens = self._tokens_of(request)
            if self.offload is not None and self.offload.hold(request, tokens):
                heapq.heappop(self._waiting)  # parked until a tier has loaded its prefix
                continue
            count = self._admit(request, budget, cap, tokens)
            if not count:
                break
            heapq.heappop(self._waiting)
            self._head = None
            if self.offload is not None:
                self.offload.on_admitted(request)
            self.running.append(request)
            out.admitted.append(request.request_id)
            lookahead = self._chain(request.num_computed_tokens + count == request.num_tokens)
            if lookahead and not self.kv.reserve(request.request_id, request.num_computed_tokens + count,
                                                 num_lookahead_tokens=lookahead):
                lookahead = 0
            out.scheduled.append(ScheduledRequest(request, count, True, num_lookahead_tokens=lookahead))
            budget -= count
        if self.config.trim_prefill_to_buckets:
            self._trim_to_bucket(out)
        for item in out.scheduled:
            if self.checkpoint_tokens and item.is_prefill:  # the states at checkpoints inside the chunk
                start = item.request.num_computed_tokens
                self.kv.reserve_state_saves(item.request.request_id, start, start + item.num_new_tokens)
            item.page_tables = self.kv.block_ids(item.request.request_id)
        out.kv_copies = self.kv.take_pending_copies()
        if self.offload is not None:
            out.kv_transfers = self.offload.take_transfers()
        self.step_index += 1
        return out

    def _trim_to_bucket(self, out: SchedulerOutput) -> None:
        """Shorten this step's last prefill chunks so that its tokens fill the token bucket below instead
        of padding far into the next: when T tokens overflow the bucket below by less than the padding up
        to the bucket above (600 tokens: 88 past 512, 424 short of 1024), the overflow waits for the next
        step, which a running prefill or decode usually makes anyway, and the step computes 512 token
        positions instead of 1024. Each trimmed row keeps at least one token; rows with lookahead pages or
        draft tokens, and models with recurrent-state boundaries (chunks must end on them), are left alone."""
        total, buckets = out.num_tokens, self.config.step_buckets.tokens
        below = bucket_below(total, buckets)
        excess = total - below
        if below < MIN_TRIM_BUCKET or excess >= bucket(total, buckets) - total or self.checkpoint_tokens:
            return
        trimmable = [item for item in out.scheduled
                     if item.is_prefill and not item.num_lookahead_tokens and not item.draft_token_ids]
        if sum(item.num_new_tokens - 1 for item in trimmable) < excess:
            return
        for item in reversed(trimmable):  # the latest chunks wait: earlier rows keep their place
            cut = min(excess, item.num_new_tokens - 1)
            item.num_new_tokens -= cut
            excess -= cut
            if not excess:
                break

    def update_from_output(self, out: SchedulerOutput, sampled: list) -> list[tuple[Request, list[int]]]:
        """Advance the scheduled requests after the model ran; `sampled` has per row its sampled token
        (an int), or the tokens sampled at its real token and at each of its draft tokens (a list).

        A row with drafts keeps the drafts the target confirms (`Speculator.accept`): their KV becomes
        the request's and the target's tokens up to the first mismatch are its new outputs; the pages
        reserved only for rejected drafts go back to the pool, and as the hashes of cached pages come
        from accepted tokens only, a rejected draft never reaches the prefix cache. Written pages become
        cacheable. Rows that finished their tokens get the new tokens appended and are returned as
        `(request, tokens)`; the sample of a prefill chunk that is not the last is discarded. Finishing
        (stop checks) is the caller's job, via `remove`.
        """
        produced = []
        block_size = self.kv.block_size
        for item, tokens in zip(out.scheduled, sampled):
            request = item.request
            tokens = [int(tokens)] if isinstance(tokens, (int, np.integer)) else [int(t) for t in tokens]
            before = request.num_computed_tokens
            drafts = item.draft_token_ids
            if drafts:
                accepted = self.speculator.accept(drafts, tokens)
                request.num_computed_tokens += item.num_new_tokens - len(drafts) + accepted
                if accepted:
                    self.kv.append(request.request_id, drafts[:accepted])  # pages already reserved: never fails
                tokens = tokens[: accepted + 1]
            else:
                accepted = 0
                request.num_computed_tokens += item.num_new_tokens
                tokens = tokens[-1:]
            if item.num_lookahead_tokens:
                self.kv.release_lookahead(request.request_id, accepted)
            if request.num_computed_tokens // block_size > before // block_size:  # a page filled up
                self.kv.cache_blocks(request.request_id, request.num_computed_tokens)
            if request.num_computed_tokens == request.num_tokens + len(tokens) - 1:
                request.output_token_ids.extend(tokens)
                produced.append((request, tokens))
        return produced

    def _tokens_of(self, request: Request) -> list[int]:
        """`request.all_token_ids` as one list object while the request waits: the queue's head is tried
        every step until it fits, and the KV manager memoises its hashes and hit by the list's identity
        (a new, equal list costs a copy and a comparison of every token each step)."""
        if self._head is None or self._head[0] is not request or len(self._head[1]) != request.num_tokens:
            self._head = (request, request.all_token_ids)
        return self._head[1]

    def _admit(self, request: Request, budget: int, cap: int, tokens: list[int]) -> int:
        """Reserve pages for all the request's tokens (`tokens`, its `all_token_ids`; cached prefix reused;
        window groups only for the first chunk), keeping a watermark. Returns the first chunk's token
        count, 0 if it must wait."""
        kv = self.kv
        hit = kv.lookup(tokens, request.cache_salt)
        request.num_computed_tokens = hit
        count = self._chunk(request, min(len(tokens) - hit, budget, cap))
        reserved = hit + count
        if not kv.can_allocate(tokens, request.cache_salt, num_reserved_tokens=reserved) or (
                self.running and kv.num_free_blocks - kv.new_units(len(tokens), hit) < self.watermark_blocks) or (
                not kv.allocate(request.request_id, tokens, request.cache_salt, num_reserved_tokens=reserved)):
            request.num_computed_tokens = 0
            return 0
        cached = kv.num_cached_tokens(request.request_id)
        request.num_computed_tokens = cached
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = cached
        request.state = RequestState.RUNNING
        return self._chunk(request, count) if self.checkpoint_tokens else count
