"""Where the time of one CPU step goes: a per-op profile of SmolLM2-135M's jitted step, written to BENCHMARKS.md.

Runs `make_step` (numerics "fast", float32) on the embedded model for a decode batch (`--rows` rows of
one token over `--context` cached tokens each) and for a `--prefill`-token prefill, traces a few steps
with the JAX profiler (XLA:CPU's per-thunk trace events), and sums each op's time into categories read
from the compiled HLO: the layers' projections (attention q/k/v/o, MLP gate/up/down), the LM head, the
attention loops, the layer scan's weight slices, and the rest. XLA runs independent thunks at the same
time (gate and up, for example), so the summed op time exceeds the step's wall time; each category is
reported as a share of the summed time and scaled to the measured wall time.

    .venv/bin/python scripts/profile_cpu_step.py [--rows 16] [--context 64] [--prefill 1024] [--no-write]
"""
from __future__ import annotations

import collections
import datetime
import gzip
import itertools
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

# The per-thunk trace events of XLA:CPU exist only with this flag, read when the backend starts.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true").strip()

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from agentjax.models import load_model  # noqa: E402
from agentjax.models.block_weights import HEAD_CHUNK_ROWS  # noqa: E402
from agentjax.ragged_batch import RaggedBatch  # noqa: E402
from agentjax.runner import make_step  # noqa: E402
from scripts.benchmarks_md import benchmark_parser, write_section  # noqa: E402
from scripts.call_timing import call_seconds  # noqa: E402

SECTION = "## Where a CPU step's time goes (SmolLM2-135M, profile)"
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\][^\n]*?op_name=\"([^\"]*)\"", re.MULTILINE)
WEIGHTS = "weight slices and dequantisation"
CATEGORIES = ("MLP gate/up/down matmuls", "attention q/k/v/o projections", "LM head", "attention (paged, incl. loops)",
              WEIGHTS, "other")


def weight_shapes(cfg) -> set[tuple[int, int]]:
    """The 2-D shapes of the model's matrices (kernels [in, out]; a tied LM head's chunks [rows, hidden])."""
    hidden, q_out, kv_out = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {(hidden, q_out), (hidden, kv_out), (q_out, hidden), (hidden, cfg.intermediate_size),
            (cfg.intermediate_size, hidden), (HEAD_CHUNK_ROWS, hidden), (cfg.vocab_size, hidden)}


def classify(shape: tuple[int, ...], op_name: str, operand_shapes: list[tuple[int, ...]], cfg) -> str | None:
    """The category of one compiled instruction, from its output shape, its jax op name and its operands'
    shapes; None for instructions that are none of the model's ops (loops, tuples, parameters)."""
    attention_loop = "/while/body/eval_jaxpr/while/body" in op_name or "/cond/" in op_name
    if attention_loop:
        return "attention (paged, incl. loops)"
    if op_name.endswith("dot_general") and len(shape) == 2:
        # A block-quantised tied LM head runs in chunks of HEAD_CHUNK_ROWS output columns.
        if shape[-1] == cfg.vocab_size or (shape[-1] == HEAD_CHUNK_ROWS != cfg.intermediate_size
                                           and any(s[-1:] == (cfg.hidden_size,) for s in operand_shapes)):
            return "LM head"
        if shape[-1] == cfg.intermediate_size or any(s[-1:] == (cfg.intermediate_size,) for s in operand_shapes):
            return "MLP gate/up/down matmuls"
        return "attention q/k/v/o projections"
    # A layer's float32 weights sliced out of the stacked arrays, or a BlockWeight dequantised.
    if len(shape) == 2 and ("dynamic_slice" in op_name or shape in weight_shapes(cfg)):
        return WEIGHTS
    return "other" if op_name else None


def instruction_categories(hlo: str, cfg) -> dict[str, str]:
    """Category of every named instruction of the compiled module (a fusion carries the op metadata of
    the instruction it wraps)."""
    shapes = {m.group(1): tuple(int(d) for d in m.group(2).split(",") if d)
              for m in re.finditer(r"%([\w.\-]+) = \w+\[([\d,]*)\]", hlo)}
    categories = {}
    for match in INSTRUCTION.finditer(hlo):
        name, shape_text, op_name = match.group(1), match.group(3), match.group(4)
        line = hlo[match.start():hlo.find("\n", match.start())]
        operands = re.findall(r"%([\w.\-]+)", line.split("=", 1)[1].split("metadata")[0])
        category = classify(shapes.get(name, ()), op_name, [shapes.get(o, ()) for o in operands], cfg)
        if category:
            categories[name] = category
    return categories


