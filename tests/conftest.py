"""Shared fixtures: the embedded model loaded once per test session in each numerics mode, the
persistent compilation cache on from the start, and the release of compiled executables (and the
memory they hold) after each test module."""
from __future__ import annotations

import ctypes
import gc
import os
import sys
import time

import pytest

from tests.suite_probes import memory_map_count, resident_bytes


def _cache_every_executable() -> None:
    """Every test process reads and writes agentjax's persistent XLA cache from its first test on (not
    only once it builds a model runner), for executables of any compile time: an executable built once
    (by either worker, a server, or before a release of executables below) loads in milliseconds
    after, and a second run on the same machine loads nearly everything ($AGENTJAX_XLA_CACHE=off
    turns it off, as for agentjax itself)."""
    from agentjax.runner.compilation_cache import enable_compilation_cache

    if enable_compilation_cache() is not None:
        import jax

        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


_cache_every_executable()

pytest_plugins = ["tests.suite_report"]  # per-test and per-file costs, printed after every run


@pytest.fixture(scope="session")
def smollm2_invariant():
    """LLM on SmolLM2 in batch-invariant numerics (exact across batching and chunking)."""
    from agentjax import LLM

    return LLM(numerics="batch_invariant", max_num_batched_tokens=512)


@pytest.fixture(scope="session")
def smollm2_fast():
    from agentjax import LLM

    return LLM()


def _trim_malloc() -> None:
    """Hand glibc's freed heap back to the system, so a release shows in the resident size."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# Past this many mappings the compiled executables are dropped (a quarter of Linux's default limit).
MAP_COUNT_TO_RELEASE = 16_000
# Under pytest-xdist, past this resident size too: two such processes share the machine's memory.
RESIDENT_BYTES_TO_RELEASE = 4 << 30 if os.environ.get("PYTEST_XDIST_WORKER") else float("inf")


def _release_executables(jax) -> None:
    jax.clear_caches()
    gc.collect()
    _trim_malloc()


@pytest.fixture(scope="module", autouse=True)
def release_compiled_executables(request):
    """Drop every compiled executable after a module once the process holds many memory mappings
    (or, in a pytest-xdist worker, much memory).

    A loaded XLA CPU executable keeps several memory mappings for its code. One pytest process runs
    thousands of step shapes over dozens of models, and past Linux's limit of 65,530 mappings
    (vm.max_map_count) the next executable XLA loads aborts the process; JAX's caches also keep
    every executable's memory, which two pytest-xdist workers cannot both grow without bound. Live
    jitted functions stay usable: their next call reloads from the persistent compilation cache
    (or recompiles). $AGENTJAX_TEST_MEMORY_LOG names a file that gets one line per module."""
    yield
    count, resident = memory_map_count(), resident_bytes()
    jax = sys.modules.get("jax")  # host-only test modules never import jax
    released = jax is not None and (count > MAP_COUNT_TO_RELEASE or resident > RESIDENT_BYTES_TO_RELEASE)
    if released:
        _release_executables(jax)
    log = os.environ.get("AGENTJAX_TEST_MEMORY_LOG")
    if log:
        after = f" -> {memory_map_count()} maps {resident_bytes() >> 20} MiB" if released else ""
        with open(log, "a") as out:
            out.write(f"{time.strftime('%H:%M:%S')} {os.environ.get('PYTEST_XDIST_WORKER', 'main')} "
                      f"{request.module.__name__}: {count} maps {resident >> 20} MiB{after}\n")


# Within a module, after any test past these (the speculative-decoding files build hundreds of
# executables in one module: 37,286 mappings in one worker of a fresh-HOME run before this).
MAP_COUNT_TO_RELEASE_IN_MODULE = 20_000
RESIDENT_BYTES_TO_RELEASE_IN_MODULE = 6 << 30 if os.environ.get("PYTEST_XDIST_WORKER") else float("inf")


@pytest.fixture(autouse=True)
def release_compiled_executables_within_a_module():
    """The module-end release above, after a single test, once a module alone has grown the process
    far past it: the suite's bounds (tests/suite_report.py) are per process, not per module."""
    yield
    jax = sys.modules.get("jax")
    if jax is not None and (memory_map_count() > MAP_COUNT_TO_RELEASE_IN_MODULE
                            or resident_bytes() > RESIDENT_BYTES_TO_RELEASE_IN_MODULE):
        _release_executables(jax)


# Under pytest-xdist's `--dist loadfile` (scripts/bootstrap.sh test): files that share one worker, so
# that two of them never run at once, and the longest files, which start first (longest first keeps
# either worker from finishing long after the other).
SHARED_WORKER = {
    # The docs' commands (the longest file of the suite, mostly waiting on the servers and CLI processes
    # it starts) run beside the other end-to-end files, each group with a README server of its own.
    "tests/e2e/test_docs_commands.py": "tests/e2e/test_docs_commands.py",
    # the other end-to-end files: one README server (session-scoped) for them all
    "tests/e2e/": "tests/e2e",
    # Gemma-3's 262k-token vocabulary: several GiB of logits and weights at a time
    "tests/models/test_logit_parity.py": "gemma3",
    "tests/test_engine_sliding_window.py": "gemma3",
}
START_FIRST = [
    "tests/e2e/test_docs_commands.py", "tests/spec_decode/test_device_drafters.py", "tests/e2e",
    "tests/spec_decode/test_smollm2_speculative.py", "tests/test_engine_speculative.py", "tests/test_engine.py",
    "gemma3", "tests/sharding/test_context_parallel.py", "tests/models/test_quantized.py",
    "tests/models/test_dsv4_attention.py", "tests/models/test_dsv4_parity.py", "tests/test_engine_offload.py",
    "tests/test_engine_offload_faults.py", "tests/test_engine_offload_layouts.py",
    "tests/test_engine_speculative_layouts.py",
]


def scheduling_group(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return next((group for prefix, group in SHARED_WORKER.items() if path.startswith(prefix)), path)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the workers' order is the order files are handed out
        rank = {group: index for index, group in enumerate(START_FIRST)}
        items.sort(key=lambda item: rank.get(scheduling_group(item.nodeid), len(rank)))  # stable


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` with the groups above, handing out files in collection order."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupedFileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scheduling_group(nodeid)

    config.option.loadscopereorder = False  # keep START_FIRST's order, not the largest files first
    return GroupedFileScheduling(config, log)
