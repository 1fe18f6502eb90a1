"""Writing checkpoints in the published quantised layouts (synthetic test checkpoints) and their float32 twins.

`quantize_checkpoint(src, dst, fmt)` rewrites a float HF directory (any family: the tensor names are kept)
with its linear layers in one format, named and configured as the published checkpoints are
(checkpoints/quant_config.py), split into `shards` files with `model.safetensors.index.json`.
`dequantize_checkpoint(src, dst)` writes the float32 checkpoint of a quantised one's decoded weights
(the same names, no quantization_config): the reference a quantised load must match exactly.
`ShardWriter` writes safetensors files with numpy alone, one shard in memory at a time. Host only.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np

from checkpoints import quant_codecs
from checkpoints.safetensors_reader import read_header, read_tensor

FORMATS = ("fp8", "fp8_ds", "mxfp8", "nvfp4", "mxfp4")
_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(ml_dtypes.bfloat16): "BF16",
           np.dtype(np.float64): "F64", quant_codecs.E4M3: "F8_E4M3", quant_codecs.E8M0: "F8_E8M0",
           np.dtype(np.uint8): "U8", np.dtype(np.int8): "I8", np.dtype(np.int32): "I32", np.dtype(np.int64): "I64",
           np.dtype(np.bool_): "BOOL"}
# Never quantised: embeddings, the LM head, norms, routers (the published checkpoints keep them in floats).
_NEVER = re.compile(r"(^|.*\.)(embed_tokens|embed|lm_head|head|emb\.tok_emb)\.weight$|.*norm\.weight$|"
                    r".*\.gate\.weight$|.*layernorm.*")
_EXPERT = re.compile(r".*\.experts\.\d+\.w[123]\.weight$")
_PAIR = re.compile(r"\.(w1|w3|gate_proj|up_proj)\.weight$")


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header, offset = {}, 0
    for name, array in tensors.items():
        array = np.asarray(array)
        header[name] = {"dtype": _DTYPES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for array in tensors.values():
            f.write(np.ascontiguousarray(array).tobytes())


class ShardWriter:
    """Tensors into `model-0000k-of-0000n.safetensors` files of about `shard_bytes` each, plus the index."""

    def __init__(self, directory: Path, shard_bytes: int):
        self.directory, self.shard_bytes = Path(directory), shard_bytes
        self.pending: dict[str, np.ndarray] = {}
        self.files: list[list[str]] = []
        self.total = 0

    def add(self, name: str, array: np.ndarray) -> None:
        array = np.asarray(array)
        size = sum(a.nbytes for a in self.pending.values())
        if self.pending and size + array.nbytes > self.shard_bytes:
            self.flush()
        self.pending[name] = array
        self.total += array.nbytes

    def flush(self) -> None:
        if self.pending:
            write_safetensors(self.directory / f"shard-{len(self.files):05d}.tmp", self.pending)
            self.files.append(list(self.pending))
            self.pending = {}

    def close(self) -> list[Path]:
        self.flush()
        count, weight_map, paths = len(self.files), {}, []
        for k, names in enumerate(self.files):
            final = self.directory / f"model-{k + 1:05d}-of-{count:05d}.safetensors"
            (self.directory / f"shard-{k:05d}.tmp").rename(final)
            weight_map.update({n: final.name for n in names})
            paths.append(final)
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return paths


def _source_tensors(directory: Path) -> dict:
    from checkpoints.hf_tensors import safetensors_files

    entries = {}
    for file in safetensors_files(directory):
        entries.update(read_header(file))
    return entries


def quant_config(fmt: str, block: tuple[int, int], skipped: list[str]) -> dict:
    """The `quantization_config` a published checkpoint of `fmt` carries."""
    if fmt == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(block), "modules_to_not_convert": skipped}
    if fmt == "fp8_ds":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "scale_fmt": "ue8m0",
                "weight_block_size": list(block), "expert_dtype": "fp4", "modules_to_not_convert": skipped}
    if fmt == "mxfp8":
        return {"quant_method": "mxfp8", "ignored_layers": skipped}
    if fmt == "nvfp4":
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": skipped,
                "kv_cache_quant_algo": None}
    weights = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32,
               "dynamic": False, "scale_dtype": "torch.uint8"}
    return {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"], "weights": weights,
                                          "input_activations": None, "output_activations": None}},
            "ignore": [f"re:^{re.escape(s)}$" for s in skipped]}


def _quantizable(name: str, shape: tuple, fmt: str, block: tuple[int, int]) -> bool:
    if len(shape) != 2 or not name.endswith(".weight") or _NEVER.fullmatch(name):
        return False
    rows, cols = shape
    if fmt == "mxfp4" and not _EXPERT.fullmatch(name):
        return False  # Kimi-K3 quantises the routed experts only
    if fmt in ("fp8", "fp8_ds") and not (fmt == "fp8_ds" and _EXPERT.fullmatch(name)):
        return rows % block[0] == 0 and cols % block[1] == 0
    return cols % 2 == 0


def _encode_one(name: str, w: np.ndarray, fmt: str, block, global_scale=None) -> dict[str, np.ndarray]:
    base = name.removesuffix(".weight")
    if fmt == "fp8":
        values, scales, _ = quant_codecs.encode(w, "fp8", block)
        return {name: values, f"{base}.weight_scale_inv": scales}
    if fmt == "fp8_ds":
        if _EXPERT.fullmatch(name):
            values, scales, _ = quant_codecs.encode(w, "mxfp4")
            return {name: values.view(np.int8), f"{base}.scale": scales}
        values, scales, _ = quant_codecs.encode(w, "fp8_ue8m0", block)
        return {name: values, f"{base}.scale": scales}
    if fmt == "mxfp8":
        values, scales, _ = quant_codecs.encode(w, "mxfp8")
        return {name: values, f"{base}.weight_scale": scales.view(np.uint8)}
    if fmt == "nvfp4":
        values, scales, glob = quant_codecs.encode(w, "nvfp4", global_scale=global_scale)
        return {name: values, f"{base}.weight_scale": scales, f"{base}.weight_scale_2": glob.reshape(()),
                f"{base}.input_scale": np.ones((), np.float32)}
    values, scales, _ = quant_codecs.encode(w, "mxfp4")
    return {f"{base}.weight_packed": values, f"{base}.weight_scale": scales.view(np.uint8)}


def quantize_checkpoint(src: Path, dst: Path, fmt: str, *, block: tuple[int, int] = (128, 128), shards: int = 4,
                        source_dtype=np.float32) -> Path:
    """`src` (a float HF directory) rewritten in `fmt` (one of FORMATS) under `dst`, in about `shards` files."""
    src, dst = Path(src), Path(dst)
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}; choose one of {FORMATS}")
    dst.mkdir(parents=True, exist_ok=True)
    entries = _source_tensors(src)
    plain = {n: np.asarray(read_tensor(e)).astype(source_dtype) if e.dtype.kind == "f" else np.asarray(read_tensor(e))
             for n, e in entries.items()}
    chosen = {n for n, a in plain.items() if _quantizable(n, a.shape, fmt, block)}
    pairs: dict[str, float] = {}  # NVFP4: one global scale per gate|up pair (they are fused on load)
    for n in chosen:
        key = _PAIR.sub(".gate_up", n)
        pairs[key] = max(pairs.get(key, 0.0), float(np.abs(plain[n].astype(np.float32)).max()))
    out: dict[str, np.ndarray] = {}
    for name, array in plain.items():
        if name in chosen:
            glob = max(pairs[_PAIR.sub(".gate_up", name)], 1e-12) / (6.0 * 448.0)
            out.update(_encode_one(name, array.astype(np.float32), fmt, block, glob))
        else:
            out[name] = array
    total = sum(a.nbytes for a in out.values())
    writer = ShardWriter(dst, max(1, total // shards + 1))
    for name, array in out.items():
        writer.add(name, array)
    writer.close()
    config = json.loads((src / "config.json").read_text())
    skipped = sorted(n.removesuffix(".weight") for n, a in plain.items()
                     if n.endswith(".weight") and a.ndim == 2 and n not in chosen)
    qc = quant_config(fmt, block, skipped)
    if fmt == "fp8_ds":
        config["expert_dtype"] = "fp4"
    target = config["text_config"] if fmt == "mxfp4" and isinstance(config.get("text_config"), dict) else config
    target["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for extra in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (src / extra).is_file():
            shutil.copy(src / extra, dst / extra)
    return dst


def dequantize_checkpoint(src: Path, dst: Path) -> Path:
    """The float32 checkpoint of a quantised directory's decoded weights (one file, no quantization_config)."""
    from checkpoints.hf import quant_scheme, read_config
    from checkpoints.hf_tensors import HFTensors

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = HFTensors.open(src, scheme=quant_scheme(src))
    out = {}
    for name in sorted(set(tensors.names) | set(tensors.virtual)):
        if name in tensors.taken:
            continue
        if name.endswith(".weight") and tensors._quantized(name) is not None:
            out[name] = tensors.take(name)  # decoded, float32
        elif name in tensors.entries:
            array = np.asarray(read_tensor(tensors.entries[name]))
            out[name] = array.astype(np.float32) if array.dtype.kind == "f" or array.dtype.itemsize == 1 else array
    write_safetensors(dst / "model.safetensors", {n: a for n, a in out.items() if n not in tensors.taken or
                                                  n.endswith(".weight")})
    config = read_config(src)
    config.pop("quantization_config", None)
    config.pop("expert_dtype", None)
    if isinstance(config.get("text_config"), dict):
        config["text_config"].pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for extra in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (src / extra).is_file():
            shutil.copy(src / extra, dst / extra)
    return dst
