"""A checkpoint's `quantization_config` and the quantised tensors it implies, as the published checkpoints store them.

Schemes (named as vLLM's `--quantization` names them):
- "fp8": FP8 E4M3 `X.weight` with block scales `X.weight_scale_inv` (or DeepSeek's `X.scale`), float32 or
  E8M0 (`scale_fmt: ue8m0`), block `weight_block_size` (128 x 128); DeepSeek-V4's `expert_dtype: fp4`
  experts hold E2M1 pairs (`X.weight` I8 `[out, in/2]`) with E8M0 scales per 32 inputs ("deepseek_v4_fp8").
- "modelopt_mxfp8" (MiniMax's `quant_method: mxfp8`, ModelOpt's MXFP8): E4M3 `X.weight` with E8M0 (U8)
  `X.weight_scale` per 32 inputs.
- "modelopt_fp4" (ModelOpt NVFP4): E2M1 pairs `X.weight` U8 `[out, in/2]`, E4M3 `X.weight_scale` per 16
  inputs, float32 `X.weight_scale_2` (global); `X.input_scale` (activations) is not used.
- "compressed-tensors" with format `mxfp4-pack-quantized` (Kimi-K3): E2M1 pairs `X.weight_packed`, E8M0
  (U8) `X.weight_scale` per 32 inputs.
Which matrices are quantised is read from the tensors (a weight in a quantised dtype must bring its
scales); `quantized(base)` checks every part's dtype and shape against the scheme and raises an error
naming the file and the tensor otherwise. Host only: never imports jax.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from agentjax.errors import ModelConfigError, TensorMismatchError, UnsupportedModelError
from checkpoints.quant_codecs import E4M3, E8M0, Codec

# `--quantization` values agentjax loads (vLLM's names); each maps to the schemes it accepts.
QUANTIZATION_OPTIONS = ("fp8", "deepseek_v4_fp8", "mxfp8", "modelopt_mxfp8", "modelopt_fp4", "compressed-tensors")
_FLOAT = ("F32", "F16", "BF16", "F64")


@dataclass(frozen=True)
class QuantScheme:
    """The quantisation a checkpoint declares (see the module docstring)."""

    method: str  # vLLM's name of the scheme
    source: str  # the file it was read from
    block: tuple[int, int] = (128, 128)  # FP8 block-scaled: (out, in) values per scale
    group_size: int = 32
    skip: tuple[str, ...] = field(default_factory=tuple)  # module patterns the config leaves unquantised
    accepts: tuple[str, ...] = ()  # other --quantization names meaning this scheme

    def check_option(self, option: str | None) -> None:
        """Fail unless `--quantization option` names this scheme (None: take the checkpoint's)."""
        if option in (None, "auto", self.method, *self.accepts):
            return
        raise ModelConfigError(f"--quantization {option} does not match the checkpoint: {self.source} declares "
                               f"{self.method!r} (accepted: {', '.join((self.method, *self.accepts))})")

    def quantized(self, base: str, entries: dict) -> "QuantTensor | None":
        """The parts of matrix `base` (`base.weight` and its scales), or None when it is stored in floats."""
        weight = entries.get(f"{base}.weight_packed") or entries.get(f"{base}.weight")
        if weight is None:
            return None
        kind = _dtype_name(weight.dtype)
        if kind in _FLOAT:
            return None
        rows, stored_cols = weight.shape[-2:] if len(weight.shape) >= 2 else (None, None)
        if rows is None:
            raise TensorMismatchError(f"{weight.name} in {weight.file} is a {kind} tensor of shape {weight.shape}; "
                                      f"a quantised matrix has at least 2 dimensions")
        packed = kind in ("U8", "I8") and not (self.method == "modelopt_mxfp8")
        cols = stored_cols * 2 if packed else stored_cols
        if self.method in ("fp8", "deepseek_v4_fp8"):
            scale = _companion(entries, weight, base, ("weight_scale_inv", "scale"))
            if packed:  # DeepSeek-V4's FP4 experts: E8M0 per 32 inputs, one row each
                codec = Codec("e2m1", _scale_kind(scale, ("e8m0",)), (1, 32))
            else:
                _need(weight, kind, ("F8_E4M3",), self)
                codec = Codec("e4m3", _scale_kind(scale, ("f32", "e8m0")), self.block)
            return QuantTensor(weight, _checked(scale, codec, rows, cols, self), None, codec, (rows, cols))
        if self.method == "modelopt_mxfp8":
            _need(weight, kind, ("F8_E4M3",), self)
            scale = _companion(entries, weight, base, ("weight_scale", "weight_scale_inv"))
            codec = Codec("e4m3", _scale_kind(scale, ("e8m0",)), (1, self.group_size))
            return QuantTensor(weight, _checked(scale, codec, rows, cols, self), None, codec, (rows, cols))
        if self.method == "modelopt_fp4":
            _need(weight, kind, ("U8",), self)
            scale = _companion(entries, weight, base, ("weight_scale",))
            glob = _companion(entries, weight, base, ("weight_scale_2",))
            if int(np.prod(glob.shape)) != 1 or _dtype_name(glob.dtype) != "F32":
                raise TensorMismatchError(f"{glob.name} in {glob.file} is {_dtype_name(glob.dtype)} {glob.shape}; "
                                          f"NVFP4's global scale is one float32")
            codec = Codec("e2m1", _scale_kind(scale, ("e4m3",)), (1, self.group_size), global_scale=True)
            extra = tuple(e for e in (entries.get(f"{base}.input_scale"),) if e is not None)
            return QuantTensor(weight, _checked(scale, codec, rows, cols, self), glob, codec, (rows, cols), extra)
        if self.method == "compressed-tensors":
            _need(weight, kind, ("U8",), self)
            scale = _companion(entries, weight, base, ("weight_scale",))
            codec = Codec("e2m1", _scale_kind(scale, ("e8m0",)), (1, self.group_size))
            return QuantTensor(weight, _checked(scale, codec, rows, cols, self), None, codec, (rows, cols))
        raise UnsupportedModelError(f"{self.source}: quantisation {self.method!r} is not supported")


@dataclass(frozen=True)
class QuantTensor:
    """The checkpoint tensors of one quantised matrix; `codec` in the stored `[out, in]` orientation."""

    values: Any  # TensorEntry
    scales: Any
    global_scale: Any
    codec: Codec
    shape: tuple[int, int]
    extra: tuple = ()  # tensors that belong to it but are not used (activation scales)

    @property
    def entries(self) -> tuple:
        return tuple(e for e in (self.values, self.scales, self.global_scale, *self.extra) if e is not None)


def _dtype_name(dtype) -> str:
    dtype = np.dtype(dtype)
    names = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.float64): "F64",
             E4M3: "F8_E4M3", E8M0: "F8_E8M0", np.dtype(np.uint8): "U8", np.dtype(np.int8): "I8"}
    if dtype.name == "bfloat16":
        return "BF16"
    return names.get(dtype, dtype.name)


