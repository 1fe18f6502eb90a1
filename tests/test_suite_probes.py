"""The suite report's probes (tests/suite_probes.py) measure what they say: one count per executable
JAX needs, the peak resident size after a reset, and the process's memory mappings."""
from __future__ import annotations

import numpy as np

from tests.suite_probes import (
    CompileCounter, Sample, memory_map_count, peak_resident_bytes, reset_peak_resident, resident_bytes,
)


def test_the_compile_counter_counts_each_executable_jax_needs_once():
    import jax

    counter = CompileCounter()
    counter.attach_if_jax_loaded()
    try:
        step = jax.jit(lambda x: x * 3.0 + 1.0)
        three, four = np.ones(3, np.float32), np.ones(4, np.float32)  # numpy inputs: no eager jax ops
        step(three)
        step(three)  # the same shape again: no new executable
        step(four)
        built, loads, *_ = counter.totals()
        # Built here or read from the persistent cache a test run keeps (a second run loads them).
        assert built + loads == 2
        jax.clear_caches()
        step(three)  # dropped executables are needed again
        built, loads, *_ = counter.totals()
        assert built + loads == 3
    finally:
        counter.detach()


def test_the_peak_resident_size_starts_over_and_sees_an_allocation():
    reset_peak_resident()
    start = peak_resident_bytes()
    block = np.ones(64 << 20, np.uint8)  # 64 MiB, touched
    assert peak_resident_bytes() >= start + (60 << 20)
    assert resident_bytes() > 0 and memory_map_count() > 10
    del block


def test_samples_add_costs_and_keep_the_largest_peaks():
    total = Sample(wall_s=1.0, cpu_s=2.0, compiles=3, peak_rss=10, peak_maps=7)
    total.add(Sample(wall_s=0.5, cpu_s=1.0, compiles=1, peak_rss=4, peak_maps=9))
    assert (total.wall_s, total.cpu_s, total.compiles, total.peak_rss, total.peak_maps) == (1.5, 3.0, 4, 10, 9)
    assert Sample.from_dict(total.as_dict()) == total
