"""`AsyncEngine`: one background thread owns the (not thread-safe) engine; asyncio handlers talk to it.

Handlers submit add / abort / end-session commands through a thread-safe queue; the thread runs
`engine.step()` while work exists and sleeps on an event when idle, and hands each step's outputs
back to the event loop with `call_soon_threadsafe`, into one asyncio queue per request.
Nothing but the engine thread ever touches the engine.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentjax.server.errors import EngineFailedError, ServerOverloadedError

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5


@dataclass(eq=False)
class RequestStream:
    """The outputs of one request, as the event loop receives them."""

    request_id: str
    arrival_time: float = field(default_factory=time.monotonic)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    first_token_time: float | None = None
    last_token_time: float | None = None
    done: bool = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self):
        if self.done and self.queue.empty():
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.done = True
            raise item
        if item.finished:
            self.done = True
        return item


class AsyncEngine:
    """Runs an `Engine` in a background thread and streams its outputs to asyncio tasks."""

    def __init__(self, engine: Any, *, max_queued_requests: int = 256,
                 on_output: Callable[[RequestStream, Any, float], None] | None = None):
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.on_output = on_output
        self.max_model_len: int = engine.max_model_len
        self.kv_capacity_tokens: int | None = _kv_capacity_tokens(engine)  # tokens one request's pages may hold
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}  # owned by the event loop
        self._live: set[str] = set()  # request ids inside the engine; owned by the engine thread
        self.stats: dict = dict(engine.stats())  # replaced (never mutated) by the engine thread
        self.healthy = True
        self._closing: BaseException | None = None  # set by `fail_all`: new requests get it at once
        # (take the engine's KV events, hand them on): drained by the engine thread with each stats
        # snapshot; set before `start` (agentjax.server.kv_view.attach_kv_event_log)
        self.kv_event_sink: tuple[Callable[[], list], Callable[[list], None]] | None = None

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="agentjax-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Aborts what is left and joins the engine thread."""
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("engine thread did not stop within %.0fs", timeout)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- called from the event loop ---------------------------------------------------------
    async def add_request(self, prompt_token_ids: list[int], sampling: Any, *, check: Any = None,
                          **engine_kwargs: Any) -> RequestStream:
        """Queues a request; raises the engine's validation error, or 429 beyond the bound. `check`, a
        `StructuredOutput` the request does not decode under (the tools of an `auto` tool choice), must
        compile as one it did (`InvalidRequestError` otherwise), checked on the same trip."""
        if self._closing is not None:
            raise self._closing
        if len(self._streams) >= self.max_queued_requests:
            raise ServerOverloadedError(
                f"the server already has {len(self._streams)} requests queued or running "
                f"(limit {self.max_queued_requests}); retry later", code="server_overloaded")
        stream = RequestStream(f"req-{uuid.uuid4().hex}")
        self._streams[stream.request_id] = stream
        accepted = self._loop.create_future()
        self._submit(("add", stream.request_id, prompt_token_ids, sampling, engine_kwargs, accepted, check))
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(stream.request_id)
            raise
        except Exception:
            self._streams.pop(stream.request_id, None)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Stops a request and releases its pages; a no-op once it has finished."""
        stream = self._streams.pop(request_id, None)
        if stream is not None and not stream.done:
            self._submit(("abort", request_id))

    def fail_all(self, error: BaseException) -> None:
        """Ends every request in flight with `error` (their streams send it as an error event) and
        refuses new ones with it: the graceful shutdown's deadline (`agentjax.server.launcher`)."""
        self._closing = error
        for request_id in list(self._streams):  # at once, on the loop: a step may run for a while yet
            self._streams.pop(request_id).queue.put_nowait(error)
        self._submit(("fail_all", error))  # the engine thread aborts them and frees their pages

    def end_session(self, session_id: str) -> None:
        self._submit(("end_session", session_id))

    async def flush_offload(self) -> dict[str, bool] | None:
        """Returns once the page stores of every turn that has ended so far have reached their offload
        tiers, with each tier's degraded flag; None when the engine has no offload tiers."""
        flushed = self._loop.create_future()
        self._submit(("flush_offload", flushed))
        return await flushed

    def _submit(self, command: tuple) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _deliver(self, batch: list[tuple[str, Any]]) -> None:
        now = time.monotonic()
        for request_id, item in batch:
            stream = self._streams.get(request_id)
            if stream is None:
                continue  # aborted while the step ran
            if not isinstance(item, BaseException):
                if self.on_output is not None:
                    self.on_output(stream, item, now)
                stream.first_token_time = stream.first_token_time or now
                stream.last_token_time = now
            if isinstance(item, BaseException) or item.finished:
                self._streams.pop(request_id, None)
            stream.queue.put_nowait(item)

    def _resolve(self, future: asyncio.Future, error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    # ---- the engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                self._drain_commands()
                if self._stopping:
                    break
                if self.engine.has_unfinished():
                    self._step()
                else:
                    self._dispatch_stores()
                    self._publish_stats()
                    self._wakeup.wait(IDLE_WAIT_S)
                    self._wakeup.clear()
            except Exception:  # keep serving: fail what is in flight rather than hang it
                logger.exception("engine loop error; failing the %d requests in flight", len(self._live))
                self._fail_live(EngineFailedError("the engine loop failed; see the server log"))
                time.sleep(0.1)
        for request_id in list(self._live):
            self.engine.abort(request_id)
        self._fail(list(self._live), EngineFailedError("the server is shutting down", code="shutdown"))
        self._live.clear()

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            kind = command[0]
            if kind == "add":
                _, request_id, prompt, sampling, kwargs, accepted, check = command
                error = None
                try:
                    if check is not None and isinstance(getattr(type(self.engine), "grammar", None), property):
                        self.engine.grammar.check(check)
                    self.engine.add_request(prompt, sampling, request_id, **kwargs)
                    self._live.add(request_id)
                except Exception as exc:  # validation errors go back to the handler that asked
                    error = exc
                self._loop.call_soon_threadsafe(self._resolve, accepted, error)
            elif kind == "abort":
                if command[1] in self._live:
                    self._live.discard(command[1])
                    self.engine.abort(command[1])
            elif kind == "end_session":
                end_session = getattr(self.engine, "end_session", None)
                if end_session is not None:
                    end_session(command[1])
            elif kind == "flush_offload":
                self._flush_offload(command[1])
            elif kind == "fail_all":
                self._fail_live(command[1])
        self._publish_stats()

    def _flush_offload(self, flushed: asyncio.Future) -> None:
        """The stores of the turns that ended so far go to their tiers now; `flushed` gets each tier's
        degraded flag once they are there (None without offload tiers)."""
        flush = getattr(self.engine, "flush_offload", None)

        def reached(degraded: dict[str, bool]) -> None:  # from an offload tier thread
            self._loop.call_soon_threadsafe(_settle, flushed, degraded)

        try:
            if flush is None or not flush(reached):
                self._loop.call_soon_threadsafe(_settle, flushed, None)
        except Exception as error:  # the flush fails, not the requests in flight
            logger.exception("dispatching the offload stores failed")
            self._loop.call_soon_threadsafe(_settle, flushed, error)

    def _dispatch_stores(self) -> None:
        """Idle: the stores of the turns that just ended go to their tiers now, not with the next request."""
        dispatch = getattr(self.engine, "dispatch_offload_stores", None)
        if dispatch is not None:
            dispatch()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing the %d requests in flight", len(self._live))
            self._fail_live(EngineFailedError(f"the engine failed: {type(exc).__name__}: {exc}"))
            return
        batch = []
        for output in outputs:
            if output.finished:
                self._live.discard(output.request_id)
            batch.append((output.request_id, output))
        self._publish_stats()
        if batch:
            self._loop.call_soon_threadsafe(self._deliver, batch)

    def _fail_live(self, error: BaseException) -> None:
        failed = list(self._live)
        self._live.clear()
        for request_id in failed:
            try:
                self.engine.abort(request_id)
            except Exception:  # the engine is already broken; the failure notice matters more
                logger.exception("abort of %s failed", request_id)
        self._fail(failed, error)

    def _fail(self, request_ids: list[str], error: BaseException) -> None:
        if not request_ids or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(self._deliver, [(r, error) for r in request_ids])
        except RuntimeError:  # the event loop already closed: nobody is waiting
            logger.debug("dropped failure notices for %d requests", len(request_ids))

    def _publish_stats(self) -> None:
        self.stats = dict(self.engine.stats())
        if self.kv_event_sink is not None:
            take_events, hand_on = self.kv_event_sink
            events = take_events()
            if events:
                hand_on(events)


def _settle(future: asyncio.Future, value: Any) -> None:
    if future.done():
        return
    if isinstance(value, BaseException):
        future.set_exception(value)
    else:
        future.set_result(value)


def _kv_capacity_tokens(engine: Any) -> int | None:
    """How many tokens one request may hold in the engine's KV pool (a data-parallel engine's: a rank's), by
    the engine's own fit rule; for an engine without a KV manager, pages times page size if it says."""
    rank = getattr(engine, "ranks", [engine])[0]
    kv = getattr(rank, "kv", None)
    chunk_tokens = getattr(getattr(rank, "config", None), "max_num_batched_tokens", None)
    if (hasattr(kv, "max_pages_for") and isinstance(getattr(rank, "max_model_len", None), int)
            and isinstance(chunk_tokens, int)):
        from agentjax.request_fit import request_token_capacity

        return request_token_capacity(kv, rank.max_model_len, chunk_tokens)
    pages = engine.stats().get("kv_total_blocks")
    block_size = getattr(getattr(engine, "config", None), "block_size", None)
    if isinstance(pages, int) and isinstance(block_size, int) and pages > 0:
        return pages * block_size
    return None
