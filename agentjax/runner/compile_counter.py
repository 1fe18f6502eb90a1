"""Counts the XLA executables an engine builds, from JAX's monitoring events.

JAX records one backend-compile event for every executable it builds or loads from the persistent
compilation cache, on the thread that calls the jitted function. A `CompileCounter` counts the
events raised on a thread while that thread is inside `counter.counting()`: an engine wraps its
steps and its warm-up in it, so its count is what serving compiled, whatever other engines in the
process do. Host only: the listener is plain Python and never runs inside a traced function.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import jax

# jax._src.dispatch.BACKEND_COMPILE_EVENT: recorded once per executable compiled or loaded from the cache.
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

_owners = threading.local()  # the counters this thread is counting for, innermost last
_registered = False
_register_lock = threading.Lock()


def _on_duration_event(event: str, duration_s: float, **_: object) -> None:
    if event != BACKEND_COMPILE_EVENT:
        return
    for counter in getattr(_owners, "stack", ()):
        counter._add(duration_s)


def _ensure_listening() -> None:
    global _registered
    with _register_lock:
        if not _registered:
            jax.monitoring.register_event_duration_secs_listener(_on_duration_event)
            _registered = True


class CompileCounter:
    """Executables built (compiled or loaded from the persistent cache) on a thread inside `counting()`."""

    def __init__(self) -> None:
        self.executables = 0
        self.seconds = 0.0
        self._lock = threading.Lock()
        _ensure_listening()

    def _add(self, seconds: float) -> None:
        with self._lock:
            self.executables += 1
            self.seconds += seconds

    @contextlib.contextmanager
    def counting(self) -> Iterator["CompileCounter"]:
        """Count the executables this thread builds until the block ends (nested blocks count once)."""
        stack = getattr(_owners, "stack", None)
        if stack is None:
            stack = _owners.stack = []
        if self in stack:
            yield self
            return
        stack.append(self)
        try:
            yield self
        finally:
            stack.remove(self)
