"""Checks a checkpoint's converted arrays against the names and shapes the model expects, all at once.

`check_tensors` runs on host arrays before anything is placed on a device, and raises one
`TensorMismatchError` that names every missing tensor, every wrongly shaped one (got vs expected)
and every unexpected one. Host only: numpy and plain Python, never jax.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from agentjax.errors import TensorMismatchError

# How many names of each kind of problem a message lists before it says "and N more".
NAMES_SHOWN = 8


def _listing(items: Sequence[str]) -> str:
    shown = ", ".join(items[:NAMES_SHOWN])
    return shown + (f", and {len(items) - NAMES_SHOWN} more" if len(items) > NAMES_SHOWN else "")


def tensor_problems(
    expected: Mapping[str, tuple[int, ...]],
    arrays: Mapping[str, np.ndarray],
    *,
    describe: Callable[[str], str] = str,
    unread: Sequence[str] = (),
) -> list[str]:
    """One line per kind of problem (missing, wrong shape, unexpected); empty when all match.

    `describe(name)` renders a parameter name in messages (e.g. with the source tensor behind it);
    `unread` lists source tensors that no parameter was made from (reported as unexpected).
    """
    missing = [describe(name) for name in expected if name not in arrays]
    wrong = [
        f"{describe(name)} has shape {tuple(arrays[name].shape)}, expected {tuple(shape)}"
        for name, shape in expected.items()
        if name in arrays and tuple(arrays[name].shape) != tuple(shape)
    ]
    unexpected = sorted(describe(name) for name in arrays if name not in expected) + sorted(unread)
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing: {_listing(missing)}")
    if wrong:
        problems.append(f"{len(wrong)} with the wrong shape: {_listing(wrong)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected: {_listing(unexpected)}")
    return problems


def check_tensors(
    expected: Mapping[str, tuple[int, ...]],
    arrays: Mapping[str, np.ndarray],
    *,
    where: str = "checkpoint",
    describe: Callable[[str], str] = str,
    unread: Sequence[str] = (),
) -> None:
    """Raise `TensorMismatchError` unless `arrays` has exactly the `expected` names and shapes."""
    problems = tensor_problems(expected, arrays, describe=describe, unread=unread)
    if problems:
        raise TensorMismatchError(f"{where} does not match the model's parameters: " + "; ".join(problems))
