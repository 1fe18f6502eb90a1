"""The device side of the engine: parameters, the KV pages, and the compiled step per shape.

`ModelRunner.execute(rows, sampling)` pads the rows into a `RaggedBatch`, runs the jitted sampling
step (the KV pages are donated and replaced by the returned buffer) and returns one token per row.
It records every compiled shape, so tests and benchmarks can check that steady state never
recompiles.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import jax
import numpy as np

from agentjax.config import ModelConfig
from agentjax.runner.batch import RaggedBatch
from agentjax.runner.compilation_cache import enable_compilation_cache
from agentjax.runner.sampler import SamplingMetadata
from agentjax.runner.step import make_sampling_step

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns params and KV pages; runs one ragged batch per call."""

    def __init__(self, cfg: ModelConfig, params, num_pages: int, page_size: int, numerics: str = "fast"):
        enable_compilation_cache()
        self.cfg = cfg
        self.params = params
        self.page_size = page_size
        self.num_pages = num_pages
        self.numerics = numerics
        self.kv_pages = cfg.new_kv_pages(num_pages, page_size)
        self._steps = {
            True: make_sampling_step(cfg, numerics, greedy_only=True),
            False: make_sampling_step(cfg, numerics, greedy_only=False),
        }
        self.compiled_shapes: set[tuple] = set()
        # Wall time of the last call spent waiting on the device (dispatch to tokens on the host).
        self.last_device_s = 0.0

    def execute(
        self,
        rows: Sequence[tuple[Sequence[int], int, Sequence[int]]],
        sampling: Sequence[tuple[float, int, float, int, int]],
        token_bitmask: np.ndarray | None = None,
    ) -> np.ndarray:
        """Run rows of `(new_tokens, num_computed, page_table)`; `sampling` per row is
        `(temperature, top_k, top_p, seed, num_generated)`; `token_bitmask` (`[rows, words]`,
        optional) limits each row's tokens. Returns a token per row."""
        batch = RaggedBatch.build(rows, self.page_size)
        num_rows = batch.num_seqs
        greedy_only = all(s[0] == 0.0 for s in sampling)
        meta = SamplingMetadata.greedy(num_rows, self.cfg.vocab_size)
        if token_bitmask is not None:
            meta.token_bitmask[: len(rows)] = token_bitmask
        if not greedy_only:
            for row, (temperature, top_k, top_p, seed, generated) in enumerate(sampling):
                meta.temperature[row] = temperature
                meta.top_k[row] = top_k
                meta.top_p[row] = top_p
                meta.seeds[row] = seed
                meta.num_generated[row] = generated
        key = (*batch.shape_key(), greedy_only)
        if key not in self.compiled_shapes:
            logger.debug("compiling step for shape %s", key)
            self.compiled_shapes.add(key)
        started = time.perf_counter()
        tokens, self.kv_pages = self._steps[greedy_only](self.params, self.kv_pages, batch, meta)
        tokens = np.asarray(jax.device_get(tokens))[: len(rows)]
        self.last_device_s = time.perf_counter() - started
        return tokens

    def reset_kv(self) -> None:
        self.kv_pages = self.cfg.new_kv_pages(self.num_pages, self.page_size)

