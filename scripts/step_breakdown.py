"""The cost model's breakdown of one engine step (a projection): seconds per component for a batch of
decodes at one context length, optionally beside one prefill chunk, on a full-size model's layout.

    python scripts/step_breakdown.py --model kimi-k3 --gpu GB300 --layout tp8-dcp8 --decodes 48 \
        --context 150000 [--chunk 8192 --chunk-context 0] [--spec-decode] [--no-padding]

Under DEP the decodes are spread evenly over the ranks and the chunk goes to rank 0 (the lockstep
step waits for the slowest rank). With `--spec-decode` every decode row carries the model's stated
drafts (agentjax/bench/speculation.py) and the drafter's passes are charged; `tokens_per_row_step`
is then 1 + the expected accepted drafts. Prints one JSON line: the step's seconds by component, the
bytes and FLOPs behind them, the KV capacity, and the decode-only tokens/s per user the step allows.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentjax.bench.cost_terms import PROJECTION, Layout  # noqa: E402
from agentjax.bench.costmodel import CostModel  # noqa: E402
from agentjax.bench.gpus import get_device  # noqa: E402
from agentjax.bench.model_shapes import get_shape  # noqa: E402
from agentjax.bench.speculation import default_speculation  # noqa: E402


def breakdown(model: str, gpu: str, layout: str, decodes: int, context: int, chunk: int = 0,
              chunk_context: int = 0, spec_decode: bool = False, pad_batches: bool = True) -> dict:
    shape, device, lay = get_shape(model), get_device(gpu), Layout.parse(layout)
    speculation = default_speculation(shape) if spec_decode else None
    cost_model = CostModel(shape, device, lay, pad_batches=pad_batches, max_num_seqs=256, speculation=speculation)
    width = 1 + (speculation.num_speculative_tokens if speculation else 0)
    ranks: list[list[tuple[int, int]]] = [[] for _ in range(lay.dp)]
    for index in range(decodes):
        ranks[index % lay.dp].append((width, context))
    if chunk:
        ranks[0].append((chunk, chunk_context))
    cost = cost_model.step_cost(ranks)
    per_row = 1.0 + (speculation.expected_accepted if speculation else 0.0)
    capacity = cost_model.capacity()
    return {"label": PROJECTION, "model": model, "gpu": gpu, "layout": lay.name, "decodes": decodes,
            "context": context, "chunk": chunk, "chunk_context": chunk_context, "spec_decode": spec_decode,
            "pad_batches": pad_batches, "step_ms": cost.time_s * 1e3,
            "ms": {k: round(v * 1e3, 3) for k, v in cost.seconds.items()},
            "quantities": {k: v for k, v in cost.quantities.items()},
            "tokens_per_row_step": per_row, "decode_tok_s_per_user": per_row / cost.time_s,
            "kv_tokens_per_engine": capacity.kv_tokens_per_engine,
            "weight_gb_per_gpu": capacity.weight_bytes_per_gpu / 1e9,
            "efficiency": device.efficiency.to_dict()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--gpu", required=True)
    parser.add_argument("--layout", required=True)
    parser.add_argument("--decodes", type=int, default=0, help="decode rows in the step (all DEP ranks together)")
    parser.add_argument("--context", type=int, default=100_000, help="tokens before each decode")
    parser.add_argument("--chunk", type=int, default=0, help="new tokens of one prefill chunk in the step")
    parser.add_argument("--chunk-context", type=int, default=0, help="tokens cached before the chunk")
    parser.add_argument("--spec-decode", action="store_true")
    parser.add_argument("--no-padding", action="store_true")
    args = parser.parse_args(argv)
    print(json.dumps(breakdown(args.model, args.gpu, args.layout, args.decodes, args.context, args.chunk,
                               args.chunk_context, args.spec_decode, not args.no_padding)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
