"""Write synthetic checkpoints in the published quantised formats, with the real tensor names and an index file.

    python scripts/make_quantized_checkpoints.py tiny --out DIR [--families ...] [--formats ...]
        every tiny fixture family (tests/models/data) in every format (fp8, fp8_ds = DeepSeek-V4's FP8 with FP4
        experts, mxfp8, nvfp4, mxfp4), each beside its float32 twin `<name>-float32` (the decoded weights);
    python scripts/make_quantized_checkpoints.py medium --out DIR [--format nvfp4] [--gb 4.1] [--shards 20]
        a MiniMax-M3-shaped checkpoint of at least `--gb` GB in `--shards` files (random codes: for load
        benchmarks, scripts/bench_load.py); never commit it.

numpy only (no torch). Tests build their tiny checkpoints the same way, in temporary directories.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from checkpoints.quant_writer import FORMATS, dequantize_checkpoint, quantize_checkpoint  # noqa: E402
from checkpoints.synthetic import Sizes, checkpoint_bytes, minimax_m3  # noqa: E402

FIXTURES = REPO / "tests" / "models" / "data"
# MiniMax-M3's proportions at a few GB: experts hold ~95% of the bytes, as in the full model.
MEDIUM = Sizes(layers=2, dense_layers=1, hidden=2048, heads=16, kv_heads=4, head_dim=128, experts=64,
               experts_per_token=4, expert_inner=1536, shared_inner=1536, dense_inner=4096, vocab=8192)


def medium_sizes(gb: float, fmt: str) -> Sizes:
    """MEDIUM with as many layers as reach `gb` GB."""
    sizes = MEDIUM
    while checkpoint_bytes(sizes, fmt) < gb * 1e9:
        sizes = dataclasses.replace(sizes, layers=sizes.layers + 1)
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="size", required=True)
    tiny = sub.add_parser("tiny")
    tiny.add_argument("--out", type=Path, required=True)
    tiny.add_argument("--families", nargs="+", default=["minimax-m3-a", "kimi-linear-a", "deepseek-v4-a"])
    tiny.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    tiny.add_argument("--block", type=int, default=16, help="FP8 block (rows = cols); the fixtures are 64 wide")
    medium = sub.add_parser("medium")
    medium.add_argument("--out", type=Path, required=True)
    medium.add_argument("--format", default="nvfp4", choices=("nvfp4", "mxfp8", "bf16"))
    medium.add_argument("--gb", type=float, default=4.1)
    medium.add_argument("--shards", type=int, default=20)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.size == "tiny":
        import ml_dtypes

        for family in args.families:
            for fmt in args.formats:
                target = args.out / f"{family}-{fmt}"
                quantize_checkpoint(FIXTURES / family, target, fmt, block=(args.block, args.block), shards=3,
                                    source_dtype=ml_dtypes.bfloat16)
                dequantize_checkpoint(target, args.out / f"{family}-{fmt}-float32")
                print(f"wrote {target} and its float32 twin", flush=True)
        return 0
    sizes = medium_sizes(args.gb, args.format)
    target = minimax_m3(args.out, sizes, args.format, shards=args.shards)
    files = sorted(target.glob("*.safetensors"))
    total = sum(f.stat().st_size for f in files)
    print(f"wrote {target}: {total / 1e9:.2f} GB in {len(files)} shards ({sizes.layers} layers, {sizes.experts} experts) "
          f"in {time.perf_counter() - started:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
