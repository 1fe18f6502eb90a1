"""agentjax/runner/compile_counter.py: executables built on a thread inside `counting()`, from JAX's events."""
from __future__ import annotations

import threading

import jax
import jax.numpy as jnp

from agentjax.runner.compile_counter import CompileCounter


def test_counts_each_new_executable_once_and_only_inside_its_block():
    counter = CompileCounter()
    square = jax.jit(lambda x: x * x + 1.0)
    three, five, seven, eleven = (jnp.ones(n) for n in (3, 5, 7, 11))  # eager ops build executables too
    square(three)  # outside the block: not counted
    with counter.counting():
        square(three)  # already built
        square(five)  # a new shape: one executable
        with counter.counting():  # nested: still once
            jax.jit(lambda x: x - 2.0)(seven)
    assert counter.executables == 2 and counter.seconds > 0
    square(eleven)
    assert counter.executables == 2


def test_another_threads_compiles_are_not_this_counters():
    mine, theirs = CompileCounter(), CompileCounter()

    thirteen = jnp.ones(13)

    def other_thread():
        with theirs.counting():
            jax.jit(lambda x: x / 3.0)(thirteen)

    with mine.counting():
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
    assert mine.executables == 0 and theirs.executables == 1
