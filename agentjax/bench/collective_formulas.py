"""The collectives one sharded step should run, from the model's shapes alone (no lowering).

`expected_collectives(cfg, parallel, numerics, tokens=T, rows=B, pages=P)` counts, per kind, how many
collectives a step over T tokens (per data rank, padded) runs and the bytes each moves on one device,
layer by layer, the way sharding/modules.py and sharding/attention.py issue them. Tests check it
against the lowered step (agentjax/bench/hlo_collectives.py) on the tiny presets; scripts use it for the
full-size presets, whose steps are too large to lower here. Bytes follow hlo_collectives: the
all-reduced / reduce-scattered / all-to-all operand, or the all-gathered result. Pure arithmetic.
"""
from __future__ import annotations

from collections import Counter

from agentjax.bench.hlo_collectives import KINDS, CollectiveStats
from sharding.mesh import ParallelConfig

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class _Tally:
    def __init__(self):
        self.counts, self.bytes = Counter(), Counter()

    def add(self, kind: str, *shape: int, size: int = 4) -> None:
        count = size
        for dim in shape:
            count *= dim
        self.counts[kind] += 1
        self.bytes[kind] += count

    def stats(self) -> CollectiveStats:
        return CollectiveStats({k: self.counts[k] for k in KINDS if self.counts[k]},
                               {k: self.bytes[k] for k in KINDS if self.counts[k]})


def expected_collectives(cfg, parallel: ParallelConfig, numerics: str, *, tokens: int, rows: int = 8,
                         pages: int = 8, page_size: int = 16, pcp_tokens: int | None = None) -> CollectiveStats:
    """Per step. `tokens` is the batch's padded token count, `rows` its padded rows, `pages` the padded
    page-table width and `page_size` the effective page (batch-invariant DCP gathers those pages),
    `pcp_tokens` a PCP rank's padded tokens."""
    tally = _Tally()
    b = _BYTES[cfg.dtype]
    invariant = numerics == "batch_invariant"
    pcp = parallel.prefill_context_parallel_size
    t = tokens if pcp == 1 else pcp_tokens  # tokens each rank runs through its layers
    for layer in range(cfg.num_layers):
        _mixer(tally, cfg, parallel, cfg.layer_types[layer], invariant, t, (rows, pages, page_size), b)
        _feed_forward(tally, cfg, parallel, cfg.mlp_layer_types[layer], invariant, t, b)
    if pcp > 1:  # the hidden states and their token order, gathered back into the batch's order
        tally.add("all_gather", pcp * t, cfg.hidden_size, size=b)
        tally.add("all_gather", pcp * t)
    return tally.stats()


def _row_parallel(tally: _Tally, ranks: int, invariant: bool, t: int, width_in: int, width_out: int, b: int):
    if ranks == 1:
        return
    if invariant:  # all-gather the input, multiply exactly, all-gather the output columns
        tally.add("all_gather", t, width_in, size=b)
        tally.add("all_gather", t, width_out, size=b)
    else:
        tally.add("all_reduce", t, width_out, size=b)


