"""Shared fixtures: the embedded model loaded once per test session in each numerics mode."""
from __future__ import annotations

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
