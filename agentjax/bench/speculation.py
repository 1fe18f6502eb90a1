"""Speculative decoding in the planning simulator: what a drafter costs per step and how many of its
drafts the target accepts, per model, each figure a stated assumption.

The simulated engine speculates as the real one does (agentjax/spec_decode/, agentjax/runner/drafters.py):
the scheduler adds the drafts proposed in the previous step to each decode row as extra query tokens
(its token budget counts them, their pages come from free pages only), the step verifies them, and the
drafter proposes the row's next drafts in the same step. The simulator's runner stands in for the
device: it accepts each draft by the `Speculation.acceptance` rates (seeded), and the cost model adds
the drafter's passes: one pass of the draft over every token of the step, then one-token chained
passes over the rows whose sample is kept (`num_speculative_tokens - 1` for "mtp", as the engine chains
the MTP module; `num_speculative_tokens` for "draft_model").

The drafter of "mtp" is one MTP module: one layer of the model's own kind (its attention and, for MoE
models, its MoE FFN) plus the projection of [hidden state; embedding] (2 x hidden x hidden), reading the
shared LM head each pass. Host only: never imports jax, never runs a model.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from agentjax.bench.model_shapes import DTYPE_BYTES, KeyStream, Mixer, ModelShape, MoEShape, gqa
from agentjax.errors import InvalidRequestError

METHODS = ("mtp", "draft_model")


@dataclass(frozen=True)
class Speculation:
    """One drafter and its acceptance assumption. `acceptance[j]` is the chance that draft j + 1 is
    accepted given that the drafts before it were (the last value repeats for later positions).
    `draft_shape` is the drafter's own cost-model shape (its weights beside the model's, its KV per
    token); `source` says where the figures come from."""

    method: str
    num_speculative_tokens: int
    acceptance: tuple[float, ...]
    draft_shape: ModelShape
    source: str

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidRequestError(f"speculation method {self.method!r}: expected one of {', '.join(METHODS)}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise InvalidRequestError(f"num_speculative_tokens={self.num_speculative_tokens} must be in [1, 16]")
        if not self.acceptance or not all(0.0 <= a <= 1.0 for a in self.acceptance):
            raise InvalidRequestError(f"acceptance rates {self.acceptance} must be given, each in [0, 1]")

    def rate(self, position: int) -> float:
        """Acceptance of draft `position` (0-based) given the drafts before it were accepted."""
        return self.acceptance[min(position, len(self.acceptance) - 1)]

    @property
    def expected_accepted(self) -> float:
        """Accepted drafts per verifying step when every draft is proposed."""
        total, chain = 0.0, 1.0
        for position in range(self.num_speculative_tokens):
            chain *= self.rate(position)
            total += chain
        return total

    @property
    def chained_passes(self) -> int:
        """One-token drafter passes per step after the pass over the step's tokens."""
        return self.num_speculative_tokens - 1 if self.method == "mtp" else self.num_speculative_tokens

    def engine_config(self) -> dict:
        """The engine's `speculative_config`. Both device methods are scheduled alike (drafts proposed in
        the step, `num_speculative_tokens` lookahead positions reserved); the simulated engine runs them
        as "mtp", and the cost model charges the drafter of `method`."""
        return {"method": "mtp", "num_speculative_tokens": self.num_speculative_tokens}

    def describe(self) -> str:
        rates = ", ".join(f"{self.rate(j):g}" for j in range(self.num_speculative_tokens))
        return (f"speculative decoding: {self.method}, {self.num_speculative_tokens} drafts per decode row, "
                f"acceptance per position {rates} (expected {self.expected_accepted:.2f} accepted per step); "
                f"{self.source}")

    def with_settings(self, num_speculative_tokens: int | None = None,
                      acceptance: Sequence[float] | None = None) -> "Speculation":
        changes = {}
        if num_speculative_tokens is not None:
            changes["num_speculative_tokens"] = num_speculative_tokens
        if acceptance:
            changes["acceptance"] = tuple(float(a) for a in acceptance)
            changes["source"] = f"acceptance given on the command line; drafter: {self.source}"
        return dataclasses.replace(self, **changes)


class AcceptanceSampler:
    """Seeded draws of how many of a row's drafts the target accepts."""

    def __init__(self, speculation: Speculation, seed: int = 0) -> None:
        self.speculation = speculation
        self.rng = np.random.default_rng(seed)

    def accepted(self, num_drafts: int) -> int:
        draws = self.rng.random(num_drafts)
        count = 0
        while count < num_drafts and draws[count] < self.speculation.rate(count):
            count += 1
        return count


def mtp_module_shape(shape: ModelShape, mixer: Mixer, name: str) -> ModelShape:
    """One MTP module of `shape`: a decoder layer with `mixer` and the model's FFN, plus the
    [hidden; embedding] projection; the LM head is the model's (read each pass, stored once)."""
    layers = shape.num_layers
    moe = None if shape.moe is None else MoEShape(1, shape.moe.experts, shape.moe.top_k, shape.moe.params_per_expert,
                                                 shape.moe.bytes_per_param)
    dense = shape.dense_params / layers + 2.0 * shape.hidden * shape.hidden
    return ModelShape(
        name=name, hidden=shape.hidden, vocab=shape.vocab, mixers=((mixer, 1),), dense_params=dense,
        dense_bytes_per_param=shape.dense_bytes_per_param, lm_head_params=shape.lm_head_params,
        lm_head_bytes_per_param=shape.lm_head_bytes_per_param, embedding_params=0.0, moe=moe,
        page_tokens=shape.page_tokens, max_context=shape.max_context, activation_bytes=shape.activation_bytes,
        source=f"one MTP module of {shape.name}")


