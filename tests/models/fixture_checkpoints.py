"""The tiny checkpoints in tests/models/data and transformers' references beside them, loaded once per
process and shared by the parity, held-out and fuzzed-fixture tests."""
from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np

from agentjax.kv.cache_layout import page_tokens_multiple
from agentjax.models import load_model

DATA = Path(__file__).parent / "data"


@functools.cache
def reference(name: str, tag: str = "") -> dict[str, np.ndarray]:
    return dict(np.load(DATA / name / (f"reference_{tag}.npz" if tag else "reference.npz")))


@functools.cache
def model(name: str):
    return load_model(str(DATA / name))


def page(name: str) -> int:
    """Tokens per KV page: 16, or a multiple of the checkpoint's compression rates."""
    return math.lcm(16, page_tokens_multiple(model(name)[0]))
