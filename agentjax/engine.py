"""The host loop: `add_request`, `step`, `abort`, and a stream of outputs.

Each step asks the scheduler which tokens run (with each row's page tables, one per KV group, and
the state-page copies to run first), runs the model once on that ragged batch, and hands the
sampled tokens back to the scheduler. The engine never calls the KV manager on the step path.
Host state is plain Python; the device sees only the padded metadata arrays. Penalties and log
probabilities ride along only on steps whose rows ask (`engine_extras`). A parallel sample
(`fork_of`) waits until the first sample has computed the prompt, then reads its pages from the
prefix cache, so a prompt's pages are computed once for n samples. With speculative decoding
(`speculative_config`) a decode row carries draft tokens; the step samples a token at each of them, the
scheduler keeps the drafts the target confirms, and the new tokens are checked for stops one by one; the
"mtp" and "draft_model" methods propose each row's next drafts in the same step (agentjax/runner/drafters.py).
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence

from agentjax.config import EngineConfig, ModelConfig
from agentjax.errors import InvalidRequestError, OutOfPagesError, PromptTooLongError
from agentjax.request_fit import check_pool_fits
from agentjax.runner.compile_counter import CompileCounter
from agentjax.engine_extras import ExtrasTracker
from agentjax.engine_kv import engine_kv_layout
from agentjax.engine_stats import EngineMetrics, StepRecord, engine_stats
from agentjax.kv import KVCacheManager
from agentjax.kv.policy_order import engine_eviction_order
from agentjax.runner.sharded_runner import check_engine_layout, make_model_runner
from agentjax.sampling_params import SamplingParams
from agentjax.spec_decode.setup import make_speculator, plan_speculation
from agentjax.scheduler.request import AgentHints, EngineOutput, Request, RequestState
from agentjax.scheduler.scheduler import Scheduler, SchedulerOutput
from agentjax.structured.backend import GrammarBackend, all_allowed

logger = logging.getLogger(__name__)

class Engine:
    """Serves many requests at once on one model runner."""

    def __init__(self, model_cfg: ModelConfig, params, engine_cfg: EngineConfig, tokenizer=None, *,
                 kv: KVCacheManager | None = None, runner=None, draft_model=None, offload=None):
        """`kv` and `runner` replace the KV manager and the model runner built from the config (the
        planning simulator, agentjax/bench/simulator.py, passes a virtual-clock runner), and `offload`, a
        `(connector, worker)` pair over `kv`, the KV offload tiers (the simulator's virtual-time ones,
        agentjax/bench/sim_offload.py). The model runs
        the attention implementation `engine_cfg.model_config_for` picks (kernels on a GPU by default).
        `draft_model`, a loaded `(config, params, tokenizer)`, replaces loading `speculative_config["model"]`."""
        if runner is None:
            model_cfg = engine_cfg.model_config_for(model_cfg)
        model_cfg, drafting = plan_speculation(model_cfg, engine_cfg, tokenizer, draft_model)
        self.draft_cfg = drafting.draft_cfg if drafting is not None else None
        self.model_cfg = model_cfg
        self.config = engine_cfg
        self.tokenizer = tokenizer
        self.max_model_len = engine_cfg.max_model_len or model_cfg.max_position_embeddings
        if runner is None and not engine_cfg.parallel.is_single_device:
            check_engine_layout(model_cfg, engine_cfg)  # a layout that does not fit fails before anything is built
        if kv is None:
            # one layout sizes the manager's pool and the runner's memory (with DCP a page id holds
            # block_size tokens on each DCP rank, sharding/mesh.py)
            layout = engine_kv_layout(model_cfg, engine_cfg, self.draft_cfg)
            # branch states (the Marconi rule on the device) come with the hint and Marconi policies
            branch_states = engine_cfg.kv_policy != "lru" or engine_cfg.kv_offload_retention == "marconi"
            kv = KVCacheManager.from_layout(layout, enable_caching=engine_cfg.enable_prefix_caching,
                                            eviction_order=engine_eviction_order(engine_cfg.kv_policy),
                                            branch_states=branch_states)
        self.kv = kv
        self.kv_layout = kv.layout
        self.runner = runner or make_model_runner(model_cfg, params, kv.num_pages, engine_cfg, drafting=drafting,
                                                  kv_layout=self.kv_layout)
        self.offload, self.offload_worker = offload if offload is not None else (None, None)
        if offload is None and engine_cfg.kv_offload_enabled:  # host, disk and Mooncake tiers (agentjax.kv.offload)
            from agentjax.runner.offload_worker import build_offload

            self.offload, self.offload_worker = build_offload(engine_cfg, model_cfg, params, self.kv, self.runner)
        self.speculator = make_speculator(engine_cfg, drafting)
        self.scheduler = Scheduler(engine_cfg, self.kv, offload=self.offload, speculator=self.speculator,
                                   max_model_len=self.max_model_len)
        self.requests: dict[str, Request] = {}
        self.metrics = EngineMetrics()
        self.compiles = CompileCounter()  # executables built by this engine's steps and warm-up
        self.step_log: deque[StepRecord] = deque(maxlen=engine_cfg.extra.get("step_log_size", 10_000))
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self.num_steps = 0
        self._grammar: GrammarBackend | None = None
        self._extras = ExtrasTracker()
        self._held_forks: dict[str, list[Request]] = {}  # first sample's id -> samples waiting for its prompt

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
        fork_of: str | None = None,
    ) -> str:
        """Queue one request. `pin_prefixes` lists `(num_tokens, ttl_s)` prompt prefixes the client
        will send again (Anthropic `cache_control` marks): their pages stay pinned for `ttl_s` after
        this turn ends.

        `fork_of` names the first sample of a parallel group with the same prompt (`n` > 1): this
        request waits until that one has computed the prompt and then reads its pages from the prefix
        cache; its prompt is not counted again in `prompt_tokens_total` and it reports no prompt log
        probabilities. Give each sample its own seed (`SamplingParams.for_sample`). A request with
        `prompt_logprobs` does not read the prefix cache (every position's logits are needed)."""
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
        bad = [t for t in sampling.logit_bias or () if t >= self.model_cfg.vocab_size]
        if bad:
            raise InvalidRequestError(f"logit_bias names token id {bad[0]}, outside the vocabulary "
                                      f"[0, {self.model_cfg.vocab_size})")
        check_pool_fits(self.kv, len(prompt), sampling.max_tokens, self.max_model_len,
                        self.config.max_num_batched_tokens)
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
        parent = self.requests.get(fork_of) if fork_of is not None else None
        if parent is not None:
            cache_salt = parent.cache_salt  # the first sample's pages, whatever salt they were written under
        elif sampling.prompt_logprobs is not None and fork_of is None:
            cache_salt = f"{cache_salt or ''}\x00prompt-logprobs\x00{request_id}"  # read no cached page
        request = Request(
            request_id, prompt, sampling, frozenset(stops), session_id=session_id, priority=priority,
            hints=hints, cache_salt=cache_salt, arrival_index=next(self._arrivals),
            seed=sampling.seed if sampling.seed is not None else (self.config.seed + len(self.requests)) % 2**32,
            pin_prefixes=tuple((int(n), float(t)) for n, t in pin_prefixes),
        )
        if sampling.structured is not None:
            request.matcher = self.grammar.new_matcher(sampling.structured)
        request.allow_drafts = not sampling.has_penalties  # a penalty would have to count each draft as output
        self.requests[request_id] = request
        self._extras.add(request_id, prompt, sampling, report_prompt=fork_of is None)
        if parent is not None and not parent.output_token_ids and parent.prompt_token_ids == prompt:
            self._held_forks.setdefault(parent.request_id, []).append(request)
        else:
            self.scheduler.add(request)
        if fork_of is None:
            self.metrics.prompt_tokens_total += len(prompt)
        return request_id

    def _release_forks(self, request_id: str) -> None:
        """The first sample's prompt is computed (or it ended): its waiting samples may run."""
        for fork in self._held_forks.pop(request_id, ()):
            if not fork.is_finished:
                self.scheduler.add(fork)

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
        self._extras.remove(request_id)
        self._release_forks(request_id)
        for parent_id, forks in list(self._held_forks.items()):
            if request in forks:  # a sample still waiting for its first sample: it holds nothing yet
                forks.remove(request)
                self.metrics.requests_aborted += 1
                return
        self.scheduler.remove(request)
        self.metrics.requests_aborted += 1

    def end_session(self, session_id: str) -> None:
        """Release a session's pins now (the agent said it is done)."""
        self.scheduler.end_session(session_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._held_forks)

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        with self.compiles.counting():
            return self._step()

    def _step(self) -> list[EngineOutput]:
        plan = self.scheduler.schedule()
        self._log(plan)
        if self.offload_worker is not None:  # page stores and loads, before this step's copies
            self.offload_worker.run(self.runner, plan.kv_transfers)
            if not plan.scheduled and self.offload.waiting_on_tiers:
                self.offload_worker.wait(0.01)  # only parked requests: wait for a tier, not spin
                return []
        if not plan.scheduled:
            if self.scheduler.running or (self.scheduler.num_waiting and plan.admissions_allowed):
                raise OutOfPagesError("no request can be scheduled: the KV pool is too small for what waits")
            return []
        rows, sampling, constrained, counts, following = [], [], [], [], []
        for item in plan.scheduled:
            request = item.request
            start = request.num_computed_tokens
            drafts = item.draft_token_ids
            real = item.num_new_tokens - len(drafts)
            rows.append((request.token_ids_between(start, start + real) + drafts, start, item.page_tables))
            end = start + real  # the token after the row where it is known (a device drafter reads it)
            following.append(request.token_ids_between(end, end + 1)[0] if end < request.num_tokens else -1)
            sp = request.sampling
            sampling.append((sp.temperature, sp.top_k, sp.top_p, request.seed, len(request.output_token_ids)))
            if request.matcher is not None and start + real >= request.num_tokens:
                # this row's token is kept: constrain it (and each draft position, as if its drafts were taken)
                constrained.append((request.matcher, sum(counts), drafts))
            counts.append(1 + len(drafts))
        bitmask = None
        if constrained:
            bitmask = all_allowed(sum(counts), self.model_cfg.vocab_size)
            self.grammar.fill_bitmask_with_drafts(bitmask, constrained)
        speculative = {"sample_counts": counts} if len(counts) < sum(counts) else {}
        if getattr(self.runner, "drafter", None) is not None:
            speculative["next_tokens"] = following
        extras = self._extras.for_step(plan.scheduled)
        results: dict = {}
        if extras:
            tokens, results = self.runner.execute_extended(rows, sampling, extras, bitmask, kv_copies=plan.kv_copies,
                                                           **speculative)
            self._extras.record(plan.scheduled, extras, results)
        else:
            tokens = self.runner.execute(rows, sampling, bitmask, kv_copies=plan.kv_copies, **speculative)
        self.num_steps += 1
        now = time.monotonic()
        self.metrics.prompt_tokens_computed += sum(
            max(0, min(item.num_new_tokens, len(item.request.prompt_token_ids) - item.request.num_computed_tokens))
            for item in plan.scheduled if item.is_prefill)
        tokens = tokens.tolist()
        starts = [0, *itertools.accumulate(counts)]
        first_sample = {id(item.request): start for item, start in zip(plan.scheduled, starts)}
        by_row = [tokens[start:stop] for start, stop in zip(starts, starts[1:])]
        produced = self.scheduler.update_from_output(plan, by_row)
        if "next_tokens" in speculative:
            self.speculator.offer_from_step(plan.scheduled, self.runner.last_drafts, self.kv.plan.groups)
        return [self._on_tokens(request, new, now, first_sample[id(request)], results) for request, new in produced]

    def _on_tokens(self, request: Request, tokens: list[int], now: float, first_sample: int = 0,
                   results: dict | None = None) -> EngineOutput:
        """Account for the tokens a step added to `request` (the scheduler appended them; several with
        speculative decoding): they are checked one by one, and a stop condition met before the last
        one drops the tokens after it. `first_sample` is the step's sampled position of the first."""
        if len(tokens) > 1:  # re-added one at a time, so each stop check sees the output up to its token
            del request.output_token_ids[-len(tokens):]
        logprobs, prompt_logprobs, reason, kept = [], None, None, 0
        extras = self._extras.requests.get(request.request_id)
        for index, token in enumerate(tokens):
            if len(tokens) > 1:
                request.output_token_ids.append(token)
            kept += 1
            self.metrics.generation_tokens_total += 1
            if len(request.output_token_ids) == 1:
                self._release_forks(request.request_id)
            if extras is not None:
                extras.on_token(token)
                entry = self._extras.sampled(request.request_id, token, first_sample + index, results or {})
                if entry is not None:
                    logprobs.append(entry)
            if request.matcher is not None and not request.matcher.consume_token(token):
                logger.error("request %s: sampled token %d broke its grammar (%s)", request.request_id, token,
                             request.matcher.get_error())
            reason = self._finish_reason(request)
            if reason:
                break
        if extras is not None:
            prompt_logprobs = extras.take_prompt_logprobs()
        if request.first_token_time is None:
            request.first_token_time = now
            self.metrics.ttft_s.append(now - request.arrival_time)
        else:
            self.metrics.itl_s.append(now - request.last_token_time)
        request.last_token_time = now
        if reason:
            self._finish(request, reason, now)
        return EngineOutput(
            request.request_id, tokens[:kept], reason is not None, reason,
            max(request.num_cached_tokens, 0), len(request.prompt_token_ids), logprobs or None, prompt_logprobs,
        )

    def _finish_reason(self, request: Request) -> str | None:
        sp = request.sampling
        generated = len(request.output_token_ids)
        if generated >= sp.min_tokens and request.output_token_ids[-1] in request.stop_token_ids:
            return "stop"
        if request.matcher is not None and (request.matcher.is_stopped() or request.matcher.is_error()):
            return "stop"  # the grammar is complete (only end-of-sequence could follow), or broken (logged)
        if sp.stop and self.tokenizer is not None:
            from agentjax.stop_strings import reply_hit_stop_string

            # Fed every new token (incremental: O(1) per token); a stop string that ends before
            # min_tokens does not count, as in vLLM.
            if reply_hit_stop_string(request, self.tokenizer) and generated >= sp.min_tokens:
                return "stop"
        if generated >= sp.max_tokens or request.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, request: Request, reason: str, now: float) -> None:
        request.finish_reason = reason
        request.state = RequestState.FINISHED
        self.scheduler.finish(request)
        self.requests.pop(request.request_id, None)
        self._extras.remove(request.request_id)
        self._release_forks(request.request_id)
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
        """Scheduler, KV pool, token and compile counters, a flat dict (see `agentjax.engine_stats`)."""
        return engine_stats(self)

    # ---- idle offload work (between steps; the server's engine thread calls these) ---------------
    def dispatch_offload_stores(self) -> None:
        """Idle: the stores of the turns that just ended go to their tiers now, not with the next step."""
        if self.offload_worker is not None:
            transfers = self.offload.take_transfers()
            if transfers:
                self.offload_worker.run(self.runner, transfers)

    def flush_offload(self, reached: Callable[[dict[str, bool]], None]) -> bool:
        """Dispatch the stores of the turns that ended so far now; once the tiers hold them, `reached` gets
        each tier's degraded flag (called from a tier thread, or at once without remote tiers). False,
        and no call, for an engine without offload tiers."""
        if self.offload_worker is None:
            return False
        connector = self.offload

        def stored() -> None:
            reached({name: connector.health[name].degraded for name in connector.tiers})

        self.offload_worker.after_stores(self.runner, stored)
        return True
