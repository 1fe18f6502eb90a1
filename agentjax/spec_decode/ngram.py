"""N-gram prompt lookup: draft tokens copied from where the sequence's last tokens occurred before.

`NgramProposer.propose(tokens, k)` looks for earlier occurrences of the sequence's last
`prompt_lookup_min`..`prompt_lookup_max` tokens (the prompt and the output so far, together) and
proposes the up to `k` tokens that followed the best one: the longest match, the latest of equally
long ones. `RequestTokens` keeps each request's tokens in a growing numpy array so a step does not
rebuild it. Host only: never imports jax, never sees logits.
"""
from __future__ import annotations

import weakref
from typing import Any

import numpy as np


class NgramProposer:
    """Prompt lookup over one token sequence (vLLM's `ngram` method)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, tokens: np.ndarray, k: int) -> list[int]:
        """Up to `k` tokens that followed the best earlier match of the sequence's suffix ([] if none)."""
        size = len(tokens)
        if k <= 0 or size <= self.min_n:
            return []
        last = tokens[size - 1]
        ends = np.flatnonzero(tokens[: size - 1] == last)  # candidate matches end at these indices
        if ends.size == 0:
            return []
        lengths = np.ones(ends.size, np.int32)
        alive = np.ones(ends.size, bool)
        for back in range(1, min(self.max_n, size - 1)):
            before = ends - back
            alive &= before >= 0
            alive &= tokens[np.maximum(before, 0)] == tokens[size - 1 - back]
            if not alive.any():
                break
            lengths += alive
        best = int(lengths.max())
        if best < self.min_n:
            return []
        start = int(ends[np.flatnonzero(lengths == best)[-1]]) + 1
        return tokens[start : start + k].tolist()


class RequestTokens:
    """Each request's prompt and output as a numpy array, extended as tokens arrive."""

    def __init__(self):
        self._arrays: weakref.WeakKeyDictionary[Any, tuple[np.ndarray, int]] = weakref.WeakKeyDictionary()

    def of(self, request) -> np.ndarray:
        """`request.all_token_ids` as int64 (only the new tokens are copied since the last call)."""
        total = request.num_tokens
        entry = self._arrays.get(request)
        if entry is None or entry[1] > total:  # new, or its output was cut back
            array = np.empty(max(64, 2 * total), np.int64)
            array[:total] = request.all_token_ids
        else:
            array, have = entry
            if total > len(array):
                grown = np.empty(2 * total, np.int64)
                grown[:have] = array[:have]
                array = grown
            prompt_len = len(request.prompt_token_ids)
            array[have:total] = request.token_ids_between(have, total) if have < prompt_len \
                else request.output_token_ids[have - prompt_len:]
        self._arrays[request] = (array, total)
        return array[:total]
