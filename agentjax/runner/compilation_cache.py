"""The persistent XLA compilation cache, so a restart or a second process skips recompiling.

Compiling one step shape of a 30-layer model takes seconds on a CPU; cached executables load in
milliseconds. The cache lives in $AGENTJAX_XLA_CACHE (default ~/.cache/agentjax/xla); set it to
"off" to disable. It is capped at CACHE_MAX_BYTES (least recently used entries go first); the cap
also makes JAX take a file lock around every read and write, so a server, its tests and a second
process sharing the directory never read an entry another one is still writing.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import jax

from agentjax.progress import Heartbeat

logger = logging.getLogger(__name__)
_enabled = False
CACHE_MAX_BYTES = 4 << 30


def enable_compilation_cache() -> Path | None:
    """Point JAX's persistent cache at agentjax's cache directory (once per process)."""
    global _enabled
    setting = os.environ.get("AGENTJAX_XLA_CACHE", "")
    if setting.lower() == "off":
        return None
    path = Path(setting) if setting else Path.home() / ".cache" / "agentjax" / "xla"
    if not _enabled:
        try:
            path.mkdir(parents=True, exist_ok=True)
            jax.config.update("jax_compilation_cache_dir", str(path))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
            jax.config.update("jax_compilation_cache_max_size", CACHE_MAX_BYTES)
            _enabled = True
        except OSError as exc:
            logger.warning("compilation cache disabled: cannot use %s: %s", path, exc)
            return None
    return path


# Persistent-cache hits and misses recorded on this thread (JAX compiles on the calling thread).
_events = threading.local()
_listening = False


def _count_cache_event(event: str, **_: object) -> None:
    if event in ("/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"):
        setattr(_events, event, getattr(_events, event, 0) + 1)


def _cache_counts() -> tuple[int, int]:
    return (getattr(_events, "/jax/compilation_cache/cache_hits", 0),
            getattr(_events, "/jax/compilation_cache/cache_misses", 0))


def describe_step_shape(key: tuple) -> str:
    """'the step for 512 tokens x 8 rows, 32 pages a row' from a runner's shape key
    (tokens, rows, pages per row of each group, ...)."""
    tokens, rows, pages = key[0], key[1], key[2]
    text = f"the step for {tokens} tokens x {rows} rows"
    return text + (f", {max(pages)} pages a row" if pages else "")


@contextlib.contextmanager
def compile_notice(what: str) -> Iterator[None]:
    """Logs around the first call of a new step shape (its compile): where the executable is cached,
    a line every few seconds while it compiles, then whether it compiled or came from the cache."""
    global _listening
    if not _listening:
        jax.monitoring.register_event_listener(_count_cache_event)
        _listening = True
    cache = enable_compilation_cache()
    where = f"cached in {cache} for next time" if cache is not None else "the compilation cache is off"
    hits, misses = _cache_counts()
    with Heartbeat(logger, f"compiling {what} ({where})", doing=f"compiling {what}") as beat:
        yield
    new_hits, new_misses = _cache_counts()
    if new_hits > hits and new_misses == misses:
        logger.info("%s: loaded from the compilation cache in %.1f s", what, beat.elapsed)
    else:
        logger.info("%s: compiled in %.1f s", what, beat.elapsed)


def with_compile_notice(jitted, what: str):
    """`jitted`, announcing each new input shape's compile (`compile_notice`); its last argument is
    the page list, so the notice reads '<what> for N pages'."""
    seen: set[tuple] = set()

    def call(*args):
        key = tuple(getattr(arg, "shape", None) for arg in args)
        if key in seen:
            return jitted(*args)
        seen.add(key)
        with compile_notice(f"{what} for {len(args[-1])} pages"):
            return jitted(*args)

    return call
