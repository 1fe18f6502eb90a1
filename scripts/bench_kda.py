"""Step time of one KDA layer (agentjax/models/kda.py) on a prefill and on decode, in both numerics.

    .venv/bin/python scripts/bench_kda.py [--tokens 2048] [--hidden 2304] [--heads 32] [--head-dim 128]
                                          [--chunk-sizes 8,16,32] [--decode-rows 8] [--repeats 5]

Defaults are Kimi-Linear-48B's KDA shapes (hidden 2304, 32 heads x 128). Each figure is the median of
`--repeats` jitted calls after one warm-up (compile) call; the op alone (conv + delta rule + state
pages) is timed beside the whole mixer (projections, gates, output norm and projection).
"""
from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from agentjax.config import KDAConfig, ModelConfig
from agentjax.models.kda import KimiDeltaAttention
from agentjax.ragged_batch import RaggedBatch
from call_timing import call_seconds
from pallas_kernels import kda


def _median_seconds(fn, repeats: int) -> float:
    return statistics.median(call_seconds(fn, repeats=repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=2304)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--conv", type=int, default=4)
    parser.add_argument("--chunk-sizes", default="8,16,32")
    parser.add_argument("--decode-rows", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    heads, dim, tokens = args.heads, args.head_dim, args.tokens
    cfg = ModelConfig(architecture="kimi_linear", vocab_size=64, hidden_size=args.hidden, intermediate_size=64,
                      num_layers=1, num_heads=heads, num_kv_heads=heads, head_dim=dim, max_position_embeddings=1 << 20,
                      layer_types=("kda",), kda=KDAConfig(num_heads=heads, head_dim=dim, conv_kernel_size=args.conv))
    mixer = KimiDeltaAttention(cfg, 0, {"state": 0}, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(mixer)
    rng = np.random.default_rng(0)
    prefill = RaggedBatch.build([([0] * tokens, 0, [1])], 16, state_groups=(0,))
    decode = RaggedBatch.build([([0], 100, [1 + r]) for r in range(args.decode_rows)], 16, state_groups=(0,))
    pages = cfg.new_kv_pages(args.decode_rows + 2, 16)
    print(f"KDA layer: hidden {args.hidden}, {heads} heads x {dim}, conv {args.conv}; "
          f"{jax.devices()[0].platform}, {jax.device_count()} device(s)")

    for numerics, chunk_sizes in (("fast", [int(c) for c in args.chunk_sizes.split(",")]), ("batch_invariant", [0])):
        for chunk in chunk_sizes:
            op = jax.jit(lambda mixed, g, beta, w, kv, batch: kda.kimi_delta_attention(
                mixed, g, beta, w, kv, batch.cu_q_lens, batch.kv_lens, batch.page_indices[0][:, 0], slot=0,
                token_seq_ids=batch.seq_ids, num_heads=heads, head_dim=dim,
                batch_invariant=numerics == "batch_invariant", chunk_size=chunk or kda.CHUNK_SIZE))
            full = jax.jit(lambda params, x, kv, batch: nnx.merge(graphdef, params)(
                x, kv, batch, numerics, {"state": jnp.int32(0)}))
            for name, batch in (("prefill", prefill), ("decode", decode)):
                if name == "decode" and chunk not in (0, chunk_sizes[0]):
                    continue
                n = batch.num_tokens
                mixed = jnp.asarray(rng.normal(size=(n, 3 * heads * dim)), jnp.float32)
                g = jnp.asarray(-np.exp(rng.uniform(-7, 1.5, size=(n, heads, dim))), jnp.float32)
                beta = jnp.asarray(rng.uniform(size=(n, heads)), jnp.float32)
                w = jnp.asarray(rng.normal(size=(3 * heads * dim, args.conv)) * 0.5, jnp.float32)
                x = jnp.asarray(rng.normal(size=(n, args.hidden)), jnp.float32)
                op_s = _median_seconds(lambda: op(mixed, g, beta, w, pages[0], batch), args.repeats)
                layer_s = _median_seconds(lambda: full(params, x, pages, batch), args.repeats)
                what = f"{tokens}-token prefill" if name == "prefill" else f"decode x{args.decode_rows}"
                label = numerics + (f" (chunk {chunk})" if numerics == "fast" and name == "prefill" else "")
                print(f"{what:>20}  {label:<22} op {op_s * 1e3:9.1f} ms   layer {layer_s * 1e3:9.1f} ms")


if __name__ == "__main__":
    main()
