"""A roofline cost model of one engine step: FLOPs, bytes and collective bytes per GPU for a batch
of rows (prefill chunks with their cached context, decodes), under a TP / DEP / DCP / PCP layout.

Step time = fixed overheads + for each component (dense matmuls, experts, attention, LM head)
max(FLOPs / (peak x efficiency), bytes / (bandwidth x efficiency)) + collective time; a CPU adds
the two instead (`Efficiency.overlap`). Every time it gives is a projection, never a measurement;
`fit_efficiency` fits the factors to measured step times. Host only: never runs a model.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from agentjax.bench.cost_terms import (
    GPU_QUERY_TILE, PROJECTION, REFERENCE_KEY_BLOCK, REFERENCE_QUERY_TILE, REFERENCE_SHARED_KEY_BLOCK, Capacity,
    Layout, Rows, StepCost,
)
from agentjax.bench.gpus import DeviceSpec, Efficiency
from agentjax.bench.model_shapes import KeyStream, ModelShape
from agentjax.bench.pipeline import pipeline_step_cost
from agentjax.errors import InvalidRequestError
from agentjax.buckets import lockstep_buckets


def _roof(flops_s: float, bytes_s: float, overlap: bool) -> float:
    return max(flops_s, bytes_s) if overlap else flops_s + bytes_s


class CostModel:
    """Step costs of `shape` on `device` under `layout`. `kernel`: "paged" (a GPU kernel: each
    row reads its KV once per query tile of its own tokens) or "reference" (the jnp reference on a
    CPU: 64-token tiles of the padded flat batch; a tile holding several rows reads, for every
    slot, the furthest keys of the tile)."""

    def __init__(self, shape: ModelShape, device: DeviceSpec, layout: Layout = Layout(), *,
                 kernel: str = "paged", pad_batches: bool = True, memory_utilization: float = 0.9,
                 activation_reserve_bytes: float = 4e9, max_num_seqs: int = 64, speculation=None):
        """`speculation` (agentjax.bench.speculation.Speculation): the drafter's passes are added to
        every step, its weights and KV to the memory."""
        if kernel not in ("paged", "reference"):
            raise InvalidRequestError(f"kernel={kernel!r}: expected 'paged' or 'reference'")
        self.shape, self.device, self.layout = shape, device, layout
        self.kernel, self.pad_batches = kernel, pad_batches
        self.memory_utilization = memory_utilization
        self.activation_reserve_bytes = activation_reserve_bytes
        self.max_num_seqs = max_num_seqs
        self.efficiency: Efficiency = device.efficiency
        self.speculation = speculation
        self._parts: dict[str, CostModel] = {}

    def _part(self, role: str) -> "CostModel":
        """A cost model that shares this one's device and options: "stage" (one pipeline stage's TP
        group running the whole model; pipeline.py divides its time by the stages) or "draft" (the
        speculation's drafter under this layout)."""
        if role not in self._parts:
            shape = self.speculation.draft_shape if role == "draft" else self.shape
            # a pipeline's stage is a TP group; its drafter sits on the last stage
            layout = Layout(tp=self.layout.tp) if role == "stage" or self.layout.pp > 1 else self.layout
            self._parts[role] = CostModel(shape, self.device, layout, kernel=self.kernel, pad_batches=self.pad_batches,
                                          memory_utilization=self.memory_utilization,
                                          activation_reserve_bytes=self.activation_reserve_bytes,
                                          max_num_seqs=self.max_num_seqs)
        return self._parts[role]

    # ---------------------------------------------------------------- memory
    def capacity(self) -> Capacity:
        """Per GPU; with pipeline stages each GPU holds 1/pp of the layers' weights and KV, and with
        speculation the drafter's weights (its LM head is the model's) and KV come on top."""
        shape, lay = self.shape, self.layout
        weights = shape.weight_bytes()
        expert_split = lay.ep if lay.ep > 1 else lay.tp
        per_gpu = ((weights["dense"] + weights["lm_head"] + weights["embedding"]) / lay.tp
                   + weights["experts"] / expert_split) / lay.pp
        mixers = list(shape.mixers)
        if self.speculation is not None:
            draft = self.speculation.draft_shape.weight_bytes()
            per_gpu += (draft["dense"] / lay.tp + draft["experts"] / expert_split) / lay.pp
            mixers += list(self.speculation.draft_shape.mixers)
        kv_per_token = fixed = 0.0
        if shape.kv_terms:  # the engine's accounting of the model's KV (its layout's pages and padding)
            mixers = mixers[len(shape.mixers):]
            for term in shape.kv_terms:
                split = min(lay.tp, term.tp_shards)
                kv_per_token += term.bytes_per_token / (split * lay.dcp) / lay.pp
                fixed += term.bytes_per_sequence / split / lay.pp
        for mixer, count in mixers:
            for stream in mixer.streams:
                split = min(lay.tp, stream.tp_shards) * lay.dcp
                kv_per_token += count * stream.stored_bytes_per_token / split / lay.pp
                fixed += count * stream.bounded_bytes / min(lay.tp, stream.tp_shards) / lay.pp
            fixed += count * mixer.state_bytes / min(lay.tp, mixer.state_tp_shards) / lay.pp
        free = self.device.hbm_bytes * self.memory_utilization - per_gpu - self.activation_reserve_bytes
        kv_free = free - self.max_num_seqs * fixed
        tokens = int(kv_free // kv_per_token) if kv_free > 0 and kv_per_token > 0 else 0
        return Capacity(per_gpu, kv_per_token, fixed, free, tokens)

    # ---------------------------------------------------------------- attention
    def _stream_cost(self, stream: KeyStream, rows: np.ndarray) -> tuple[float, float]:
        """(FLOPs, bytes) of one layer's stream over rows [[n, context], ...] (whole instance)."""
        n, ctx = rows[:, 0], rows[:, 1]
        decode = n == 1
        flops = bytes_ = 0.0
        if decode.any():  # one query each, at position ctx: it sees ctx + 1 tokens
            seen = stream.entries(ctx[decode] + 1)
            flops += float(seen.sum()) * stream.flops_per_entry
            bytes_ += float(seen.sum()) * stream.bytes_per_entry
        for count, start in rows[~decode]:
            seen = stream.entries(np.arange(start + 1, start + count + 1))
            absorbed = float(seen.sum()) * stream.flops_per_entry
            if stream.expand_flops_per_entry:
                row_entries = float(stream.entries(np.array([start + count]))[0])
                expanded = row_entries * stream.expand_flops_per_entry + float(seen.sum()) * stream.expanded_flops_per_entry
                absorbed = min(absorbed, expanded)
            flops += absorbed
            bytes_ += self._tile_reads(stream, int(count), int(start)) * stream.bytes_per_entry
        bytes_ += float(n.sum()) * stream.bytes_per_entry / stream.ratio  # this step's new entries
        return flops, bytes_

    @staticmethod
    def _tile_reads(stream: KeyStream, count: int, start: int) -> float:
        """Entries one row of `count` queries reads, a tile of GPU_QUERY_TILE queries at a time."""
        total = 0.0
        for first in range(start, start + count, GPU_QUERY_TILE):
            last = min(first + GPU_QUERY_TILE, start + count)  # tokens seen by the tile's last query
            tokens = last if stream.window is None else min(last, stream.window + last - first - 1)
            entries = tokens // stream.ratio
            if stream.topk is not None:
                entries = min(entries, (last - first) * stream.topk)
            total += entries
        return total

    def _reference_attention(self, stream: KeyStream, rows: np.ndarray, padded_tokens: int) -> tuple[float, float, float]:
        """(FLOPs, bytes, key-block loop iterations) of the jnp reference kernel's tiles over the
        padded flat batch."""
        positions, owners = [], []
        for index, (count, start) in enumerate(rows):
            positions.append(np.arange(start, start + count))
            owners.append(np.full(count, index))
        pad = padded_tokens - int(rows[:, 0].sum())
        positions.append(np.zeros(pad, dtype=np.int64))
        owners.append(np.full(pad, -1))
        position, owner = np.concatenate(positions), np.concatenate(owners)
        flops = bytes_ = loops = 0.0
        for first in range(0, padded_tokens, REFERENCE_QUERY_TILE):
            tile_pos, tile_own = position[first:first + REFERENCE_QUERY_TILE], owner[first:first + REFERENCE_QUERY_TILE]
            shared = bool((tile_own == tile_own[0]).all())
            key_block = REFERENCE_SHARED_KEY_BLOCK if shared else REFERENCE_KEY_BLOCK
            blocks = math.ceil((int(tile_pos.max()) + 1) / key_block)
            entries = float(stream.entries(np.array([blocks * key_block]))[0])
            gathers = 1 if shared else len(tile_pos)
            flops += len(tile_pos) * entries * stream.flops_per_entry
            bytes_ += gathers * entries * stream.bytes_per_entry
            loops += blocks
        return flops, bytes_, loops

    # ---------------------------------------------------------------- one rank
    def padded_shape(self, ranks: Sequence[Rows]) -> tuple[int, int] | None:
        """(tokens, rows) every rank of a lockstep step runs, padded as the runners pad them (the
        engine's buckets, `agentjax.buckets.lockstep_buckets`); None with exact shapes or no rows."""
        if not self.pad_batches or not any(ranks):
            return None
        return lockstep_buckets([sum(n for n, _ in rows) for rows in ranks], [len(rows) for rows in ranks])

    def _rank_quantities(self, rows: Rows, padded: tuple[int, int] | None = None) -> dict[str, float]:
        """One engine's batch: FLOPs of the whole TP group (split by the caller), KV and state
        bytes per GPU (KV split across TP up to the stream's shards, and across DCP). `padded`: the
        step's (tokens, rows) shape (default: this batch alone, padded as `padded_shape` pads it)."""
        shape = self.shape
        array = np.asarray(rows, dtype=np.int64).reshape(-1, 2)
        real_tokens = int(array[:, 0].sum()) if len(array) else 0
        padded = padded if padded is not None else self.padded_shape([rows])
        tokens, seqs = padded if self.pad_batches and padded is not None else (real_tokens, len(array))
        q = {"tokens": float(tokens), "real_tokens": float(real_tokens), "rows": float(len(array)),
             "dense_flops": 2.0 * shape.dense_params * tokens, "lm_flops": 2.0 * shape.lm_head_params * seqs,
             "attn_flops": 0.0, "kv_bytes": 0.0, "state_bytes": 0.0, "loops": 0.0}
        if not len(array):
            return q
        for mixer, count in shape.mixers:
            for stream in mixer.streams:
                if self.kernel == "reference":
                    flops, bytes_, loops = self._reference_attention(stream, array, tokens)
                    q["loops"] += count * loops
                else:
                    flops, bytes_ = self._stream_cost(stream, array)
                q["attn_flops"] += count * flops
                q["kv_bytes"] += count * bytes_ / (min(self.layout.tp, stream.tp_shards) * self.layout.dcp)
            q["attn_flops"] += count * mixer.state_flops_per_token * real_tokens
            q["state_bytes"] += count * mixer.state_traffic_bytes * len(array) / min(self.layout.tp, mixer.state_tp_shards)
        return q

    def step_cost(self, ranks: Sequence[Rows], new_shape: bool = False,
                  sampled: Sequence[Sequence[int]] | None = None) -> StepCost:
        """The step of one instance: `ranks` holds one row list per attention DP rank (a single
        list for TP, DCP, PCP or PP layouts). All DP ranks run in lockstep: the slowest sets the time.
        With speculation, `sampled` holds per rank the positions of the rows whose sample is kept
        (decodes, a prompt's last chunk), where the drafter chains its one-token passes (None: the
        rows of at most 1 + num_speculative_tokens tokens)."""
        if len(ranks) != self.layout.dp:
            raise InvalidRequestError(f"the layout has dp={self.layout.dp} ranks, got {len(ranks)} row lists")
        if self.layout.pp > 1:
            cost = pipeline_step_cost(self._part("stage"), self.layout, ranks[0], new_shape)
        else:
            cost = self._lockstep_cost(ranks, new_shape)
        if self.speculation is not None and cost.time_s > 0:  # the drafter runs after the forward, same step
            from agentjax.bench.speculation import drafter_seconds

            cost.seconds["drafter"] = drafter_seconds(self, ranks, sampled)
            cost.time_s += cost.seconds["drafter"]
        return cost

    def _lockstep_cost(self, ranks: Sequence[Rows], new_shape: bool) -> StepCost:
        lay, shape, dev, eff = self.layout, self.shape, self.device, self.efficiency
        padded = self.padded_shape(ranks)  # an idle rank runs a dummy row padded to the others' shape
        per_rank = [self._rank_quantities(rows, padded) for rows in ranks]
        if all(q["real_tokens"] == 0 for q in per_rank):
            return StepCost(0.0, label=PROJECTION)
        split_tokens = [q["tokens"] / lay.pcp for q in per_rank]
        # bucket padding reaches no expert (agentjax/models/moe.py): the experts see the real tokens only
        all_tokens = sum(q["real_tokens"] for q in per_rank)
        weights = shape.weight_bytes()
        bw, link = dev.hbm_bw, dev.link_bw if lay.gpus <= dev.nvlink_domain else dev.scaleout_bw
        experts_s = 0.0
        if shape.moe is not None:
            moe = shape.moe
            touched = moe.experts * (1.0 - (1.0 - moe.top_k / moe.experts) ** all_tokens)
            expert_split = lay.ep if lay.ep > 1 else lay.tp
            expert_bytes = moe.layers * touched * moe.params_per_expert * moe.bytes_per_param / expert_split
            expert_flops = 2.0 * moe.layers * moe.top_k * moe.params_per_expert * all_tokens / (expert_split * lay.pcp)
            experts_s = _roof(expert_flops / (dev.flops_for(moe.bytes_per_param) * eff.compute),
                              expert_bytes / (bw * eff.memory), eff.overlap)
        times, breakdowns = [], []
        for q, tokens in zip(per_rank, split_tokens):
            dense_peak = dev.flops_for(shape.dense_bytes_per_param) * eff.compute
            dense_s = _roof(q["dense_flops"] / (lay.tp * lay.pcp) / dense_peak,
                            weights["dense"] / lay.tp / (bw * eff.memory), eff.overlap)
            lm_s = _roof(q["lm_flops"] / lay.tp / (dev.flops_for(shape.lm_head_bytes_per_param) * eff.compute),
                         weights["lm_head"] / lay.tp / (bw * eff.memory), eff.overlap)
            attn_s = _roof(q["attn_flops"] / (lay.tp * lay.pcp) / (dev.bf16_flops * eff.attention_compute),
                           (q["kv_bytes"] + q["state_bytes"]) / (bw * eff.kv_memory), eff.overlap)
            attn_s += q["loops"] * eff.loop_overhead_s
            comm_bytes, calls = self._collectives(q, tokens)
            comm_s = comm_bytes / (link * eff.network) + calls * eff.collective_latency_s
            fixed_s = eff.step_overhead_s + shape.num_layers * eff.layer_overhead_s + (eff.compile_s if new_shape else 0.0)
            seconds = {"dense": dense_s, "experts": experts_s, "attention": attn_s, "lm_head": lm_s,
                       "collectives": comm_s, "fixed": fixed_s}
            times.append(sum(seconds.values()))
            breakdowns.append((seconds, {**q, "comm_bytes": comm_bytes}))
        slowest = int(np.argmax(times))
        return StepCost(times[slowest], *breakdowns[slowest], rank_times_s=tuple(times))

    def _collectives(self, q: dict[str, float], tokens: float) -> tuple[float, float]:
        """(bytes one GPU sends, collective calls) for one rank's step."""
        lay, shape = self.layout, self.shape
        act = shape.activation_bytes * shape.hidden
        comm = calls = 0.0
        if lay.tp > 1:  # two all-reduces per layer (attention and FFN outputs), ring
            comm += shape.num_layers * 2 * 2 * (lay.tp - 1) / lay.tp * tokens * act
            calls += 2 * shape.num_layers
        if lay.ep > 1 and shape.moe is not None:  # dispatch and combine all-to-alls
            copies = min(shape.moe.top_k, lay.ep)
            comm += shape.moe.layers * 2 * copies * (lay.ep - 1) / lay.ep * q["tokens"] / lay.tp * act
            calls += 2 * shape.moe.layers
        if lay.dcp > 1:  # query all-gather and partial-output reduction per latent layer
            for mixer, count in shape.mixers:
                latent = [s for s in mixer.streams if s.tp_shards == 1 and s.ratio == 1 and s.window is None]
                for stream in latent:
                    comm += count * (lay.dcp - 1) / lay.dcp * tokens * stream.flops_per_entry / 2 * shape.activation_bytes
                    calls += 2 * count
        if lay.pcp > 1:  # all-gather of the chunk's new KV
            comm += (lay.pcp - 1) / lay.pcp * q["real_tokens"] * shape.kv_bytes_per_token
            calls += shape.num_layers
        return comm, calls

    def step_time(self, ranks: Sequence[Rows], new_shape: bool = False,
                  sampled: Sequence[Sequence[int]] | None = None) -> float:
        return self.step_cost(ranks, new_shape, sampled).time_s


# -------------------------------------------------------------------- fitting

FIT_COLUMNS = ("step_overhead_s", "compute", "attention_compute", "kv_memory", "loop_overhead_s")


def fit_efficiency(model: CostModel, samples: Sequence[tuple[Rows, float]], compile_s: float = 0.0,
                   source: str = "fitted") -> Efficiency:
    """Efficiency factors (additive, as on a CPU) whose step times best match `samples` of
    (rows of one engine, measured seconds), by non-negative least squares on relative errors of
    seconds = overhead + matmul FLOPs / (peak x compute) + attention FLOPs / (peak x attention)
    + (KV + state bytes) / (bandwidth x kv_memory) + reference-kernel loop iterations x
    loop_overhead_s. Weight reads are constant per step: they fold into the overhead."""
    from scipy.optimize import nnls

    if len(samples) < len(FIT_COLUMNS):
        raise InvalidRequestError(f"need at least {len(FIT_COLUMNS)} timed steps to fit, got {len(samples)}")
    dev, shape = model.device, model.shape
    matrix, seconds = [], []
    for rows, measured in samples:
        q = model._rank_quantities(rows)
        matrix.append([1.0,
                       q["dense_flops"] / dev.flops_for(shape.dense_bytes_per_param)
                       + q["lm_flops"] / dev.flops_for(shape.lm_head_bytes_per_param),
                       q["attn_flops"] / dev.bf16_flops,
                       (q["kv_bytes"] + q["state_bytes"]) / dev.hbm_bw,
                       q["loops"]])
        seconds.append(measured)
    weights = 1.0 / np.asarray(seconds)  # every sample counts by its relative error
    coefficients, _ = nnls(np.asarray(matrix) * weights[:, None], np.asarray(seconds) * weights)
    inverse = [max(c, 1e-9) for c in coefficients[1:4]]
    return dataclasses.replace(
        model.efficiency, step_overhead_s=float(coefficients[0]), compute=1.0 / inverse[0],
        attention_compute=1.0 / inverse[1], memory=1e9, kv_memory=1.0 / inverse[2],
        loop_overhead_s=float(coefficients[4]), layer_overhead_s=0.0, collective_latency_s=0.0,
        compile_s=compile_s, overlap=False, source=source)


def scale_efficiency(efficiency: Efficiency, slowdown: float) -> Efficiency:
    """The same factors on a machine `slowdown` times slower (a shared CPU under more load)."""
    return dataclasses.replace(
        efficiency, compute=efficiency.compute / slowdown, attention_compute=efficiency.attention_compute / slowdown,
        memory=efficiency.memory / slowdown, kv_memory=efficiency.kv_memory / slowdown,
        step_overhead_s=efficiency.step_overhead_s * slowdown, loop_overhead_s=efficiency.loop_overhead_s * slowdown,
        layer_overhead_s=efficiency.layer_overhead_s * slowdown)
