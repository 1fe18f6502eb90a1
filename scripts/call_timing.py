"""Wall seconds of a jitted call, each call waited on (`jax.block_until_ready`) after untimed warm-up calls
(the first one compiles): the timing loop of the micro-benchmarks and device checks. It only times."""
from __future__ import annotations

import time


def call_seconds(fn, *args, repeats: int, warmups: int = 1) -> list[float]:
    """Seconds of each of `repeats` calls of `fn(*args)`, after `warmups` untimed calls."""
    import jax

    for _ in range(warmups):
        jax.block_until_ready(fn(*args))
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(fn(*args))
        seconds.append(time.perf_counter() - started)
    return seconds
