"""Collectives per step of each parallel layout, per preset: read from the lowered step (tiny presets,
on 8 virtual CPU devices) and from the shape formula (agentjax/bench/collective_formulas.py) for the
full-size presets, whose steps are not lowered here. Writes the "Collectives per step" section of
BENCHMARKS.md. The tiny rows are asserted equal to the formula before they are written.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python scripts/collectives_table.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentjax.kv.cache_layout import kv_buffer_specs  # noqa: E402
from agentjax.models.presets import FULL_SIZE_PRESETS, PRESETS  # noqa: E402
from scripts.benchmarks_md import benchmark_parser, write_section  # noqa: E402
from sharding.attention import pcp_token_split  # noqa: E402
from agentjax.bench.collective_formulas import expected_collectives  # noqa: E402
from agentjax.bench.hlo_collectives import collectives_of  # noqa: E402
from sharding.mesh import ParallelConfig, check_layout  # noqa: E402
from agentjax.runner.sharded_step import lowered_step_text  # noqa: E402

TP, DEP = dict(tensor_parallel_size=4), dict(data_parallel_size=8, enable_expert_parallel=True)
TINY = [  # (preset, layout); each layout where it applies to the preset
    ("tiny-dense", TP), ("tiny-dense", DEP), ("tiny-dense", dict(tensor_parallel_size=4, decode_context_parallel_size=2)),
    ("tiny-dense", dict(prefill_context_parallel_size=4)),
    ("tiny-sliding", TP), ("tiny-sliding", DEP), ("tiny-sliding", dict(tensor_parallel_size=4, decode_context_parallel_size=2)),
    ("tiny-sliding", dict(prefill_context_parallel_size=4)),
    ("tiny-minimax-m3", TP), ("tiny-minimax-m3", DEP), ("tiny-minimax-m3", dict(prefill_context_parallel_size=4)),
    ("tiny-kimi-k3", dict(tensor_parallel_size=2)), ("tiny-kimi-k3", dict(data_parallel_size=4, enable_expert_parallel=True)),
    ("tiny-kimi-k3", dict(tensor_parallel_size=2, decode_context_parallel_size=2)),
    ("tiny-dsv4", dict(tensor_parallel_size=2)), ("tiny-dsv4", DEP),
]
FULL = [  # (preset, layout, step): decode = 64 rows of 1 token; prefill = one 8192-token chunk
    ("kimi-k3", dict(tensor_parallel_size=8), "decode"), ("kimi-k3", dict(data_parallel_size=8, enable_expert_parallel=True), "decode"),
    ("kimi-k3", dict(tensor_parallel_size=8, decode_context_parallel_size=8), "decode"),
    ("kimi-k3", dict(tensor_parallel_size=8), "prefill"),
    ("minimax-m3", dict(tensor_parallel_size=8), "decode"), ("minimax-m3", dict(data_parallel_size=8, enable_expert_parallel=True), "decode"),
    ("minimax-m3", dict(tensor_parallel_size=8), "prefill"), ("minimax-m3", dict(prefill_context_parallel_size=2, tensor_parallel_size=4), "prefill"),
    ("deepseek-v4-pro", dict(tensor_parallel_size=8), "decode"),
    ("deepseek-v4-pro", dict(data_parallel_size=8, enable_expert_parallel=True), "decode"),
    ("deepseek-v4-pro", dict(data_parallel_size=8, enable_expert_parallel=True), "prefill"),
]
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def _cells(stats) -> list[str]:
    return [f"{stats.counts.get(k, 0)} / {stats.bytes.get(k, 0) / 2**20:.3f}" if stats.counts.get(k) else "-"
            for k in KINDS] + [f"{stats.total_bytes / 2**20:.3f}"]


def tiny_rows(numerics: str) -> list[str]:
    rows = []
    for preset, layout in TINY:
        cfg, parallel = PRESETS[preset], ParallelConfig(**layout)
        groups = len(kv_buffer_specs(cfg, 16))
        step_rows = [(list(range(3, 40)), 0, [[1, 2, 3]] * groups), (list(range(5, 14)), 0, [[4]] * groups)]
        text = lowered_step_text(cfg, parallel, numerics, [step_rows] * parallel.data_parallel_size, page_size=16)
        read = collectives_of(text)
        pcp_tokens = None
        if parallel.prefill_context_parallel_size > 1:
            pcp_tokens = pcp_token_split(np.array([0, 37, 46] + [46] * 7), 64,
                                         parallel.prefill_context_parallel_size).shape[1]
        formula = expected_collectives(cfg, parallel, numerics, tokens=64, rows=8, pages=8, page_size=16,
                                       pcp_tokens=pcp_tokens)
        if read != formula:
            raise SystemExit(f"{preset} {parallel.name} {numerics}: lowered {read} but the formula says {formula}")
        rows.append(f"| {preset} | {parallel.name} | " + " | ".join(_cells(read)) + " |")
        print(rows[-1], flush=True)
    return rows


def full_rows() -> list[str]:
    rows = []
    for preset, layout, step in FULL:
        cfg = FULL_SIZE_PRESETS.get(preset)
        if cfg is None:
            continue
        parallel = ParallelConfig(**layout)
        check_layout(cfg, parallel, available_devices=parallel.num_devices,
                     block_size=128 // parallel.decode_context_parallel_size)
        tokens, rows_ = (64, 64) if step == "decode" else (8192, 8)
        pcp_tokens = tokens // parallel.prefill_context_parallel_size
        stats = expected_collectives(cfg, parallel, "fast", tokens=tokens, rows=rows_, pcp_tokens=pcp_tokens)
        rows.append(f"| {preset} | {parallel.name} | {step} ({tokens} tokens) | " + " | ".join(_cells(stats)) + " |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = benchmark_parser(__doc__)
    args = parser.parse_args()
    header = "| preset | layout | " + " | ".join(f"{k} (n / MB)" for k in KINDS) + " | total MB |"
    rule = "|" + "---|" * (len(KINDS) + 3)
    fast, exact = tiny_rows("fast"), tiny_rows("batch_invariant")
    full = full_rows()
    body = "\n".join([
        "## Collectives per step (issue 16)",
        "",
        "Per step and per device: how many collectives of each kind one step runs and the bytes each",
        "moves (the all-reduced, reduce-scattered or all-to-all buffer, or the all-gathered result), summed",
        "over the step. Tiny presets: read from the lowered step of a prefill of two rows (37 + 9 tokens,",
        "padded to 64) on 8 virtual CPU devices (`agentjax/bench/hlo_collectives.py`), each row checked equal to",
        "the shape formula of `agentjax/bench/collective_formulas.py` (and in tests/bench/test_collectives.py).",
        "Full-size presets: the formula on their abstract shapes (steps of that size are not lowered here).",
        "Layout names: tpN tensor parallel, depN data + expert parallel, dcpN decode context parallel inside",
        "the TP group, pcpN prefill context parallel. float32 tiny presets, bfloat16 full-size.",
        "",
        "Command: `XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python scripts/collectives_table.py`",
        "",
        "### Tiny presets, fast numerics (serving)",
        "",
        header, rule, *fast,
        "",
        "### Tiny presets, batch-invariant numerics (bit-exact against one device)",
        "",
        "What exactness costs: row-parallel projections all-gather input and output instead of one all-reduce",
        "(and every sharded matmul multiplies at the single-device width, so TP saves memory, not FLOPs);",
        "attention all-gathers the queries of whole GQA groups / all MLA and indexer heads; DEP sends every",
        "(token, expert) pair's output back (k x the combine bytes); DCP all-gathers the batch's KV pages",
        "every layer instead of the queries and LSEs.",
        "",
        header, rule, *exact,
        "",
        "### Full-size presets (formula, fast numerics)",
        "",
        "| preset | layout | step | " + " | ".join(f"{k} (n / MB)" for k in KINDS) + " | total MB |",
        "|" + "---|" * (len(KINDS) + 4), *full,
        "",
        "DEP's dispatch is dropless with static shapes: each rank sends every token to every rank, zeroed",
        "where that rank holds none of its experts, so its bytes equal an all-gather of the tokens (a token",
        "reaches up to min(k, ranks) ranks: about 4.4 of 8 for DeepSeek-V4's top-6, all 8 for Kimi-K3's",
        "top-16); sending only routed tokens needs a capacity per rank and is not done yet. DCP's merged",
        "output is reduce-scattered in float32.",
    ])
    if not args.no_write:
        write_section(body)
    print(body)


if __name__ == "__main__":
    main()
