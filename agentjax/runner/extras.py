"""What a step computes beyond one token per row, for the rows that ask: penalties, log probabilities
of the sampled tokens, and log probabilities of prompt tokens.

The engine describes them per row on the host (`StepExtras`); `ModelRunner` pads them into the
device inputs built here (`PenaltyInputs`, `PromptLogprobInputs`) with shapes from fixed buckets,
so a request's penalties, k or prompt length never compile a new step, and a step whose rows ask
for none of this runs the plain step and pays nothing. Builds numpy arrays on the host; never runs
anything on the device.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import jax
import numpy as np

from agentjax.ragged_batch import TOKEN_BUCKETS, RaggedBatch, bucket
from agentjax.runner.sampler import PenaltyInputs

# Entries per row of the penalty table (distinct tokens a row's penalties and bias touch).
PENALTY_ENTRY_BUCKETS = (16, 64, 256, 1024, 4096, 16384)


@dataclass(frozen=True)
class RowPenalties:
    """One row's penalties; `token_ids` lists every token with an output count, a prompt occurrence
    (when the repetition penalty is on) or a bias, each once or more (duplicates add up)."""

    presence: float
    frequency: float
    repetition: float
    token_ids: np.ndarray  # int32
    output_counts: np.ndarray  # int32, per entry
    seen: np.ndarray  # int32 0/1, per entry
    bias: np.ndarray  # float32, per entry


@dataclass
class StepExtras:
    """Per-row requests of one step: `logprobs` (rows whose sampled token's log probabilities are
    wanted), `penalties` by row, and `prompt_positions`: `(row, offsets into the row's new tokens,
    the prompt token that follows each offset)`."""

    logprobs: set[int] = field(default_factory=set)
    penalties: dict[int, RowPenalties] = field(default_factory=dict)
    prompt_positions: list[tuple[int, np.ndarray, np.ndarray]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.logprobs or self.penalties or self.prompt_positions)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PromptLogprobInputs:
    """Flat token indices (into the step's tokens) whose next prompt token gets a log probability,
    padded to a token bucket (padding: index 0, target 0, ignored)."""

    indices: np.ndarray  # [P] int32
    targets: np.ndarray  # [P] int32


def penalty_inputs(num_rows: int, penalties: dict[int, RowPenalties]) -> PenaltyInputs:
    """The padded `[B, K]` penalty table; rows without penalties get no entries and neutral values."""
    width = bucket(max((len(p.token_ids) for p in penalties.values()), default=1), PENALTY_ENTRY_BUCKETS)
    presence = np.zeros(num_rows, np.float32)
    frequency = np.zeros(num_rows, np.float32)
    repetition = np.ones(num_rows, np.float32)
    token_ids = np.zeros((num_rows, width), np.int32)
    counts = np.zeros((num_rows, width), np.int32)
    seen = np.zeros((num_rows, width), np.int32)
    bias = np.zeros((num_rows, width), np.float32)
    for row, p in penalties.items():
        size = len(p.token_ids)
        presence[row], frequency[row], repetition[row] = p.presence, p.frequency, p.repetition
        token_ids[row, :size] = p.token_ids
        counts[row, :size] = p.output_counts
        seen[row, :size] = p.seen
        bias[row, :size] = p.bias
    return PenaltyInputs(presence, frequency, repetition, token_ids, counts, seen, bias)


def prompt_logprob_inputs(batch: RaggedBatch, positions: Sequence[tuple[int, np.ndarray, np.ndarray]]
                          ) -> tuple[PromptLogprobInputs, list[tuple[int, int, int]]]:
    """The padded prompt-position inputs, and per entry of `positions` its `(row, start, stop)` slice
    of the outputs."""
    total = sum(len(offsets) for _, offsets, _ in positions)
    size = bucket(max(total, 1), TOKEN_BUCKETS)
    indices = np.zeros(size, np.int32)
    targets = np.zeros(size, np.int32)
    slices, start = [], 0
    for row, offsets, follow in positions:
        stop = start + len(offsets)
        indices[start:stop] = batch.cu_q_lens[row] + np.asarray(offsets, np.int32)
        targets[start:stop] = follow
        slices.append((row, start, stop))
        start = stop
    return PromptLogprobInputs(indices, targets), slices