def _mixer(tally, cfg, parallel, kind, invariant, t, table, b):
    tp, kv_ranks = parallel.role_size("tensor"), parallel.role_size("kv_heads")
    dcp, pcp = parallel.decode_context_parallel_size, parallel.prefill_context_parallel_size
    if tp == 1 and dcp == 1 and pcp == 1:  # attention is data parallel (DP/DEP) or on one device
        return
    hidden, heads = cfg.hidden_size, cfg.num_heads
    local_heads = heads // tp
    if kind == "kda":
        width = cfg.kda.num_heads * cfg.kda.head_dim
        _row_parallel(tally, kv_ranks, invariant, t, width, hidden, b)
        return
    if kind in ("swa_mqa", "csa", "hca"):  # DeepSeek-V4 (TP only)
        attention = cfg.compressed_attention
        if invariant and tp > 1:  # every head's queries and sinks; every output group's input, per row block
            tally.add("all_gather", t, heads, cfg.head_dim, size=b)
            tally.add("all_gather", heads)
            for _ in range(-(-t // 8)):
                tally.add("all_gather", 8, attention.o_groups, heads * cfg.head_dim // attention.o_groups, size=b)
        _row_parallel(tally, tp, invariant, t, attention.o_groups * attention.o_lora_rank, hidden, b)
        return
    if kind == "mla":
        mla = cfg.mla
        width = mla.kv_lora_rank + mla.qk_rope_head_dim
        if invariant and tp > 1:
            tally.add("all_gather", t, heads, width, size=b)
        if pcp > 1:
            tally.add("all_gather", pcp * t, width, size=b)
            tally.add("all_gather", pcp * t)
        _context_parallel_attention(tally, parallel, invariant, t, table, local_heads, width, mla.kv_lora_rank,
                                    (width,), b)
        _row_parallel(tally, tp, invariant, t, heads * mla.v_head_dim, hidden, b)
        return
    dim = cfg.head_dim
    kv_local = max(1, cfg.num_kv_heads // kv_ranks)
    group = heads // cfg.num_kv_heads
    if invariant and local_heads < kv_local * group:  # the queries of this rank's KV heads' whole groups
        tally.add("all_gather", t, heads, dim, size=b)
    if kind == "block_sparse_attention":  # the indexer's heads, keys and slots
        sparse = cfg.block_sparse
        if invariant and kv_ranks > 1:
            tally.add("all_gather", t, max(1, sparse.index_num_heads // kv_ranks) * kv_ranks, sparse.index_head_dim,
                      size=b)
        if pcp > 1:
            tally.add("all_gather", pcp * t, sparse.index_head_dim, size=b)
            tally.add("all_gather", pcp * t)
    if pcp > 1:
        tally.add("all_gather", pcp * t, kv_local, dim, size=b)
        tally.add("all_gather", pcp * t, kv_local, dim, size=b)
        tally.add("all_gather", pcp * t)
    _context_parallel_attention(tally, parallel, invariant, t, table, local_heads, dim, dim, (2 * kv_local, dim), b)
    _row_parallel(tally, tp, invariant, t, heads * dim, hidden, b)


def _context_parallel_attention(tally, parallel, invariant, t, table, local_heads, q_width, value_width,
                                row_shape, b):
    """DCP: fast numerics all-gather the group's queries and LSEs and reduce-scatter the merged output;
    batch-invariant numerics all-gather the batch's pages (`table` = rows, pages, effective page)."""
    dcp = parallel.decode_context_parallel_size
    if dcp == 1:
        return
    if invariant:
        rows, pages, page_size = table
        tally.add("all_gather", dcp, rows, pages, page_size // dcp, *row_shape, size=b)
        return
    group = local_heads * dcp
    tally.add("all_gather", t, group, q_width, size=b)
    tally.add("all_gather", dcp, t, group)
    tally.add("reduce_scatter", t, group, value_width)


def _feed_forward(tally, cfg, parallel, kind, invariant, t, b):
    tp, hidden = parallel.role_size("tensor"), cfg.hidden_size
    if kind == "dense":
        _row_parallel(tally, tp, invariant, t, cfg.intermediate_size, hidden, b)
        return
    moe = cfg.moe
    width = moe.latent_size or hidden
    if parallel.enable_expert_parallel and parallel.role_size("expert") > 1:
        ranks, k = parallel.role_size("expert"), moe.num_experts_per_token
        tally.add("all_to_all", ranks, t, width, size=b)  # tokens out
        tally.add("all_to_all", ranks, t, k)  # their expert ids
        if invariant:
            tally.add("all_to_all", ranks, t, k, width, size=b)  # every pair's output back
        else:
            tally.add("all_to_all", ranks, t, k)  # their weights
            tally.add("all_to_all", ranks, t, width, size=b)  # weighted sums back
        return
    if tp == 1:
        return
    if invariant:
        tally.add("all_gather", t, moe.num_experts_per_token, moe.expert_intermediate_size, size=b)
        tally.add("all_gather", t, width, size=b)
    else:
        tally.add("all_reduce", t, width, size=b)
    if moe.num_shared_experts:
        _row_parallel(tally, tp, invariant, t, moe.shared_size, hidden, b)
