"""Pipeline parallelism in the roofline cost model: a step's batch crossing `pp` stages in microbatches.

Each stage is a TP group holding 1/pp of the layers. The engine runs one batch per step, so a step
fills and drains the pipeline: its rows are cut into `microbatches` pieces of about equal tokens (a
prefill chunk longer than one query tile splits into consecutive sub-chunks, the later ones attending
to the earlier ones' KV; decodes and short rows stay whole), each piece runs through every stage in
turn, and the step ends when the last piece leaves the last stage:

    step = sum of the pieces' stage times + (pp - 1) x the longest stage time (+ the step overhead)

A piece's stage time is its whole-model time on one TP group divided by pp (weights, KV, FLOPs and
TP collectives all split by layer), plus sending its activations to the next stage. Every piece
re-reads its stage's weights, so cutting a small, weight-bound decode batch into pieces costs close
to pp whole reads, while a long compute-bound prefill splits almost for free: the lesson that PP
suits cold long prefills and adds bubbles on warm, prefix-heavy (decode-heavy) turns.
`bubble_fraction` is the stages' idle share of the step, (pp - 1) / (m + pp - 1) for m equal pieces.
The LM head and the embedding are spread over the stages like the layers (they sit on the last and
first stage). Host only.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from agentjax.bench.cost_terms import GPU_QUERY_TILE, PROJECTION, Layout, StepCost


def split_microbatches(rows: Sequence[tuple[int, int]], pieces: int) -> list[list[tuple[int, int]]]:
    """`rows` of (new tokens, context) cut into at most about `pieces` microbatches of equal tokens;
    rows of up to GPU_QUERY_TILE tokens are never cut."""
    total = sum(int(n) for n, _ in rows)
    if total == 0:
        return []
    pieces = max(1, min(pieces, total))
    target = math.ceil(total / pieces)
    batches: list[list[tuple[int, int]]] = [[]]
    filled = 0
    for count, start in rows:
        count, start = int(count), int(start)
        while count > 0:
            room = target - filled
            if room <= 0:
                batches.append([])
                filled, room = 0, target
            take = count if count <= room or count <= GPU_QUERY_TILE else room
            batches[-1].append((take, start))
            start, count, filled = start + take, count - take, filled + take
    return [batch for batch in batches if batch]


def pipeline_step_cost(stage_model, layout: Layout, rows: Sequence[tuple[int, int]], new_shape: bool) -> StepCost:
    """One step of a `ppN` layout; `stage_model` is the CostModel of one stage's TP group running the
    whole model (its times are divided by the stages here)."""
    eff, shape = stage_model.efficiency, stage_model.shape
    stages = layout.pp
    fixed = eff.step_overhead_s + (eff.compile_s if new_shape else 0.0)
    batches = split_microbatches(rows, layout.num_microbatches)
    if not batches:
        return StepCost(0.0, label=PROJECTION)
    link = stage_model.device.link_bw if layout.gpus <= stage_model.device.nvlink_domain else stage_model.device.scaleout_bw
    times, seconds = [], {}
    for batch in batches:
        cost = stage_model.step_cost([batch])
        tokens = cost.quantities.get("tokens", float(sum(n for n, _ in batch)))
        send = tokens * shape.hidden * shape.activation_bytes / (link * eff.network) + eff.collective_latency_s
        times.append((cost.time_s - eff.step_overhead_s) / stages + send)
        for name, value in cost.seconds.items():
            if name != "fixed":
                seconds[name] = seconds.get(name, 0.0) + value / stages
        seconds["stage_sends"] = seconds.get("stage_sends", 0.0) + send
    busy = sum(times)
    bubble = (stages - 1) * max(times)
    seconds.update(fixed=fixed, bubble=bubble)
    quantities = {"microbatches": float(len(batches)), "bubble_fraction": bubble / (busy + bubble),
                  "real_tokens": float(sum(n for n, _ in rows)), "rows": float(len(rows))}
    return StepCost(busy + bubble + fixed, seconds, quantities, rank_times_s=(busy + bubble + fixed,))
