"""Models: the Flax NNX decoder, its parameters, presets, and `load_model`.

`load_model(spec)` accepts None (the embedded SmolLM2-135M-Instruct), an embedded model name,
"preset:NAME", a GGUF file or an HF directory, and returns `(ModelConfig, params, tokenizer)`.
Every checkpoint is read and checked on the host before any weight is placed on the device.
Converted GGUF models are cached with orbax (checksums verified on restore), so a second start
skips dequantisation. HF directories stream (sharding/streaming_load.py): each device's shard of
each parameter is read straight into device memory, laid out as the engine's layout asks, with
quantised matrices kept in their checkpoint's format (agentjax/models/quantized.py).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from agentjax.config import ModelConfig
from agentjax.errors import ModelLoadError
from agentjax.models.decoder import Decoder
from agentjax.models.params import arrays_from_params, params_from_arrays, random_params
from agentjax.models.presets import PRESETS, preset_config
from agentjax.progress import Heartbeat

logger = logging.getLogger(__name__)

__all__ = ["Decoder", "ModelConfig", "PRESETS", "load_model", "params_from_arrays", "arrays_from_params"]


def _tokenizer_from_gguf(path: Path) -> Any:
    from checkpoints.tokenizer import Tokenizer

    return Tokenizer.from_gguf(path)


def _checked(cfg: ModelConfig, arrays: dict, where: str) -> None:
    """Every name and shape against the model, on the host, before anything reaches the device."""
    from agentjax.models.params import expected_shapes
    from checkpoints.validate import check_tensors

    check_tensors(expected_shapes(cfg), arrays, where=where)


def _load_gguf_cached(path: Path, use_cache: bool, keep_blocks: bool = False) -> tuple[ModelConfig, dict]:
    """Convert a GGUF file, or restore its converted arrays from the orbax cache after verifying
    them against the checksums recorded at conversion. An entry that fails (or cannot be read)
    is named in a warning, reconverted from the GGUF file and rewritten. With `keep_blocks`, block-quantised
    matrices stay BlockWeights (agentjax.models.block_weights); such an entry is cached apart."""
    from agentjax.models.block_weights import flatten_blocks, unflatten_blocks
    from checkpoints.embedded import cache_dir
    from checkpoints.gguf import host_bytes, load_gguf
    from checkpoints.orbax_io import cache_key, restore_params, save_params

    entry = cache_dir() / "converted" / f"{path.stem}-{cache_key(path)}{'-blocks' if keep_blocks else ''}"
    if use_cache and entry.exists():
        try:
            with Heartbeat(logger, f"restoring {path.name}'s converted weights from {entry}",
                           doing=f"restoring {path.name}") as beat:
                cfg, flat = restore_params(entry)
                arrays = unflatten_blocks(flat)
                _checked(cfg, arrays, f"converted-weights cache entry {entry}")
            logger.info("restored %s: %d tensors, %.0f MB in %.1f s", path.name, len(arrays),
                        sum(map(host_bytes, arrays.values())) / 1e6, beat.elapsed)
            return cfg, arrays
        except Exception as exc:  # corrupt, torn, foreign or stale: convert again
            logger.warning(
                "reconverting %s: its converted-weights cache entry %s failed (%s: %s)",
                path, entry, type(exc).__name__, exc,
            )
    started = time.perf_counter()
    logger.info("converting %s (once: the result is cached for the next start)", path.name)
    cfg, arrays, _ = load_gguf(path, keep_blocks=keep_blocks)
    size_mb = sum(map(host_bytes, arrays.values())) / 1e6
    logger.info("converted %s: %d tensors, %.0f MB in %.1f s", path.name, len(arrays), size_mb,
                time.perf_counter() - started)
    _checked(cfg, arrays, str(path))
    if use_cache:
        try:
            with Heartbeat(logger, f"caching the converted weights ({size_mb:.0f} MB) in {entry}",
                           doing="caching the converted weights"):
                save_params(entry, cfg, flatten_blocks(arrays))
        except OSError as exc:
            logger.warning("could not cache converted model at %s: %s", entry, exc)
    return cfg, arrays


def resolve_model_path(spec: str | None) -> Path | None:
    """The file or directory a model spec names (None for presets)."""
    from checkpoints.embedded import EMBEDDED_MODELS, embedded_model_path

    if spec is None or spec in ("default", *EMBEDDED_MODELS):
        return embedded_model_path("smollm2-135m-instruct" if spec in (None, "default") else spec)
    if spec.startswith("preset:"):
        return None
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model {spec!r} not found: give a GGUF file, an HF directory, 'preset:NAME' "
            f"or an embedded model ({', '.join(EMBEDDED_MODELS)})"
        )
    return path


def load_hf_streaming(path: Path, dtype: str, quantization: str | None = None, engine_config=None,
                      progress: bool = True) -> tuple[ModelConfig, Any, Any]:
    """An HF directory read straight into device arrays: laid out by `engine_config`'s parallel layout
    (on one device without one), after a check that its weights and KV fit the devices present."""
    from agentjax.models.params import expected_shapes
    from checkpoints.hf import load_hf
    from sharding.memory_check import kv_bytes_per_device
    from sharding.streaming_load import load_params

    cfg, recipes, tokenizer = load_hf(path, expected_shapes, quantization=quantization, lazy=True)
    cfg = cfg.replace(dtype=dtype)
    parallel = engine_config.parallel if engine_config is not None else None
    numerics = engine_config.numerics if engine_config is not None else "fast"
    kv_bytes = kv_bytes_per_device(cfg, engine_config) if engine_config is not None else 0
    started = time.perf_counter()
    params = load_params(cfg, recipes, parallel=parallel, numerics=numerics, kv_bytes=kv_bytes, progress=progress)
    logger.info("streamed %s in %.1fs", path, time.perf_counter() - started)
    return cfg, params, tokenizer


def load_model(
    spec: str | None = None, *, dtype: str = "float32", use_cache: bool = True, seed: int = 0,
    gguf_blocks: bool | None = None, quantization: str | None = None, engine_config=None,
) -> tuple[ModelConfig, Any, Any]:
    """`(config, params, tokenizer)` for a model spec; params are an `nnx.State` on the device.

    `gguf_blocks`: keep a GGUF file's Q4_0, Q4_1 and Q8_0 matrices in their blocks on the device and
    dequantise them inside the step (the same float32 weights, a quarter of the bytes read; see
    agentjax.models.block_weights). The default (None) keeps them in float32 models, where the weights
    are bit-identical; other dtypes convert at load. `quantization` checks an HF checkpoint's scheme by
    vLLM's `--quantization` names (checkpoints/quant_config.py); `engine_config` (an EngineConfig) lays
    an HF checkpoint out for its parallel layout while it is read and sizes the memory check's KV."""
    from checkpoints.embedded import smollm2_path

    path = resolve_model_path(spec)
    if path is None:
        cfg = preset_config(spec.removeprefix("preset:")).replace(dtype=dtype)
        return cfg, random_params(cfg, seed), _tokenizer_from_gguf(smollm2_path())
    if quantization not in (None, "auto") and not path.is_dir():
        raise ModelLoadError(f"--quantization {quantization} applies to HF checkpoint directories, not {path}")
    if path.is_dir():  # every check runs on the host before the first read
        return load_hf_streaming(path, dtype, quantization, engine_config)
    if path.suffix == ".gguf":
        keep_blocks = dtype == "float32" if gguf_blocks is None else gguf_blocks
        cfg, arrays = _load_gguf_cached(path, use_cache, keep_blocks)
        tokenizer = _tokenizer_from_gguf(path)
    else:
        raise ModelLoadError(f"{path}: expected a .gguf file or an HF directory with config.json")
    cfg = cfg.replace(dtype=dtype)
    with Heartbeat(logger, f"placing {cfg.name}'s weights on the device", doing="placing the weights") as beat:
        params = params_from_arrays(cfg, arrays)
    logger.info("weights on the device in %.1f s", beat.elapsed)
    return cfg, params, tokenizer