def _companion(entries: dict, weight, base: str, suffixes: tuple[str, ...]):
    for suffix in suffixes:
        if f"{base}.{suffix}" in entries:
            return entries[f"{base}.{suffix}"]
    raise TensorMismatchError(f"{weight.name} in {weight.file} is stored as {_dtype_name(weight.dtype)} but the "
                              f"checkpoint lacks its scale tensor {base}.{suffixes[0]}")


def _need(weight, kind: str, allowed: tuple[str, ...], scheme: QuantScheme) -> None:
    if kind not in allowed:
        raise TensorMismatchError(f"{weight.name} in {weight.file} is {kind}; the {scheme.method} scheme "
                                  f"({scheme.source}) stores quantised weights as {' or '.join(allowed)}")


def _scale_kind(scale, allowed: tuple[str, ...]) -> str:
    kind = {"F32": "f32", "F8_E8M0": "e8m0", "U8": "e8m0", "F8_E4M3": "e4m3"}.get(_dtype_name(scale.dtype))
    if kind not in allowed:
        raise TensorMismatchError(f"scale tensor {scale.name} in {scale.file} is {_dtype_name(scale.dtype)}; "
                                  f"expected {' or '.join(allowed)} scales")
    return kind


def _checked(scale, codec: Codec, rows: int, cols: int, scheme: QuantScheme):
    want = codec.scale_shape((rows, cols))
    if tuple(scale.shape) != want:
        raise TensorMismatchError(
            f"scale tensor {scale.name} in {scale.file} has shape {tuple(scale.shape)}; a [{rows}, {cols}] weight "
            f"with blocks of {codec.block[0]} x {codec.block[1]} ({scheme.source}) needs {want}")
    return scale


