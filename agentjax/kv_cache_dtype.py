"""The engine's `kv_cache_dtype` setting: which values and paths take it, and the model config it gives.

Config-level only: imported by `agentjax.config` and `agentjax.engine_kv`, it imports neither (nor jax).
"""
from __future__ import annotations

from agentjax.errors import InvalidRequestError


def check_kv_cache_dtype(engine_cfg) -> None:
    """Raise if the engine's `kv_cache_dtype` is unknown or asked for on a path that has no FP8 KV."""
    dtype = engine_cfg.kv_cache_dtype
    if dtype not in ("auto", "fp8"):
        raise InvalidRequestError(f"kv_cache_dtype must be 'auto' or 'fp8', got {dtype!r}")
    if dtype != "fp8":
        return
    if engine_cfg.attention_impl == "kernel":
        raise InvalidRequestError(
            "kv_cache_dtype='fp8' runs on the XLA attention path (attention_impl 'auto' or 'reference'); the "
            "Pallas attention kernels (attention_impl='kernel') read no FP8 KV pages yet")
    if engine_cfg.parallel.decode_context_parallel_size > 1:
        raise InvalidRequestError(
            "kv_cache_dtype='fp8' is not available under decode context parallelism "
            f"(decode_context_parallel_size={engine_cfg.parallel.decode_context_parallel_size}): its ranks write "
            "their own K/V rows unquantised (sharding/attention.py)")


def with_kv_cache_dtype(model_cfg, engine_cfg):
    """`model_cfg` storing KV as the engine asks ("auto": as the model config says)."""
    dtype = getattr(engine_cfg, "kv_cache_dtype", "auto")
    if dtype == "auto" or model_cfg.kv_cache_dtype == dtype:
        return model_cfg
    return model_cfg.replace(kv_cache_dtype=dtype)
