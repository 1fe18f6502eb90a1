"""Data-parallel serving (DP, and DEP when the experts are sharded): one engine per data rank, stepping
in lockstep on one sharded runner.

`DataParallelEngine` keeps an `Engine` (scheduler, KV manager, requests) per data rank and places each
new request on a rank (a session's later turns and a request's parallel samples on the rank that
holds its pages, others on the least loaded rank). Every step, every rank schedules (so all step
counters stay equal and `prefill_schedule_interval` admits prefills on the same steps on every rank),
then one device step runs all ranks' rows together: a rank with nothing to run gets a dummy row on
its null page, because the experts' all_to_all needs every rank. When some rank's rows carry a token
bitmask (structured output), log probabilities or penalties, every rank runs that step variant
(agentjax/runner/data_parallel_runner.py). `make_engine` picks the engine a config asks for. Host only:
the device work is the runner's.
"""
from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from agentjax.config import EngineConfig, ModelConfig
from agentjax.engine import Engine
from agentjax.errors import InvalidRequestError
from agentjax.runner.compile_counter import CompileCounter
from agentjax.sampling_params import SamplingParams
from agentjax.scheduler.request import EngineOutput


def make_engine(model_cfg: ModelConfig, params, engine_cfg: EngineConfig, tokenizer=None):
    """An `Engine`, or a `DataParallelEngine` when data_parallel_size > 1."""
    if engine_cfg.data_parallel_size > 1:
        return DataParallelEngine(model_cfg, params, engine_cfg, tokenizer)
    return Engine(model_cfg, params, engine_cfg, tokenizer)


class _Lockstep:
    """Collects each rank's rows for one step, runs them as one device step, hands tokens back."""

    def __init__(self, runner, ranks: int):
        self.runner, self.ranks = runner, ranks
        self.cond = threading.Condition()
        self.pending: dict[int, tuple] = {}
        self.finished: set[int] = set()
        self.results: dict[int, object] = {}

    def begin(self) -> None:
        self.pending, self.finished, self.results = {}, set(), {}

    def submit(self, rank: int, rows, sampling, kv_copies, bitmask=None, extras=None):
        """Called on a rank's thread from its engine's step: blocks until the lockstep step ran. Returns the
        rank's tokens, or with `extras` `(tokens, what they asked for)`."""
        with self.cond:
            self.pending[rank] = (rows, sampling, kv_copies, bitmask, extras)
            self.cond.notify_all()
            self.cond.wait_for(lambda: rank in self.results)
            result = self.results.pop(rank)
        if isinstance(result, BaseException):
            raise result
        return result

    def rank_done(self, rank: int) -> None:
        with self.cond:
            self.finished.add(rank)
            self.cond.notify_all()

    def run_when_ready(self) -> None:
        """On the driving thread: once every rank submitted rows or finished its step, run them all."""
        with self.cond:
            self.cond.wait_for(lambda: len(self.pending) + len(self.finished - set(self.pending)) >= self.ranks)
            pending = dict(self.pending)
        if not pending:
            return
        try:
            for rank, (_, _, copies, _, _) in pending.items():
                if copies:
                    self.runner.copy_pages(copies, rank=rank)
            by_rank = [pending.get(r, (None,) * 5) for r in range(self.ranks)]
            rows, sampling, bitmasks, extras = ([p[i] for p in by_rank] for i in (0, 1, 3, 4))
            if all(mask is None for mask in bitmasks) and all(e is None for e in extras):
                tokens = self.runner.execute_ranks(rows, sampling)
            else:
                tokens = self.runner.execute_ranks_extended(rows, sampling, bitmasks, extras)
            results = {rank: tokens[rank] for rank in pending}
        except BaseException as exc:  # every waiting rank sees the failure
            results = {rank: exc for rank in pending}
        with self.cond:
            self.results.update(results)
            self.cond.notify_all()


class _RankRunner:
    """What one rank's `Engine` sees as its runner: `execute` joins the lockstep step."""

    def __init__(self, lockstep: _Lockstep, rank: int):
        self.lockstep, self.rank = lockstep, rank
        self.compiled_shapes = lockstep.runner.compiled_shapes
        self.last_device_s = 0.0

    def execute(self, rows, sampling, token_bitmask=None, kv_copies=()):
        tokens = self.lockstep.submit(self.rank, rows, sampling, kv_copies, token_bitmask)
        self.last_device_s = self.lockstep.runner.last_device_s
        return tokens

    def execute_extended(self, rows, sampling, extras, token_bitmask=None, kv_copies=()):
        tokens, found = self.lockstep.submit(self.rank, rows, sampling, kv_copies, token_bitmask, extras)
        self.last_device_s = self.lockstep.runner.last_device_s
        return tokens, found


