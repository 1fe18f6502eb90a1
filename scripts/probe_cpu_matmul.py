"""How fast XLA's CPU dots run at decode shapes: SmolLM2-135M's MLP matmuls, written to BENCHMARKS.md.

The ceiling behind the CPU decode figures. Three probes, each one jitted function timed alone
(minimum and median of `--repeats` calls after a warm-up), at `--rows` rows (16: a decode batch)
and at 1,024 (a prefill chunk):
  - from cache: one [576, 1536] float32 matrix multiplied 30 times (the same weights every time);
  - the MLP's 30 layers of gate, up and down, float32 weights (a distinct 10.6 MB per layer, read from
    memory), SwiGLU between, in a scan over the stacked layers as the model's step runs them;
  - the same over the GGUF file's blocks (`agentjax.models.block_weights.project`: each layer's matrices
    are sliced and dequantised in a fusion before their dots, as the model's step does).
GFLOP/s counts 2 x rows x in x out per matmul.

    .venv/bin/python scripts/probe_cpu_matmul.py [--rows 16] [--repeats 20] [--no-write]
"""
from __future__ import annotations

import datetime
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from agentjax.models.block_weights import BlockWeight, project  # noqa: E402
from checkpoints.embedded import smollm2_path  # noqa: E402
from checkpoints.gguf import load_gguf  # noqa: E402
from scripts.benchmarks_md import benchmark_parser, write_section  # noqa: E402
from scripts.call_timing import call_seconds  # noqa: E402

SECTION = "## CPU matmul rates at decode shapes (SmolLM2-135M's MLP, probe)"
MLP = ("gate_proj", "up_proj", "down_proj")


def mlp_weights(keep_blocks: bool) -> tuple:
    """(gate, up, down), each stacked over the layers [layers, in, out]: float32 arrays, or BlockWeights."""
    cfg, arrays, _ = load_gguf(smollm2_path(), keep_blocks=keep_blocks)
    per_layer = [[arrays[f"layers.{i}.mlp.{name}.kernel"] for i in range(cfg.num_layers)] for name in MLP]
    if keep_blocks:
        return tuple(BlockWeight.stack(weights).to_device() for weights in per_layer)
    return tuple(jnp.asarray(np.stack(weights)) for weights in per_layer)


def timed(fn, args, repeats: int) -> tuple[float, float]:
    """(minimum, median) seconds of `fn(*args)` after one warm-up call (which compiles)."""
    seconds = call_seconds(fn, *args, repeats=repeats)
    return min(seconds), statistics.median(seconds)


def probes(rows: int, dense: tuple, blocks: tuple, repeats: int) -> list[tuple]:
    """(name, GFLOP per call, min s, median s) of each probe at `rows` rows."""
    layers, hidden, inner = dense[0].shape
    x = jnp.asarray(np.random.default_rng(0).standard_normal((rows, hidden)), jnp.float32)
    one = dense[0][0]

    @jax.jit
    def from_cache(x, w):
        out = x @ w
        for _ in range(layers - 1):  # the same matrix again: its 3.5 MB stay in cache
            out = out + (x + out[:, :1]) @ w
        return out

    @jax.jit
    def mlp(weights, x):
        def layer(x, weights):
            gate, up, down = weights
            h = jax.nn.silu(project(x, gate, "fast")) * project(x, up, "fast")
            return x + project(h, down, "fast"), None

        return jax.lax.scan(layer, x, weights)[0]

    matmul_gflop = 2 * rows * hidden * inner / 1e9
    return [("one [576, 1536] matrix from cache, x30", matmul_gflop * layers, *timed(from_cache, (x, one), repeats)),
            ("MLP, 30 layers, float32 weights", 3 * matmul_gflop * layers, *timed(mlp, (dense, x), repeats)),
            ("MLP, 30 layers, GGUF blocks dequantised per matmul", 3 * matmul_gflop * layers,
             *timed(mlp, (blocks, x), repeats))]


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--rows", type=int, default=16, help="decode rows (default 16)")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per probe (default 20)")
    args = parser.parse_args()

    print("loading SmolLM2-135M's MLP weights (float32 and GGUF blocks)", file=sys.stderr)
    dense, blocks = mlp_weights(False), mlp_weights(True)
    results = []
    for rows in dict.fromkeys((args.rows, 1024)):
        print(f"probing at {rows} rows", file=sys.stderr)
        results += [(rows, *probe) for probe in probes(rows, dense, blocks, args.repeats)]

    command = "python scripts/probe_cpu_matmul.py" + (f" --rows {args.rows}" if args.rows != 16 else "") + (
        f" --repeats {args.repeats}" if args.repeats != 20 else "")
    lines = [SECTION, "",
             f"`{command}` on {platform.processor() or platform.machine()} ({jax.device_count()} XLA CPU device, "
             f"jax {jax.__version__}), {datetime.date.today().isoformat()}. Each probe is one jitted function "
             f"timed alone ({args.repeats} calls after a warm-up); GFLOP/s from the minimum time (median in "
             "brackets). See the script's docstring for what each probe runs.", "",
             "| rows | probe | GFLOP per call | min ms | GFLOP/s (at the median) |", "|---|---|---|---|---|"]
    for rows, name, gflop, best, median in results:
        lines.append(f"| {rows} | {name} | {gflop:.2f} | {1e3 * best:.1f} | {gflop / best:.0f} ({gflop / median:.0f}) |")
    body = "\n".join(lines) + "\n"
    print(body)
    if not args.no_write:
        write_section(body)


if __name__ == "__main__":
    main()
