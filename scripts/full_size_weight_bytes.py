"""Weights per device of the full-size presets in their published formats under the planner's layouts.

Abstract shapes only (`preset_config(name, abstract=True)`): every parameter gets a recipe of the shape and
the format its published checkpoint stores (checkpoints/quant_config.py), and the streaming loader's
placement (sharding/weight_placement.py) splits it as the layout does: the bytes a device would hold, the
largest device's total, and whether every TP/EP split falls on whole scale blocks. Nothing is allocated.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/full_size_weight_bytes.py [--write]

Formats: DeepSeek-V4-Pro "deepseek_v4_fp8" (routed experts FP4 with E8M0 per 32, other matrices FP8 with
E8M0 128x128 blocks); Kimi-K3 "compressed-tensors" MXFP4 (routed experts and the latent projections, the
rest bfloat16, as its published ignore list says); MiniMax-M3 ModelOpt NVFP4 and MXFP8 (every linear
layer). Embeddings, the LM head, norms and routers bfloat16 throughout.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks_md import write_section  # noqa: E402
from checkpoints.lazy_quant import LazyQuant  # noqa: E402
from checkpoints.lazy_tensors import Lazy  # noqa: E402
from checkpoints.quant_codecs import E4M3, E8M0, Codec  # noqa: E402

SECTION = "## Full-size weights per device"
EXPERTS = re.compile(r".*mlp\.experts\.(gate_up_proj|down_proj)$")
LATENT = re.compile(r".*mlp\.latent_(down|up)_proj$")
MATRIX = re.compile(r".*(\.kernel|experts\.(gate_up_proj|down_proj)|latent_(down|up)_proj)$")
ROUTER = re.compile(r".*router\.kernel$")


class Shape(Lazy):
    """A recipe with a shape and dtype only (nothing to read)."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)

    def read(self, index):
        raise RuntimeError("an abstract recipe has no values")


def _quant(shape, hf_codec: Codec, name: str) -> LazyQuant:
    codec = hf_codec.swapped()  # agentjax kernels are [in, out]: HF's [out, in] transposed
    values = Shape(codec.value_shape(shape), np.uint8 if codec.packed else E4M3)
    scales = Shape(codec.scale_shape(shape), {"e8m0": E8M0, "e4m3": E4M3, "f32": np.float32}[codec.scales])
    glob = Shape((*shape[:-2], 1, 1), np.float32) if codec.global_scale else None
    return LazyQuant(values, scales, glob, codec, shape, name)


def recipes(preset: str, fmt: str) -> tuple:
    import ml_dtypes

    from agentjax.models import preset_config
    from agentjax.models.params import expected_shapes

    cfg = preset_config(preset, abstract=True)
    out = {}
    for name, shape in expected_shapes(cfg).items():
        matrix = MATRIX.fullmatch(name) and not ROUTER.fullmatch(name) and len(shape) >= 2
        codec = None
        if matrix and fmt == "deepseek_v4_fp8":
            codec = Codec("e2m1", "e8m0", (1, 32)) if EXPERTS.fullmatch(name) else Codec("e4m3", "e8m0", (128, 128))
        elif matrix and fmt == "mxfp4" and (EXPERTS.fullmatch(name) or LATENT.fullmatch(name)):
            codec = Codec("e2m1", "e8m0", (1, 32))
        elif matrix and fmt == "nvfp4":
            codec = Codec("e2m1", "e4m3", (1, 16), global_scale=True)
        elif matrix and fmt == "mxfp8":
            codec = Codec("e4m3", "e8m0", (1, 32))
        if codec is not None:
            out[name] = _quant(shape, codec, name)
        else:
            integer = name.endswith("hash_table")
            out[name] = Shape(shape, np.int32 if integer else ml_dtypes.bfloat16)
    return cfg, out


CASES = [("deepseek-v4-pro", "deepseek_v4_fp8", ("tp8", "dep8")), ("kimi-k3", "mxfp4", ("tp8", "dep8")),
         ("minimax-m3", "nvfp4", ("tp2", "tp8", "dep8")), ("minimax-m3", "mxfp8", ("tp2", "tp8", "dep8"))]
LAYOUTS = {"tp2": dict(tensor_parallel_size=2), "tp8": dict(tensor_parallel_size=8),
           "dep8": dict(data_parallel_size=8, enable_expert_parallel=True)}


def row(preset: str, fmt: str, layout: str) -> str:
    from agentjax.config import EngineConfig
    from agentjax.errors import ParallelLayoutError
    from sharding.mesh import build_mesh
    from sharding.streaming_load import placements

    cfg, rec = recipes(preset, fmt)
    parallel = EngineConfig(**LAYOUTS[layout]).parallel
    checkpoint = sum(r.nbytes for r in rec.values())
    try:
        plan = placements(cfg, rec, parallel=parallel, mesh=build_mesh(parallel))
    except ParallelLayoutError as exc:
        return f"| {preset} | {fmt} | {layout} | {checkpoint / 1e9:,.1f} | does not split on whole blocks: {exc} | | |"
    devices = list(build_mesh(parallel).devices.flat)
    per_device = [sum(p.local_bytes(d) for p in plan) for d in devices]
    stored = sum(per_device)
    return (f"| {preset} | {fmt} | {layout} | {checkpoint / 1e9:,.1f} | {max(per_device) / 1e9:,.1f} | "
            f"{min(per_device) / 1e9:,.1f} | {stored / 1e9:,.1f} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args(argv)
    lines = [SECTION, "",
             "`XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/full_size_weight_bytes.py --write` "
             "(abstract shapes, nothing allocated; computed, not timed). Checkpoint GB: the published format's "
             "tensors the model reads (MTP modules included); per device: what the streaming loader's placement "
             "puts on the largest and smallest device (MTP modules are not run by the sharded step, so not placed); "
             "placed GB: all devices' parameter arrays together (replicated tensors counted on every device). "
             "Every TP/EP split of these layouts falls on whole scale blocks.", "",
             "| preset | format | layout | checkpoint GB | largest device GB | smallest device GB | placed GB (all devices) |",
             "|---|---|---|---|---|---|---|"]
    for preset, fmt, layouts in CASES:
        for layout in layouts:
            lines.append(row(preset, fmt, layout))
            print(lines[-1], flush=True)
    if args.write:
        write_section("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