class DataParallelEngine:
    """`data_parallel_size` engines in lockstep over one sharded runner; the `Engine` interface."""

    def __init__(self, model_cfg: ModelConfig, params, engine_cfg: EngineConfig, tokenizer=None):
        from agentjax.runner.data_parallel_runner import DataParallelRunner
        from agentjax.runner.sharded_runner import check_engine_layout

        model_cfg = engine_cfg.model_config_for(model_cfg)  # the attention implementation it runs
        check_engine_layout(model_cfg, engine_cfg)
        self.model_cfg, self.config, self.tokenizer = model_cfg, engine_cfg, tokenizer
        self.num_ranks = engine_cfg.data_parallel_size
        # each rank's engine sizes its own KV pool (equal sizes); the runner's buffers follow them
        self.ranks = [Engine(model_cfg, params, engine_cfg, tokenizer, runner=_NOT_YET) for _ in range(self.num_ranks)]
        page_size = engine_cfg.parallel.kv_page_tokens(engine_cfg.block_size)
        self.runner = DataParallelRunner(model_cfg, params, self.ranks[0].kv.num_pages, page_size,
                                         engine_cfg.numerics, engine_cfg.logprobs_mode, parallel=engine_cfg.parallel,
                                         step_buckets=engine_cfg.step_buckets)
        from agentjax.runner.distributed import distributed_runner

        self.runner = distributed_runner(self.runner, engine_cfg)  # process 0 announces its calls to the others
        self.lockstep = _Lockstep(self.runner, self.num_ranks)
        for rank, engine in enumerate(self.ranks):
            engine.runner = _RankRunner(self.lockstep, rank)
        self.max_model_len = self.ranks[0].max_model_len
        self._rank_of: dict[str, int] = {}
        self._session_rank: dict[str, int] = {}
        self._ids = itertools.count()
        self._pool = ThreadPoolExecutor(max_workers=self.num_ranks, thread_name_prefix="agentjax-dp-rank")
        self.num_steps = 0
        self.compiles = CompileCounter()  # the lockstep steps run on the thread that calls `step`

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: Sequence[int], sampling: SamplingParams, request_id: str | None = None,
                    *, session_id: str | None = None, fork_of: str | None = None, **kwargs) -> str:
        """`Engine.add_request` on the rank chosen for it (see the module docstring)."""
        hints = kwargs.get("hints")
        session_id = session_id or (hints.session_id if hints is not None else None)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._rank_of:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        rank = self._choose_rank(session_id, fork_of)
        self.ranks[rank].add_request(prompt_token_ids, sampling, request_id, session_id=session_id, fork_of=fork_of,
                                     **kwargs)
        self._rank_of[request_id] = rank
        if session_id is not None:
            self._session_rank[session_id] = rank
        return request_id

    def _choose_rank(self, session_id: str | None, fork_of: str | None) -> int:
        if fork_of is not None and fork_of in self._rank_of:
            return self._rank_of[fork_of]
        if session_id is not None and session_id in self._session_rank:
            return self._session_rank[session_id]
        loads = [len(engine.requests) for engine in self.ranks]
        return loads.index(min(loads))

    def abort(self, request_id: str) -> None:
        rank = self._rank_of.pop(request_id, None)
        if rank is not None:
            self.ranks[rank].abort(request_id)

    def end_session(self, session_id: str) -> None:
        for engine in self.ranks:
            engine.end_session(session_id)
        self._session_rank.pop(session_id, None)

    def has_unfinished(self) -> bool:
        return any(engine.has_unfinished() for engine in self.ranks)

    # ---- one lockstep step ------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """Every rank schedules and runs its rows in one device step (idle ranks: a dummy row)."""
        self.lockstep.begin()

        def run(rank: int) -> list[EngineOutput]:
            try:
                return self.ranks[rank].step()
            finally:
                self.lockstep.rank_done(rank)

        futures = [self._pool.submit(run, rank) for rank in range(self.num_ranks)]
        with self.compiles.counting():
            self.lockstep.run_when_ready()
        outputs = []
        for future in futures:
            outputs += future.result()
        for out in outputs:
            if out.finished:
                self._rank_of.pop(out.request_id, None)
        self.num_steps += 1
        return outputs

    def run_until_done(self) -> Iterator[EngineOutput]:
        while self.has_unfinished():
            yield from self.step()

    def stats(self) -> dict:
        """Every rank's counters summed (ratios recomputed); `ranks` holds each rank's own."""
        per_rank = [engine.stats() for engine in self.ranks]
        total = {key: sum(s[key] for s in per_rank) for key, value in per_rank[0].items()
                 if isinstance(value, (int, float)) and key != "kv_usage"}
        total["kv_usage"] = total["kv_used_blocks"] / max(1, total["kv_total_blocks"])
        total["num_steps"] = self.num_steps
        total["compiled_executables"] += self.compiles.executables
        total["ranks"] = per_rank
        return total

    @property
    def step_logs(self) -> list:
        """Each rank's `Engine.step_log` (StepRecord per step it scheduled)."""
        return [engine.step_log for engine in self.ranks]


# Stands in for a rank engine's runner until the shared runner exists.
_NOT_YET = object()
