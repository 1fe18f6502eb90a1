"""The one reader the hand-mapped HF families (MiniMax-M3, Kimi-K3, DeepSeek-V4) take their tensors with.

`TensorReader` fills an agentjax parameter from the first HF spelling present; an absent one is recorded as
its first candidate, so the loader's check names the HF tensor that is missing. Host only: no jax.
"""
from __future__ import annotations

import re

import numpy as np

from agentjax.errors import TensorMismatchError
from checkpoints.hf_tensors import HFTensors, contiguous


class TensorReader:
    """Reads HF tensors under `root` ("" or "model.") into `arrays` by agentjax parameter name."""

    def __init__(self, tensors: HFTensors, root: str = ""):
        self.tensors = tensors
        self.root = root
        self.arrays: dict[str, np.ndarray] = {}

    def name(self, candidates: list[str]) -> str | None:
        """The first of `candidates` the checkpoint holds (under the root), or None."""
        return next((self.root + c for c in candidates if self.root + c in self.tensors), None)

    def present(self, names: list[str]) -> bool:
        return all(self.root + n in self.tensors for n in names)

    def one(self, param: str, candidates: list[str], *, transpose: bool = False, shape: tuple | None = None,
            norm: bool = False) -> np.ndarray | None:
        """`param` from the first of `candidates` present: transposed (an HF `[out, in]` weight to a kernel),
        reshaped to `shape` where the sizes agree (A_log [1, 1, H, 1] vs [H], a pseudo-query [1, d] vs [d]),
        plus 1 with `norm` (a norm stored as weight - 1). None (and the origin recorded) when none is."""
        name = self.name(candidates)
        if name is None:
            self.tensors.origins[param] = self.root + candidates[0]
            return None
        array = self.tensors.take(name, param=param)
        array = contiguous(array.T) if transpose else array
        if shape is not None and array.size == int(np.prod(shape)):
            array = array.reshape(shape)
        self.arrays[param] = array + 1.0 if norm else array
        return self.arrays[param]

    def stacked(self, param: str, names: list[list[str]], transpose: bool = True) -> None:
        """`param` stacked over experts: `names[e]` are expert e's HF tensors (each transposed unless told
        otherwise) concatenated along the output dim (gate then up) into its kernel."""
        absent = next((n for group in names for n in group if self.root + n not in self.tensors), None)
        if absent is not None:
            raise TensorMismatchError(f"{self.tensors.where} lacks tensor {self.root + absent!r} "
                                      f"({len(names)} experts expected)")
        parts = [[self.tensors.take(self.root + n, param=param) for n in group] for group in names]
        self.arrays[param] = np.stack([np.concatenate([p.T if transpose else p for p in group], axis=1)
                                       for group in parts])
        self.tensors.origins[param] = self.root + re.sub(r"experts\.0\.", "experts.*.", names[0][0])
