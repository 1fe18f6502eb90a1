"""A bounded pool of threads for request work that must not run on the event loop.

Parsing a big body, rendering a chat template and tokenizing a prompt take time in proportion to
the body (seconds for a few megabytes); on the event loop they would stall every other request and
`/health`. The tokenizer releases the GIL while it encodes, so a thread keeps the loop answering.
The pool has a fixed number of threads and a bounded queue: beyond it a request gets 429. Never
touches the engine.
"""
from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from agentjax.server.errors import ServerOverloadedError

T = TypeVar("T")
DEFAULT_WORKERS = 2
DEFAULT_MAX_WAITING = 64


class WorkerPool:
    """`await pool.run(fn, *args)`: `fn` runs on one of `workers` threads; at most `max_waiting`
    calls are queued or running at once (429 beyond)."""

    def __init__(self, workers: int = DEFAULT_WORKERS, max_waiting: int = DEFAULT_MAX_WAITING):
        self.workers = workers
        self.max_waiting = max_waiting
        self.pending = 0
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="agentjax-prepare")

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self.pending >= self.max_waiting:
            raise ServerOverloadedError(f"{self.pending} requests are already being parsed or tokenized (limit "
                                        f"{self.max_waiting}); retry later", code="server_overloaded")
        self.pending += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))
        finally:
            self.pending -= 1

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
