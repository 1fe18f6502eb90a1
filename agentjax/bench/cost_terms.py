"""The terms the roofline cost model speaks in: an instance's GPU `Layout`, one step's `StepCost`, a GPU's
`Capacity`, the rows of a batch, and the kernels' tile sizes it assumes. Shared by the cost model
(agentjax/bench/costmodel.py), its pipeline stages (pipeline.py), the planner and the simulator. Data only:
no costing here.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from agentjax.errors import InvalidRequestError

PROJECTION = "projection (roofline cost model, not a measurement)"
GPU_QUERY_TILE = 128  # query tokens of one row that share a KV read in a paged GPU kernel
# The jnp reference's tiling (pallas_kernels/ragged_paged_attention.py): SHARED_QUERY_BLOCK query
# tokens per tile; a tile of one sequence reads SHARED_PAGES_PER_BLOCK pages of 16 per iteration, a
# tile that mixes sequences gathers 4 pages of 16 per token and iteration.
REFERENCE_QUERY_TILE = 128
REFERENCE_SHARED_KEY_BLOCK = 128
REFERENCE_KEY_BLOCK = 64

Rows = Sequence[tuple[int, int]]  # (new tokens, tokens already computed) per row


@dataclass(frozen=True)
class Layout:
    """How one serving instance spreads over GPUs: `tp` tensor-parallel ranks, `dp` attention
    data-parallel ranks (DEP: each with its own batch and KV), `ep` expert-parallel ranks, `dcp`
    decode context parallelism inside the TP group (KV split along the sequence), `pcp` prefill
    context parallelism (a chunk's tokens split across ranks), `pp` pipeline stages (each holding
    1/pp of the layers, TP inside a stage) that a step's batch crosses in `microbatches` pieces
    (0: as many as stages; agentjax/bench/pipeline.py)."""

    tp: int = 1
    dp: int = 1
    ep: int = 1
    dcp: int = 1
    pcp: int = 1
    pp: int = 1
    microbatches: int = 0

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "ep", "dcp", "pcp", "pp"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"layout {name}={getattr(self, name)} must be >= 1")
        if self.tp % self.dcp:
            raise InvalidRequestError(f"dcp={self.dcp} must divide tp={self.tp} (DCP reuses the TP ranks)")
        if self.ep > 1 and (self.tp * self.dp) % self.ep:
            raise InvalidRequestError(f"ep={self.ep} must divide tp*dp={self.tp * self.dp}")
        if self.microbatches < 0:
            raise InvalidRequestError(f"microbatches={self.microbatches} must be >= 0 (0: one per stage)")
        if self.pp > 1 and (self.dp > 1 or self.dcp > 1 or self.pcp > 1 or self.ep > 1):
            raise InvalidRequestError(f"pp={self.pp} combines with tp only (got {self.name}); a stage is a TP group")

    @property
    def gpus(self) -> int:
        return self.tp * self.dp * self.pcp * self.pp

    @property
    def num_microbatches(self) -> int:
        return self.microbatches or self.pp

    @property
    def name(self) -> str:
        parts = [f"pp{self.pp}" if self.pp > 1 else "",
                 f"mb{self.microbatches}" if self.pp > 1 and self.microbatches not in (0, self.pp) else "",
                 f"dep{self.dp}" if self.dp > 1 and self.ep == self.dp * self.tp else
                 (f"dp{self.dp}" if self.dp > 1 else "")]
        parts += [f"tp{self.tp}" if self.tp > 1 or self.gpus == 1 else "",
                  f"dcp{self.dcp}" if self.dcp > 1 else "", f"pcp{self.pcp}" if self.pcp > 1 else "",
                  f"ep{self.ep}" if self.ep > 1 and self.ep != self.dp * self.tp else ""]
        return "-".join(p for p in parts if p)

    @classmethod
    def parse(cls, text: str) -> "Layout":
        """`tp8`, `dep8` (8 attention DP ranks, experts over all 8), `tp8-dcp8`, `pcp2-tp4`, `dp2-tp4-ep8`,
        `pp4-tp2` (4 stages of TP2, 4 microbatches), `pp4-mb8-tp2` (8 microbatches)."""
        fields = {"tp": 1, "dp": 1, "ep": 1, "dcp": 1, "pcp": 1, "pp": 1, "microbatches": 0}
        dep = False
        for part in re.split(r"[-+,]", text.strip().lower()):
            match = re.fullmatch(r"(tp|dp|dep|ep|dcp|pcp|pp|mb)(\d+)", part)
            if match is None:
                raise InvalidRequestError(f"layout part {part!r} of {text!r}: expected tpN, dpN, depN, epN, dcpN, "
                                          "pcpN, ppN or mbN")
            kind, degree = match.group(1), int(match.group(2))
            if kind == "dep":
                kind, dep = "dp", True
            fields["microbatches" if kind == "mb" else kind] = degree
        if dep and fields["ep"] == 1:
            fields["ep"] = fields["dp"] * fields["tp"]
        return cls(**fields)


@dataclass
class StepCost:
    """One step on the slowest GPU: seconds by component, and the raw quantities behind them."""

    time_s: float
    seconds: dict[str, float] = field(default_factory=dict)
    quantities: dict[str, float] = field(default_factory=dict)
    rank_times_s: tuple[float, ...] = ()
    label: str = PROJECTION


@dataclass(frozen=True)
class Capacity:
    """Memory of one GPU of the instance and what is left for KV per engine (per DP rank)."""

    weight_bytes_per_gpu: float
    kv_bytes_per_token_per_gpu: float
    fixed_bytes_per_sequence_per_gpu: float
    free_bytes_per_gpu: float
    kv_tokens_per_engine: int

    @property
    def feasible(self) -> bool:
        return self.kv_tokens_per_engine > 0