_DEEPSEEK_MTP = ("DeepSeek-V3 technical report (arXiv 2412.19437, its MTP evaluation): the second token's acceptance is "
                 "85-90% with one MTP module; later chained drafts assumed to fall by 0.1 each (no public figure)")


def default_speculation(shape: ModelShape) -> Speculation:
    """The stated assumption for a full-size model: MTP for DeepSeek-V4-Pro and MiniMax-M3 (both have MTP
    modules, ARCHITECTURES.md s. 0), a draft model for Kimi-K3 (its config has none; DSpark drafts)."""
    name = shape.name
    if name == "deepseek-v4-pro":  # the MTP layer is SWA-only (ARCHITECTURES.md s. 0)
        swa = Mixer("swa_mtp", (KeyStream(4.0 * 128 * 512, 584.0, window=128),))
        return Speculation("mtp", 3, (0.85, 0.75, 0.65), mtp_module_shape(shape, swa, "deepseek-v4-pro-mtp"),
                           _DEEPSEEK_MTP + "; MTP layer: SWA-only attention + the MoE FFN (25.8B, ARCHITECTURES.md)")
    if name == "minimax-m3":  # one module (vLLM's default), a full GQA layer + the MoE FFN: +7.5B
        return Speculation("mtp", 3, (0.8, 0.7, 0.6), mtp_module_shape(shape, gqa(64, 4, 128, 1.0), "minimax-m3-mtp"),
                           "no published MiniMax-M3 MTP acceptance: assumed 0.05 below DeepSeek-V3's (" + _DEEPSEEK_MTP
                           + "); MTP module: a dense GQA layer + the MoE FFN (+7.5B, ARCHITECTURES.md)")
    if name == "kimi-k3":
        return Speculation("draft_model", 3, (0.7, 0.6, 0.5), _assumed_kimi_draft(shape),
                           "assumed: no published DSpark draft size or acceptance for Kimi-K3; a 2-layer MLA draft "
                           "(hidden 7168, dense FFN 18432, 1.3B params in BF16, sharing the LM head), acceptance 0.7, 0.6, 0.5")
    mixer = shape.mixers[0][0]
    return Speculation("mtp", 1, (0.7,), mtp_module_shape(shape, mixer, f"{name}-mtp"),
                       f"assumed: one MTP module of {name}'s first layer kind, acceptance 0.7")


def _assumed_kimi_draft(shape: ModelShape) -> ModelShape:
    mla = next(mixer for mixer, _ in shape.mixers if mixer.name == "mla")
    dense = 2 * (3 * 7168 * 18432 + 250e6)  # two layers: a dense FFN and about 0.25B of MLA projections each
    return ModelShape(
        name="kimi-k3-draft", hidden=7168, vocab=shape.vocab, mixers=((mla, 2),), dense_params=float(dense),
        dense_bytes_per_param=DTYPE_BYTES["bfloat16"], lm_head_params=shape.lm_head_params,
        lm_head_bytes_per_param=shape.lm_head_bytes_per_param, embedding_params=0.0, moe=None,
        page_tokens=shape.page_tokens, max_context=shape.max_context, source="an assumed DSpark-like draft")


def draft_passes(speculation: Speculation, rows: Sequence[tuple[int, int]],
                 sampled: Sequence[int]) -> list[list[tuple[int, int]]]:
    """The drafter's passes in one engine's step: its rows over the step's tokens, then one token per
    kept sample (`sampled`: the positions the kept samples are at) for each chained draft."""
    passes = [list(rows)] if rows else []
    for j in range(speculation.chained_passes):
        passes.append([(1, int(position) + j) for position in sampled])
    return [rows for rows in passes if rows]


def drafter_seconds(model, ranks: Sequence[Sequence[tuple[int, int]]], sampled) -> float:
    """Seconds the drafter of `model.speculation` adds to one step of `model` (a CostModel): its passes,
    each charged as a step of the draft's shape under the model's layout less the per-step overhead
    (it runs inside the target's step). `sampled`: per rank, the kept samples' positions (None: the
    rows of at most 1 + num_speculative_tokens tokens)."""
    spec = model.speculation
    if sampled is None:
        sampled = [[start + count for count, start in rows if count <= 1 + spec.num_speculative_tokens]
                   for rows in ranks]
    per_rank = [draft_passes(spec, rows, positions) for rows, positions in zip(ranks, sampled)]
    draft, seconds = model._part("draft"), 0.0
    for index in range(max((len(passes) for passes in per_rank), default=0)):
        step = [passes[index] if index < len(passes) else [] for passes in per_rank]
        seconds += max(0.0, draft.step_cost(step).time_s - model.efficiency.step_overhead_s)
    return seconds
