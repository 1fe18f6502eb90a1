"""The host loop: `add_request`, `step`, `abort`, and a stream of outputs.

Each step asks the scheduler which tokens run, builds one ragged batch from the KV manager's page
tables, runs the model once, marks the written pages cacheable, and appends sampled tokens.
Host state is plain Python; the device sees only the padded metadata arrays.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from agentjax.config import EngineConfig, ModelConfig
from agentjax.errors import InvalidRequestError, OutOfPagesError, PromptTooLongError
from agentjax.kv import KVCacheManager
from agentjax.runner.model_runner import ModelRunner
from agentjax.sampling_params import SamplingParams
from agentjax.scheduler.request import AgentHints, EngineOutput, Request, RequestState
from agentjax.scheduler.scheduler import Scheduler, SchedulerOutput
from agentjax.scheduler.sessions import SessionTable
from agentjax.structured.backend import GrammarBackend, all_allowed

logger = logging.getLogger(__name__)

# Latency samples kept for percentiles (the server exports its own histograms).
LATENCY_WINDOW = 10_000


@dataclass
class EngineMetrics:
    """Counters and recent latency samples of the engine."""

    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    ttft_s: deque = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))
    itl_s: deque = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))
    e2e_s: deque = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))


@dataclass(frozen=True)
class StepRecord:
    """One step as scheduled: `(request_id, num_tokens, is_prefill)` rows, admissions, preemptions."""

    step_index: int
    rows: tuple[tuple[str, int, bool], ...]
    admitted: tuple[str, ...]
    preempted: tuple[str, ...]
    admissions_allowed: bool


class Engine:
    """Serves many requests at once on one model runner."""

    def __init__(self, model_cfg: ModelConfig, params, engine_cfg: EngineConfig, tokenizer=None):
        self.model_cfg = model_cfg
        self.config = engine_cfg
        self.tokenizer = tokenizer
        self.max_model_len = engine_cfg.max_model_len or model_cfg.max_position_embeddings
        num_pages = engine_cfg.num_kv_blocks or self._pages_for_memory(engine_cfg)
        self.kv = KVCacheManager.from_model_config(
            model_cfg, num_pages, engine_cfg.block_size, enable_caching=engine_cfg.enable_prefix_caching
        )
        if len(self.kv.plan.groups) != 1:
            # One page table per batch row for now: treat every layer as one group (exact; the
            # sliding window is applied by masking, out-of-window pages are simply kept).
            from agentjax.kv.specs import specs_from_model_config

            self.kv = KVCacheManager.from_specs(
                specs_from_model_config(model_cfg.replace(layer_types=(), sliding_window=None)),
                num_pages, engine_cfg.block_size, enable_caching=engine_cfg.enable_prefix_caching,
                scale_tokens_per_page=False, cache_on_allocate=False,
            )
        self.runner = ModelRunner(model_cfg, params, num_pages, engine_cfg.block_size, engine_cfg.numerics)
        self.scheduler = Scheduler(engine_cfg, self.kv)
        self.sessions = SessionTable(self.kv)
        self.requests: dict[str, Request] = {}
        self.metrics = EngineMetrics()
        self.step_log: deque[StepRecord] = deque(maxlen=engine_cfg.extra.get("step_log_size", 10_000))
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self.num_steps = 0
        self._grammar: GrammarBackend | None = None

    def _pages_for_memory(self, cfg: EngineConfig) -> int:
        page_bytes = self.model_cfg.kv_bytes_per_token() * cfg.block_size
        return max(16, int(cfg.kv_cache_memory_gb * 2**30) // page_bytes)

    # ---- requests -------------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        request_id: str | None = None,
        *,
        session_id: str | None = None,
        priority: int = 0,
        hints: AgentHints | None = None,
        cache_salt: str | None = None,
        pin_prefixes: Sequence[tuple[int, float]] = (),
    ) -> str:
        """Queue one request. `pin_prefixes` lists `(num_tokens, ttl_s)` prompt prefixes the client
        will send again (Anthropic `cache_control` marks): their pages stay pinned for `ttl_s` after
        this turn ends."""
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        if len(prompt) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(prompt)} tokens; the model's context is {self.max_model_len} "
                f"(a prompt may use at most {self.max_model_len - 1} to leave room for one new token)"
            )
        bad = [t for t in prompt if not 0 <= t < self.model_cfg.vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.model_cfg.vocab_size})")
        needed = -(-min(len(prompt) + sampling.max_tokens, self.max_model_len) // self.config.block_size)
        if needed > self.kv.pool.num_pages - 1:
            raise OutOfPagesError(
                f"the request needs {needed} KV pages but the pool has {self.kv.pool.num_pages - 1}; "
                f"raise num_kv_blocks or lower max_tokens"
            )
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if hints is not None:
            session_id = session_id or hints.session_id
            priority = hints.priority if hints.priority is not None else priority
        stops = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stops |= set(self._eos_token_ids())
        for num_tokens, ttl_s in pin_prefixes:
            if not 0 < num_tokens <= len(prompt) or not ttl_s > 0:
                raise InvalidRequestError(f"a pinned prefix must be 1..{len(prompt)} tokens with a positive TTL; "
                                          f"got {num_tokens} tokens for {ttl_s} s")
        request = Request(
            request_id, prompt, sampling, frozenset(stops), session_id=session_id, priority=priority,
            hints=hints, cache_salt=cache_salt, arrival_index=next(self._arrivals),
            seed=sampling.seed if sampling.seed is not None else (self.config.seed + len(self.requests)) % 2**32,
            pin_prefixes=tuple((int(n), float(t)) for n, t in pin_prefixes),
        )
        if sampling.structured is not None:
            request.matcher = self.grammar.new_matcher(sampling.structured)
        self.requests[request_id] = request
        if session_id is not None:
            self.sessions.on_turn_start(session_id, request, hints)
        self.scheduler.add(request)
        self.metrics.prompt_tokens_total += len(prompt)
        return request_id

    @property
    def grammar(self) -> GrammarBackend:
        """The structured-output backend, built on first use (it needs the tokenizer)."""
        if self._grammar is None:
            if self.tokenizer is None:
                raise InvalidRequestError("structured output needs the model's tokenizer; this engine has none")
            self._grammar = GrammarBackend(self.tokenizer, self.model_cfg.vocab_size, self._eos_token_ids())
        return self._grammar

    def _eos_token_ids(self) -> tuple[int, ...]:
        if self.tokenizer is not None:
            return tuple(self.tokenizer.stop_token_ids)
        return self.model_cfg.eos_token_ids

    def abort(self, request_id: str) -> None:
        """Stop a request at any moment and release its pages."""
        request = self.requests.pop(request_id, None)
        if request is None or request.is_finished:
            return
        request.state = RequestState.ABORTED
        request.finish_reason = "abort"
        self.scheduler.remove(request)
        self.metrics.requests_aborted += 1

    def end_session(self, session_id: str) -> None:
        """Release a session's pins now (the agent said it is done)."""
        self.sessions.end(session_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        plan = self.scheduler.schedule()
        self._log(plan)
        if not plan.scheduled:
            if self.scheduler.running or (self.scheduler.num_waiting and plan.admissions_allowed):
                raise OutOfPagesError("no request can be scheduled: the KV pool is too small for what waits")
            return []
        rows, sampling, constrained = [], [], []
        for row, item in enumerate(plan.scheduled):
            request = item.request
            start = request.num_computed_tokens
            pages = self.kv.block_ids(request.request_id)[0]
            rows.append((request.all_token_ids[start : start + item.num_new_tokens], start, pages))
            sp = request.sampling
            sampling.append((sp.temperature, sp.top_k, sp.top_p, request.seed, len(request.output_token_ids)))
            if request.matcher is not None and start + item.num_new_tokens >= request.num_tokens:
                constrained.append((request.matcher, row))  # this row's token is kept: constrain it
        bitmask = None
        if constrained:
            bitmask = all_allowed(len(rows), self.model_cfg.vocab_size)
            self.grammar.fill_bitmask(bitmask, constrained)
        tokens = self.runner.execute(rows, sampling, bitmask)
        self.num_steps += 1
        now = time.monotonic()
        produced = self.scheduler.update_from_output(plan, tokens.tolist())
        return [self._on_token(request, token, now) for request, token in produced]

    def _on_token(self, request: Request, token: int, now: float) -> EngineOutput:
        self.metrics.generation_tokens_total += 1
        if request.matcher is not None and not request.matcher.consume_token(token):
            logger.error("request %s: sampled token %d broke its grammar (%s)", request.request_id, token,
                         request.matcher.get_error())
        if request.first_token_time is None:
            request.first_token_time = now
            self.metrics.ttft_s.append(now - request.arrival_time)
        else:
            self.metrics.itl_s.append(now - request.last_token_time)
        request.last_token_time = now
        reason = self._finish_reason(request)
        if reason:
            self._finish(request, reason, now)
        return EngineOutput(
            request.request_id, [token], reason is not None, reason,
            max(request.num_cached_tokens, 0), len(request.prompt_token_ids),
        )

    def _finish_reason(self, request: Request) -> str | None:
        sp = request.sampling
        generated = len(request.output_token_ids)
        if generated >= sp.min_tokens and request.output_token_ids[-1] in request.stop_token_ids:
            return "stop"
        if request.matcher is not None and (request.matcher.is_stopped() or request.matcher.is_error()):
            return "stop"  # the grammar is complete (only end-of-sequence could follow), or broken (logged)
        if sp.stop and self.tokenizer is not None and generated >= sp.min_tokens:
            text = self.tokenizer.decode(request.output_token_ids)
            if any(stop in text for stop in sp.stop):
                return "stop"
        if generated >= sp.max_tokens or request.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, request: Request, reason: str, now: float) -> None:
        request.finish_reason = reason
        request.state = RequestState.FINISHED
        if request.session_id is not None:
            self.sessions.on_turn_end(request)
        for num_tokens, ttl_s in request.pin_prefixes:
            prefix = request.prompt_token_ids[:num_tokens]
            self.kv.pin_prefix(("prefix", request.cache_salt, num_tokens, hash(tuple(prefix))), prefix,
                               ttl_s=ttl_s, cache_salt=request.cache_salt)
        self.scheduler.remove(request)
        self.requests.pop(request.request_id, None)
        self.metrics.requests_finished += 1
        self.metrics.e2e_s.append(now - request.arrival_time)

    def _log(self, plan: SchedulerOutput) -> None:
        self.step_log.append(
            StepRecord(
                plan.step_index,
                tuple((s.request.request_id, s.num_new_tokens, s.is_prefill) for s in plan.scheduled),
                tuple(plan.admitted),
                tuple(plan.preempted),
                plan.admissions_allowed,
            )
        )

    def run_until_done(self) -> Iterator[EngineOutput]:
        while self.has_unfinished():
            yield from self.step()

    def stats(self) -> dict:
        kv = self.kv.stats()
        total = self.kv.pool.num_pages - 1
        free = self.kv.num_free_blocks
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": self.scheduler.num_waiting,
            "num_preemptions": self.scheduler.num_preemptions,
            "kv_total_blocks": total,
            "kv_free_blocks": free,
            "kv_used_blocks": kv.get("used_blocks", total - free),
            "kv_cached_blocks": kv.get("cached_blocks", 0),
            "kv_usage": kv.get("used_blocks", total - free) / total,
            "prefix_query_tokens": kv.get("queries", 0),
            "prefix_hit_tokens": kv.get("hits", 0),
            "prompt_tokens_total": self.metrics.prompt_tokens_total,
            "generation_tokens_total": self.metrics.generation_tokens_total,
            "requests_finished": self.metrics.requests_finished,
            "requests_aborted": self.metrics.requests_aborted,
            "num_steps": self.num_steps,
            "compiled_shapes": len(self.runner.compiled_shapes),
        }
