"""Shared fixtures: the embedded model loaded once per test session in each numerics mode, and the
release of compiled executables after each test module."""
from __future__ import annotations

import gc
import sys

import pytest


@pytest.fixture(scope="session")
def smollm2_invariant():
    """LLM on SmolLM2 in batch-invariant numerics (exact across batching and chunking)."""
    from agentjax import LLM

    return LLM(numerics="batch_invariant", max_num_batched_tokens=512)


@pytest.fixture(scope="session")
def smollm2_fast():
    from agentjax import LLM

    return LLM()


def memory_map_count() -> int:
    """Memory mappings of this process (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return 0


# Past this many mappings the compiled executables are dropped (a quarter of Linux's default limit).
MAP_COUNT_TO_RELEASE = 16_000


@pytest.fixture(scope="module", autouse=True)
def release_compiled_executables():
    """Drop every compiled executable after a module once the process holds many memory mappings.

    A loaded XLA CPU executable keeps several memory mappings for its code. One pytest process runs
    thousands of step shapes over dozens of models, and past Linux's limit of 65,530 mappings
    (vm.max_map_count) the next executable XLA loads aborts the process. Live jitted functions
    stay usable: their next call reloads from the persistent compilation cache."""
    yield
    count = memory_map_count()
    _peak_map_count[0] = max(_peak_map_count[0], count)
    jax = sys.modules.get("jax")  # host-only test modules never import jax
    if jax is not None and count > MAP_COUNT_TO_RELEASE:
        jax.clear_caches()
        gc.collect()


_peak_map_count = [0]


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"peak memory mappings at the end of a test module: {_peak_map_count[0]} "
                                "(Linux aborts past vm.max_map_count, 65,530 by default)")
