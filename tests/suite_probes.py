"""What the suite report measures in one test process: CPU time (its own and its reaped children's),
resident memory and its peak, memory mappings, and the XLA executables JAX builds.

Linux's /proc gives the memory figures (0 elsewhere). Nothing here imports jax: the compile counter
attaches to JAX's monitoring events once some test module has imported it.
"""
from __future__ import annotations

import os
import resource
import sys
import threading
import time
from dataclasses import dataclass, fields

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # wraps every XLA compile (or cache load)
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
PERSISTENT_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def memory_map_count(pid: int | str = "self") -> int:
    """Memory mappings of a process (Linux aborts one that passes vm.max_map_count)."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return 0


def _status_kib(field: str, pid: int | str = "self") -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(field):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def resident_bytes(pid: int | str = "self") -> int:
    return _status_kib("VmRSS:", pid) << 10


def peak_resident_bytes(pid: int | str = "self") -> int:
    """The largest resident size since the process started or since reset_peak_resident()."""
    return _status_kib("VmHWM:", pid) << 10


def reset_peak_resident() -> None:
    """Start the kernel's peak-resident counter of this process over (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        pass


def descendant_pids(pid: int | str = "self") -> list[int]:
    """Every live process below this one (servers a test started, and what they started)."""
    found: list[int] = []
    pending = [str(pid)]
    while pending:
        parent = pending.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as children:
                    kids = children.read().split()
            except OSError:
                continue
            found.extend(int(kid) for kid in kids)
            pending.extend(kids)
    return found


def cpu_seconds() -> tuple[float, float]:
    """(this process's user+system seconds, all threads; those of its children already waited for)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time(), children.ru_utime + children.ru_stime


class CompileCounter:
    """Counts the executables XLA builds and loads in this process, from JAX's monitoring events.

    JAX reports one backend-compile duration per executable it needs (a fresh jit shape, a primitive
    run eagerly, a call after jax.clear_caches()); an executable read from the persistent compilation
    cache reports a cache hit too, so built = needed - hits."""

    def __init__(self) -> None:
        self.needed = self.cache_hits = 0
        self.compile_seconds = self.trace_seconds = self.lower_seconds = 0.0
        self._lock = threading.Lock()
        self._attached = False

    def attach_if_jax_loaded(self) -> None:
        if self._attached or "jax" not in sys.modules:
            return
        from jax import monitoring

        monitoring.register_event_duration_secs_listener(self._on_duration)
        monitoring.register_event_listener(self._on_event)
        self._attached = True

    def detach(self) -> None:
        if self._attached:
            from jax import monitoring

            monitoring.unregister_event_duration_listener(self._on_duration)
            monitoring.unregister_event_listener(self._on_event)
            self._attached = False

    def _on_duration(self, event: str, seconds: float, **_: object) -> None:
        with self._lock:
            if event == BACKEND_COMPILE_EVENT:
                self.needed += 1
                self.compile_seconds += seconds
            elif event == TRACE_EVENT:
                self.trace_seconds += seconds
            elif event == LOWER_EVENT:
                self.lower_seconds += seconds

    def _on_event(self, event: str, **_: object) -> None:
        if event == PERSISTENT_CACHE_HIT_EVENT:
            with self._lock:
                self.cache_hits += 1

    def totals(self) -> tuple[int, int, float, float, float]:
        with self._lock:
            return (self.needed - self.cache_hits, self.cache_hits, self.compile_seconds,
                    self.trace_seconds, self.lower_seconds)


@dataclass
class Sample:
    """One test's (or one process's) costs; the per-file and per-run rows add these up."""
    wall_s: float = 0.0
    cpu_s: float = 0.0           # this process, every thread (XLA compiles on its own threads)
    child_cpu_s: float = 0.0     # processes the test started and waited for (e2e servers)
    compiles: int = 0            # executables XLA built
    cache_loads: int = 0         # executables read from the persistent compilation cache
    compile_s: float = 0.0       # XLA compile (and cache read) time
    trace_s: float = 0.0         # tracing Python to jaxprs
    lower_s: float = 0.0         # lowering jaxprs to MLIR
    peak_rss: int = 0            # bytes, this process
    peak_maps: int = 0           # this process
    child_peak_rss: int = 0      # the largest descendant process seen
    child_peak_maps: int = 0

    ADDED = ("wall_s", "cpu_s", "child_cpu_s", "compiles", "cache_loads", "compile_s", "trace_s", "lower_s")

    def add(self, other: Sample) -> None:
        for name in self.ADDED:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("peak_rss", "peak_maps", "child_peak_rss", "child_peak_maps"):
            setattr(self, name, max(getattr(self, name), getattr(other, name)))

    def as_dict(self) -> dict:
        return {field.name: getattr(self, field.name) for field in fields(self)}

    @classmethod
    def from_dict(cls, data: dict) -> Sample:
        return cls(**{field.name: data.get(field.name, field.default) for field in fields(cls)})


class PeakWatcher:
    """A daemon thread that samples memory mappings (this process and its descendants) and the
    descendants' peak resident size every `interval_s`; the kernel keeps this process's own peak."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._maps = self._child_rss = self._child_maps = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="suite-report-peaks", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def sample(self) -> None:
        maps = memory_map_count()
        child_rss = child_maps = 0
        for pid in descendant_pids():
            child_rss = max(child_rss, peak_resident_bytes(pid))
            child_maps = max(child_maps, memory_map_count(pid))
        with self._lock:
            self._maps = max(self._maps, maps)
            self._child_rss = max(self._child_rss, child_rss)
            self._child_maps = max(self._child_maps, child_maps)

    def take(self) -> tuple[int, int, int]:
        """(peak maps, largest descendant's peak resident bytes, its peak maps) since the last take."""
        self.sample()
        with self._lock:
            peaks = self._maps, self._child_rss, self._child_maps
            self._maps = self._child_rss = self._child_maps = 0
        return peaks

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()