def profile(step, params, kv, batch, cfg, steps: int) -> tuple[float, dict[str, float]]:
    """(median wall seconds of a step, summed op seconds per category per step)."""
    hlo = step.lower(params, kv[0], batch).compile().as_text()
    categories = instruction_categories(hlo, cfg)

    def run():
        logits, kv[0] = step(params, kv[0], batch)
        return logits

    walls = call_seconds(run, repeats=steps, warmups=2)
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder)
        for _ in range(steps):
            jax.block_until_ready(run())
        jax.profiler.stop_trace()
        trace = next(Path(folder).rglob("*.trace.json.gz"))
        events = json.load(gzip.open(trace))["traceEvents"]
    totals = collections.Counter()
    for event in events:
        # Loop and conditional thunks hold other ops' events (counted themselves); skip them.
        if event.get("ph") == "X" and event.get("dur") and event["name"] in categories \
                and not event["name"].startswith(("while", "cond")):
            totals[categories[event["name"]]] += event["dur"] / 1e6
    return statistics.median(walls), {c: totals[c] / steps for c in CATEGORIES}


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--rows", type=int, default=16, help="decode rows (default 16)")
    parser.add_argument("--context", type=int, default=64, help="cached tokens per decode row (default 64)")
    parser.add_argument("--prefill", type=int, default=1024, help="prefill tokens (default 1024)")
    parser.add_argument("--steps", type=int, default=10, help="timed and traced steps per case (default 10)")
    args = parser.parse_args()

    load_start = os.getloadavg()[0]
    cfg, params, _ = load_model(None)
    _, float32_params, _ = load_model(None, gguf_blocks=False)
    step = make_step(cfg)
    page = 16
    pages_per_row = -(-(args.context + 1) // page)
    kv = [cfg.new_kv_pages(num_pages=args.rows * pages_per_row + -(-args.prefill // page) + 2, page_size=page)]
    rows = []
    for row in range(args.rows):
        table = list(range(1 + row * pages_per_row, 1 + (row + 1) * pages_per_row))
        rows.append(([1 + row], args.context, [table]))
    decode = RaggedBatch.build(rows, page)
    prefill_table = list(range(1 + args.rows * pages_per_row, 1 + args.rows * pages_per_row + -(-args.prefill // page)))
    prefill = RaggedBatch.build([(list(range(1, args.prefill + 1)), 0, [prefill_table])], page)
    cases = [(f"decode, {args.rows} rows at {args.context} cached tokens", decode, args.rows),
             (f"prefill, {args.prefill} tokens", prefill, args.prefill)]
    results = []
    for (label, batch, tokens), (weights, weight_params) in itertools.product(
            cases, (("GGUF blocks", params), ("float32 weights", float32_params))):
        label = f"{label}, {weights}"
        wall, per_category = profile(step, weight_params, kv, batch, cfg, args.steps)
        results.append((label, batch.shape_key(), wall, tokens, per_category))
        print(f"{label}: step {wall * 1e3:.1f} ms ({tokens / wall:.0f} tok/s)", flush=True)
        total = sum(per_category.values())
        for category, seconds in per_category.items():
            print(f"  {category:<34} {100 * seconds / total:5.1f}%  ~{wall * seconds / total * 1e3:7.1f} ms")
    load_end = os.getloadavg()[0]
    command = "python scripts/profile_cpu_step.py" + "".join(
        f" --{k} {v}" for k, v in (("rows", args.rows), ("context", args.context), ("prefill", args.prefill),
                                   ("steps", args.steps)))
    lines = [SECTION, "",
             f"Written by `{command}` on {datetime.date.today().isoformat()}; 2 CPUs, jax {jax.__version__}, "
             f"load average {load_start:.1f} at the start and {load_end:.1f} at the end. The jitted step "
             "(`make_step`, numerics \"fast\", float32) of the embedded model, profiled with XLA:CPU's per-op trace "
             "events; each op's time goes to a category read from the compiled HLO. XLA runs independent ops at "
             "the same time (the MLP's gate and up projections, for example), so shares are of the summed op time "
             "and the milliseconds are those shares of the step's measured wall time.", "",
             "| case | step (median) | " + " | ".join(CATEGORIES) + " |",
             "|---|---|" + "---|" * len(CATEGORIES)]
    for label, shape, wall, tokens, per_category in results:
        total = sum(per_category.values())
        cells = [f"{100 * per_category[c] / total:.0f}% ({wall * per_category[c] / total * 1e3:.0f} ms)" for c in CATEGORIES]
        lines.append(f"| {label} (shape {shape[0]} tokens) | {wall * 1e3:.0f} ms ({tokens / wall:.0f} tok/s) | "
                     + " | ".join(cells) + " |")
    body = "\n".join(lines) + "\n"
    print("\n" + body)
    if not args.no_write:
        write_section(body)


if __name__ == "__main__":
    main()
