"""The AgentX replay: C closed-loop lanes, each replaying agent sessions turn by turn.

A lane sends a turn after the previous turn's reply plus its (scaled) think time; subagents run
concurrently with their parent; the first session of each lane starts part-way in, as AgentX does.
Requests go to a `backends.Backend`: an OpenAI-compatible server (`HttpBackend`) or an in-process
`Engine` (`EngineBackend`, stepped on the same asyncio loop). The result is `metrics.summarize`'s dict.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from agentjax.bench.backends import Backend, EngineBackend, HttpBackend, TurnRequest
from agentjax.bench.metrics import RequestRecord, summarize
from agentjax.bench.trace_augment import TraceAugmentConfig, augment_sessions
from agentjax.bench.traces import Session, Turn, load_weka_traces, prompt_token_ids, scale_session
from agentjax.errors import InvalidRequestError
from agentjax.progress import ProgressBar

__all__ = ["AgentxConfig", "AgentxRun", "Backend", "EngineBackend", "HttpBackend", "TurnRequest",
           "load_sessions", "run_agentx", "run_agentx_async"]

logger = logging.getLogger(__name__)

DEFAULT_TRACES = "../shared/traces/agentx-dev"
IDLE_GAP_CAP_S = 300.0  # AgentX's --trace-idle-gap-cap-seconds
START_RATIO = (0.25, 0.75)  # AgentX's --trajectory-start-{min,max}-ratio


@dataclass
class AgentxConfig:
    """One replay run. `max_context` caps each prompt (truncating its end); `warmup_s` and
    `warmup_requests_per_lane` (AgentX's default: 1, the lane's cold first request) are not counted."""

    traces: str = DEFAULT_TRACES
    lanes: int = 4
    context_scale: float = 0.01
    duration_s: float = 60.0
    warmup_s: float = 0.0
    warmup_requests_per_lane: int = 1
    think_scale: float = 0.0
    seed: int = 0
    gpus: int = 1
    max_context: int | None = None
    drain_timeout_s: float = 120.0
    progress: bool = False
    salt: str = ""  # prefixes every lane's salt: runs on one engine then share no prefixes
    max_output_tokens: int | None = None  # cap each turn's recorded output (hit rates do not use it)
    sessions_per_lane: int | None = None  # stop each lane after this many sessions (a fixed stream)
    subagent_share: float = 0.0  # traffic added to the traces (`trace_augment`): off by default
    retry_rate: float = 0.0
    compaction: bool = False

    def __post_init__(self) -> None:
        if self.lanes < 1 or not self.duration_s > 0 or self.gpus < 1 or self.think_scale < 0:
            raise InvalidRequestError(
                f"need lanes >= 1, duration > 0, gpus >= 1, think_scale >= 0; got lanes={self.lanes}, "
                f"duration={self.duration_s}, gpus={self.gpus}, think_scale={self.think_scale}")
        if self.max_context is not None and self.max_context < 2:
            raise InvalidRequestError(f"max_context={self.max_context} must be >= 2")
        for name in ("sessions_per_lane", "max_output_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise InvalidRequestError(f"{name}={getattr(self, name)} must be >= 1")

    def augment(self) -> TraceAugmentConfig:
        return TraceAugmentConfig(seed=self.seed, subagent_share=self.subagent_share,
                                  retry_rate=self.retry_rate, compaction=self.compaction)


class AgentxRun:
    """Replays `sessions` on `backend` with `config.lanes` closed-loop lanes."""

    def __init__(self, config: AgentxConfig, sessions: Sequence[Session], backend: Backend,
                 clock: Callable[[], float] = time.perf_counter, label: str = "agentx") -> None:
        """`clock` times the run (the planning simulator passes its virtual clock); `label` names its
        progress bars."""
        if not sessions:
            raise InvalidRequestError("no sessions to replay")
        self.config = config
        self.sessions = [session for session in sessions if session.turns]
        self.backend = backend
        self.clock = clock
        self.records: list[tuple[RequestRecord, bool]] = []  # (record, counted)
        self.in_flight = 0
        self._lane_counts: dict[int, int] = {}
        self.t0 = self.t_profile = 0.0
        self.deadline = float("inf")  # known once the warm-up phase ends
        self._profiling = asyncio.Event()
        self._lanes_warm = 0
        self._bars: tuple[ProgressBar, ProgressBar] | None = None
        self.label = f"{label} C={config.lanes}"

    def _stopping(self) -> bool:
        return self.clock() >= self.deadline

    async def run(self) -> dict:
        """The warm-up phase (each lane's first `warmup_requests_per_lane` requests), then
        `duration_s` of profiling from the moment every lane has finished its warm-up."""
        await self.backend.start()
        self.t0 = self.clock()
        self._lanes_warm = 0
        if self.config.warmup_requests_per_lane == 0:
            self._start_profiling()
        lanes = [asyncio.create_task(self._lane(lane), name=f"lane-{lane}")
                 for lane in range(self.config.lanes)]
        try:
            pending = set(lanes)
            while pending:
                _, pending = await asyncio.wait(pending, timeout=1.0)
                if self.config.progress:
                    self._print_progress()
                if self.clock() > self.deadline + self.config.drain_timeout_s and pending:
                    logger.warning("requests still in flight %.0f s after the end were cancelled",
                                   self.config.drain_timeout_s)
                    break
            for task in lanes:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()
        finally:
            for task in lanes:
                task.cancel()
            await asyncio.gather(*lanes, return_exceptions=True)
            if self.config.progress:
                self._print_progress(final=True)
            await self.backend.close()
        return self.summary()

    def _start_profiling(self) -> None:
        self.t_profile = self.clock()
        self.deadline = self.t_profile + self.config.duration_s
        self._profiling.set()
        logger.info("warm-up done after %.1f s; profiling for %.0f s", self.t_profile - self.t0,
                    self.config.duration_s)

    def summary(self) -> dict:
        counted = [record for record, keep in self.records if keep]
        if counted:
            wall = max(r.end_time_s for r in counted) - min(r.start_time_s for r in counted)
        else:
            wall = self.clock() - self.t0
        summary = summarize(counted, max(wall, 1e-9), self.config.gpus)
        summary.update(warmup_requests=len(self.records) - len(counted),
                       config={k: v for k, v in asdict(self.config).items() if k != "progress"})
        kv_stats = self.backend.kv_stats() if hasattr(self.backend, "kv_stats") else {}
        if kv_stats:  # an in-process engine: where its prefix hits came from
            summary["kv"] = kv_stats
        return summary

    async def _lane(self, lane: int) -> None:
        rng = np.random.default_rng([self.config.seed, lane])
        for replay in range(self.config.sessions_per_lane or 1_000_000):
            if self._stopping():
                return
            session = self.sessions[int(rng.integers(len(self.sessions)))]
            start_turn = 0
            if replay == 0 and len(session.turns) > 1:  # AgentX starts lanes part-way in
                low = int(START_RATIO[0] * len(session.turns))
                high = max(low, int(START_RATIO[1] * len(session.turns)))
                start_turn = min(int(rng.integers(low, high + 1)), len(session.turns) - 1)
            await self._replay(lane, session, start_turn, f"{self.config.salt}{self.config.seed}:{lane}:{replay}", None)

    async def _replay(self, lane: int, session: Session, start_turn: int, salt: str,
                      parent_id: str | None) -> None:
        session_id = f"{salt}:{session.session_id}"
        forks: dict[int, list[Session]] = {}
        for sub in session.subagents:
            if sub.turns and (sub.fork_turn or 0) >= start_turn:
                forks.setdefault(sub.fork_turn or 0, []).append(sub)
        children: list[asyncio.Task] = []
        try:
            for index in range(start_turn, len(session.turns)):
                turn = session.turns[index]
                if index > start_turn:
                    await self._think(turn)
                if self._stopping():
                    break
                last = index == len(session.turns) - 1
                hints = {"session_id": session_id, "turn": turn.index, "session_end": last,
                         "branch_point": index in forks}
                if parent_id is not None:
                    hints["parent_session_id"] = parent_id
                if not last:
                    hints["expected_next_turn_s"] = self._think_time(session.turns[index + 1])
                kind = ("branch" if parent_id is not None and index == 0 else
                        "first" if index == start_turn else "compaction" if turn.compacted else "turn")
                await self._send(lane, session, turn, salt, session_id, hints, kind)
                for _ in range(turn.retries):
                    if self._stopping():
                        break
                    await self._send(lane, session, turn, salt, session_id, hints, "retry")
                for sub in forks.get(index, ()):
                    children.append(asyncio.create_task(self._replay(lane, sub, 0, salt, session_id)))
            await asyncio.gather(*children)
        finally:
            for child in children:
                child.cancel()

    def _think_time(self, turn: Turn) -> float:
        return min(turn.think_time_s, IDLE_GAP_CAP_S) * self.config.think_scale

    async def _think(self, turn: Turn) -> None:
        wait = min(self._think_time(turn), self.deadline - self.clock())
        if wait > 0:
            await asyncio.sleep(wait)

    async def _send(self, lane: int, session: Session, turn: Turn, salt: str, session_id: str,
                    hints: dict, kind: str) -> None:
        """One request; `kind` (first, turn, branch, compaction, retry) labels its record."""
        prompt = prompt_token_ids(session, turn, salt, self.backend.token_range)
        max_tokens = max(1, min(turn.output_tokens, self.config.max_output_tokens or turn.output_tokens))
        cap = self.config.max_context
        if self.backend.max_prompt_tokens is not None:
            max_tokens = min(max_tokens, max(1, self.backend.max_prompt_tokens // 4))
            limit = self.backend.max_prompt_tokens - max_tokens
            cap = limit if cap is None else min(cap, limit)
        if cap is not None:
            prompt = prompt[:cap]
        request = TurnRequest(prompt.tolist(), max_tokens, session_id, turn.index, hints)
        lane_requests = self._lane_counts.setdefault(lane, 0)
        self._lane_counts[lane] = lane_requests + 1
        warmup = lane_requests < self.config.warmup_requests_per_lane
        if not warmup:
            await self._profiling.wait()  # the lane's own subagents wait here during warm-up
            if self._stopping():
                return
        self.in_flight += 1
        try:
            record = await self.backend.send(request)
        finally:
            self.in_flight -= 1
        record = replace(record, kind=kind)
        self.records.append((record, not warmup and record.start_time_s >= self.t_profile + self.config.warmup_s))
        if lane_requests + 1 == self.config.warmup_requests_per_lane:
            self._lanes_warm += 1
            if self._lanes_warm == self.config.lanes:
                self._start_profiling()
        if record.error is not None:
            logger.warning("request %s turn %d failed: %s", session_id, turn.index, record.error)

    def _print_progress(self, final: bool = False) -> None:
        """Two bars on stderr: the warm-up (lanes done with their first requests), then the profiling
        time against `duration_s`, with an ETA; after the deadline, the in-flight requests draining."""
        errors = sum(1 for record, _ in self.records if record.error is not None)
        note = f"requests {len(self.records)}, errors {errors}, in flight {self.in_flight}"
        if self._bars is None:
            self._bars = (ProgressBar(self.config.lanes, f"{self.label} warm-up", unit=" lanes"),
                          ProgressBar(self.config.duration_s, self.label, unit=" s"))
        warm, profile = self._bars
        if not self._profiling.is_set():
            warm.update(self._lanes_warm, note)
        else:
            warm.close(note)
            elapsed = self.clock() - self.t_profile
            profile.update(elapsed, note if elapsed < self.config.duration_s else f"draining: {note}")
        if final:
            warm.close(note)
            profile.close(note)


def load_sessions(config: AgentxConfig) -> list[Session]:
    path = Path(config.traces)
    if not path.is_dir():
        raise InvalidRequestError(f"--traces {path} is not a directory of weka traces")
    augment = config.augment()
    if not augment.active:
        return load_weka_traces(path, config.context_scale)
    sessions = augment_sessions(load_weka_traces(path, 1.0), augment)
    return [scale_session(session, session.block_size, config.context_scale) for session in sessions]


async def run_agentx_async(config: AgentxConfig, backend: Backend,
                           sessions: Sequence[Session] | None = None) -> dict:
    sessions = load_sessions(config) if sessions is None else sessions
    return await AgentxRun(config, sessions, backend).run()


def run_agentx(config: AgentxConfig, backend: Backend | None = None, *, url: str | None = None,
               model: str | None = None, sessions: Sequence[Session] | None = None,
               **backend_args: Any) -> dict:
    """Runs one replay to completion and returns its summary. Without `backend`: an `HttpBackend`
    on `url`, or else an in-process engine on `model` (engine settings in `backend_args`)."""
    sessions = load_sessions(config) if sessions is None else sessions

    async def main() -> dict:
        chosen = backend
        if chosen is None:
            chosen = (HttpBackend(url, model, **backend_args) if url
                      else EngineBackend.from_model(model, **backend_args))
        return await run_agentx_async(config, chosen, sessions)

    return asyncio.run(main())
