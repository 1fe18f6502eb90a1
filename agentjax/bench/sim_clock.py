"""The simulator's time and its stand-in for the model runner: a virtual clock, an asyncio loop on it,
the step timer that charges each step's cost-model time, and `VirtualRunner`, which records a step's
rows and returns fake tokens (and, with speculation, proposes and accepts drafts as a device drafter).
Host only: never runs a model.
"""
from __future__ import annotations

import asyncio
import selectors

import numpy as np

from agentjax.bench.costmodel import CostModel
from agentjax.bench.speculation import AcceptanceSampler, Speculation
from agentjax.errors import InvalidRequestError
from agentjax.buckets import PAGE_BUCKETS, SEQ_BUCKETS, TOKEN_BUCKETS, bucket

FAKE_TOKEN = 300  # every "sampled" token and draft: the scheduler needs one per finished row, never a real one
REJECTED_TOKEN = 301  # the target's token where it rejects a draft


class VirtualClock:
    """Seconds of simulated time; the runner advances it by each step's projected time."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise InvalidRequestError(f"a step cannot take {seconds} s")
        self.now += seconds


class _VirtualSelector(selectors.DefaultSelector):
    """Waiting for I/O or a timer moves the virtual clock on instead of sleeping."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self.clock = clock

    def select(self, timeout: float | None = None):
        if timeout is None:
            raise RuntimeError("the simulation stalled: nothing is scheduled and no timer is pending")
        if timeout > 0:
            self.clock.advance(timeout)
        return super().select(0)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on a `VirtualClock`: `asyncio.sleep(60)` returns at once, 60 s later."""

    def __init__(self, clock: VirtualClock) -> None:
        self._virtual_clock = clock
        super().__init__(selector=_VirtualSelector(clock))

    def time(self) -> float:
        return self._virtual_clock.now


class StepTimer:
    """Charges steps to the clock. With one rank each step is charged as it runs; with several
    (DEP), the group collects every rank's rows and charges the lockstep step once. With `defer`
    (an instance of a deployment), the seconds are kept for its driver to sleep (`take_deferred`)
    instead of moving the shared clock."""

    def __init__(self, model: CostModel, clock: VirtualClock, role: str = "mixed", keep_log: bool = False,
                 defer: bool = False) -> None:
        self.model, self.clock, self.role, self.defer = model, clock, role, defer
        self.log: list[tuple[float, list[list[tuple[int, int]]]]] | None = [] if keep_log else None
        self.ranks = model.layout.dp
        self.pending: list[list[tuple[int, int]]] = [[] for _ in range(self.ranks)]
        self.sampled: list[list[int]] = [[] for _ in range(self.ranks)]
        self.seen_shapes: set[tuple] = set()
        self.new_shape = False
        self.steps = 0
        self.busy_s = 0.0
        self.tokens = 0
        self.token_slots = 0  # the tokens of the steps' padded shapes, over every rank (the engine's buckets)
        self.deferred = 0.0

    def record(self, rank: int, rows: list[tuple[int, int]], shape_key: tuple, decode: list[bool] | None = None,
               sampled: list[int] | None = None) -> None:
        """One rank's rows; `decode[i]`: row i is a decode (its tokens are its samples: one, or one
        plus its drafts); `sampled`: the positions of the kept samples (the drafter chains there)."""
        if self.role == "decode":  # the prompt's KV arrives from a prefill instance: no compute here
            decode = decode if decode is not None else [n == 1 for n, _ in rows]
            rows = [row for row, is_decode in zip(rows, decode) if is_decode]
        self.pending[rank] = rows
        self.sampled[rank] = list(sampled or [])
        if shape_key not in self.seen_shapes:
            self.seen_shapes.add(shape_key)
            self.new_shape = True
        if self.ranks == 1:
            self.charge()

    def charge(self) -> float:
        if not any(self.pending):
            return 0.0
        sampled = self.sampled if self.model.speculation is not None else None
        seconds = self.model.step_time(self.pending, new_shape=self.new_shape, sampled=sampled)
        if self.log is not None:
            self.log.append((seconds, self.pending))
        real = sum(n for rows in self.pending for n, _ in rows)
        padded = self.model.padded_shape(self.pending)
        self.tokens += real
        self.token_slots += padded[0] * self.ranks if padded is not None else real
        self.pending = [[] for _ in range(self.ranks)]
        self.sampled = [[] for _ in range(self.ranks)]
        self.new_shape = False
        self.steps += 1
        self.busy_s += seconds
        self.spend(seconds)
        return seconds

    def spend(self, seconds: float) -> None:
        """Time the instance is busy (a step) or waits (an idle engine waiting for a KV copy)."""
        if self.defer:
            self.deferred += seconds
        else:
            self.clock.advance(seconds)

    def take_deferred(self) -> float:
        seconds, self.deferred = self.deferred, 0.0
        return seconds


class VirtualRunner:
    """Stands in for `ModelRunner`: records the rows with the step timer, returns fake tokens. With
    speculation it is also the device drafter: it proposes `num_speculative_tokens` drafts per row
    (`last_drafts`) and, when a row carries drafts, accepts them at the stated rates."""

    def __init__(self, timer: StepTimer, rank: int = 0, speculation: Speculation | None = None,
                 page_size: int = 16, seed: int = 0) -> None:
        self.timer, self.rank = timer, rank
        self.compiled_shapes: set[tuple] = set()
        self.last_device_s = 0.0
        self.page_size = page_size
        self.speculation = speculation
        self.drafter = speculation.method if speculation is not None else None  # the engine asks for its drafts
        self.sampler = AcceptanceSampler(speculation, seed + rank) if speculation is not None else None
        self.last_drafts = np.zeros((0, 0), dtype=np.int64)
        self.drafts_accepted = self.drafts_proposed = 0

    def execute(self, rows, sampling, token_bitmask=None, kv_copies=(), sample_counts=None,
                next_tokens=None) -> np.ndarray:
        counts = [(len(tokens), int(start)) for tokens, start, _ in rows]
        samples = list(sample_counts) if sample_counts is not None else [1] * len(rows)
        tables = [tables for _, _, tables in rows]
        pages = tuple(bucket(max(1, max(len(t[g]) for t in tables)), PAGE_BUCKETS) for g in range(len(tables[0])))
        # ModelRunner's compiled-shape key: (tokens, rows, pages per group, greedy only)
        key = (bucket(sum(n for n, _ in counts), TOKEN_BUCKETS), bucket(len(rows), SEQ_BUCKETS), pages, True)
        self.compiled_shapes.add(key)
        decode = [n == c for (n, _), c in zip(counts, samples)]
        kept = None  # a row whose next token is unknown keeps its sample: the drafter chains there
        if next_tokens is not None:
            kept = [start + n for (n, start), known in zip(counts, next_tokens) if known == -1]
        self.timer.record(self.rank, counts, key, decode, kept)
        tokens: list[int] = []
        for c in samples:
            if c == 1:
                tokens.append(FAKE_TOKEN)
                continue
            accepted = self.sampler.accepted(c - 1)  # drafts are FAKE_TOKEN: equal means accepted
            self.drafts_proposed += c - 1
            self.drafts_accepted += accepted
            tokens += [FAKE_TOKEN] * accepted + [REJECTED_TOKEN] * (c - accepted)
        if self.speculation is not None:
            self.last_drafts = np.full((len(rows), self.speculation.num_speculative_tokens), FAKE_TOKEN, dtype=np.int64)
        return np.asarray(tokens, dtype=np.int64)
