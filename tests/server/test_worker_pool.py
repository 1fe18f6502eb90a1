"""The worker pool: work runs on its threads (not the event loop's), errors come back, and beyond its
bound a call is refused with 429 rather than queued without end."""
from __future__ import annotations

import asyncio
import threading

import pytest

from agentjax.server.errors import ServerOverloadedError
from agentjax.server.worker_pool import WorkerPool


def test_work_runs_off_the_loop_thread_errors_propagate_and_the_bound_is_enforced():
    async def scenario():
        pool = WorkerPool(workers=1, max_waiting=2)
        loop_thread = threading.get_ident()
        assert await pool.run(threading.get_ident) != loop_thread
        with pytest.raises(ZeroDivisionError):
            await pool.run(lambda: 1 / 0)
        gate = threading.Event()
        held = [asyncio.ensure_future(pool.run(gate.wait, 10)) for _ in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(ServerOverloadedError) as refused:
            await pool.run(int)
        assert refused.value.status_code == 429 and pool.pending == 2
        gate.set()
        assert await asyncio.gather(*held) == [True, True] and pool.pending == 0
        pool.shutdown()

    asyncio.run(scenario())