def read_scheme(raw: dict, directory: Path) -> QuantScheme | None:
    """The checkpoint's scheme: `quantization_config` at the top of config.json or in its `text_config`,
    else ModelOpt's hf_quant_config.json; None for a float checkpoint."""
    source = str(directory / "config.json")
    config = raw.get("quantization_config")
    if config is None and isinstance(raw.get("text_config"), dict):
        config = raw["text_config"].get("quantization_config")
    if config is None and (directory / "hf_quant_config.json").is_file():
        source = str(directory / "hf_quant_config.json")
        config = {"quant_method": "modelopt", **json.loads((directory / "hf_quant_config.json").read_text())}
    if config is None:
        return None
    if not isinstance(config, dict):
        raise ModelConfigError(f"{source}: quantization_config is {config!r}; expected a JSON object")
    return parse_scheme(config, source, expert_dtype=raw.get("expert_dtype"))


def parse_scheme(config: dict, source: str, expert_dtype: str | None = None) -> QuantScheme:
    method = config.get("quant_method")
    if method in ("fp8", "deepseek_v4_fp8"):
        block = config.get("weight_block_size") or [128, 128]
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise ModelConfigError(f"{source}: field 'quantization_config.weight_block_size' is {block!r}; expected "
                                   f"[rows, cols]")
        if config.get("activation_scheme", "dynamic") != "dynamic":
            raise UnsupportedModelError(f"{source}: FP8 activation_scheme {config['activation_scheme']!r} is not "
                                        f"supported (agentjax keeps activations in float; give a dynamic checkpoint)")
        fp4_experts = (config.get("expert_dtype") or expert_dtype) == "fp4"
        name = "deepseek_v4_fp8" if fp4_experts else "fp8"
        return QuantScheme(name, source, tuple(block), skip=_skip(config, "modules_to_not_convert", "ignored_layers"),
                           accepts=("fp8", "deepseek_v4_fp8") if fp4_experts else ())
    if method == "mxfp8":
        return QuantScheme("modelopt_mxfp8", source, skip=_skip(config, "ignored_layers", "modules_to_not_convert"),
                           accepts=("mxfp8",))
    if method == "modelopt":
        settings = config.get("quantization", config)
        algo = str(settings.get("quant_algo", "")).upper()
        skip = _skip(settings, "exclude_modules")
        if algo == "NVFP4":
            group = settings.get("group_size", 16)
            if group != 16:
                raise ModelConfigError(f"{source}: NVFP4 group_size is {group!r}; NVFP4 scales blocks of 16")
            return QuantScheme("modelopt_fp4", source, group_size=16, skip=skip)
        if algo == "MXFP8":
            return QuantScheme("modelopt_mxfp8", source, skip=skip, accepts=("mxfp8",))
        raise UnsupportedModelError(f"{source}: ModelOpt quant_algo {algo or None!r} is not supported; "
                                    f"supported: NVFP4, MXFP8")
    if method == "compressed-tensors":
        fmt = config.get("format")
        groups = config.get("config_groups") or {}
        formats = {g.get("format", fmt) for g in groups.values() if isinstance(g, dict)} or {fmt}
        if formats == {None}:
            raise ModelConfigError(f"{source}: field 'quantization_config.format' is missing; compressed-tensors "
                                   f"checkpoints name their format (mxfp4-pack-quantized)")
        if formats != {"mxfp4-pack-quantized"}:
            raise UnsupportedModelError(f"{source}: compressed-tensors format {sorted(map(str, formats))} is not "
                                        f"supported; supported: mxfp4-pack-quantized")
        sizes = {(g.get("weights") or {}).get("group_size", 32) for g in groups.values() if isinstance(g, dict)}
        if sizes - {32}:
            raise ModelConfigError(f"{source}: MXFP4 group_size {sorted(sizes)}; MXFP4 scales blocks of 32")
        return QuantScheme("compressed-tensors", source, skip=_skip(config, "ignore"))
    raise UnsupportedModelError(f"{source}: quant_method {method!r} is not supported; supported: fp8 (block-scaled), "
                                f"mxfp8, modelopt (NVFP4, MXFP8), compressed-tensors (mxfp4-pack-quantized)")


def _skip(config: dict, *keys: str) -> tuple[str, ...]:
    for key in keys:
        value = config.get(key)
        if isinstance(value, list):
            return tuple(str(v) for v in value)
    return ()
