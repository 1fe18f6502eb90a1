"""How an engine lays out its KV memory: the `KVMemoryLayout` for its settings (agentjax/kv/layout.py).

"auto" takes the byte pool wherever the engine's paths run on it and says why when it does not; the
layout then sizes the KV manager's pool and the runner's device memory, so both read one object. The
engine's `kv_cache_dtype` reaches the model config here (agentjax/kv_cache_dtype.py). Host only: never
imports jax.
"""
from __future__ import annotations

import logging

from agentjax.errors import InvalidRequestError
from agentjax.kv.layout_build import build_layout
from agentjax.kv_cache_dtype import with_kv_cache_dtype

logger = logging.getLogger(__name__)


def pool_unsupported(layout, engine_cfg) -> str | None:
    """Why an engine with these settings cannot run the "pool" `layout` yet (None: it can)."""
    for kind in layout.kinds:
        if kind.cell_shape is None:
            return f"its {kind.role} kind has no device format (kv_format fp8_ds_mla)"
    parallel = engine_cfg.parallel
    if engine_cfg.num_processes > 1 or parallel.data_parallel_size > 1:
        return f"the parallel layout {parallel.name} runs the shared layout (several processes or data ranks)"
    return None


def engine_kv_layout(model_cfg, engine_cfg, draft_cfg=None):
    """The layout of an engine's KV memory: `engine_cfg.kv_layout` ("auto": "pool" unless
    `pool_unsupported` says why not), sized by `num_kv_blocks` or `kv_cache_memory_gb`."""
    model_cfg = with_kv_cache_dtype(model_cfg, engine_cfg)
    block = engine_cfg.parallel.kv_page_tokens(engine_cfg.block_size)
    if engine_cfg.kv_layout != "shared":
        memory = None if engine_cfg.num_kv_blocks else int(engine_cfg.kv_cache_memory_gb * 2**30)
        try:
            pool = build_layout(model_cfg, block, memory_bytes=memory, num_pages=engine_cfg.num_kv_blocks or None,
                                draft_cfg=draft_cfg, checkpoint_interval=engine_cfg.state_checkpoint_tokens,
                                device_part=_device_part(model_cfg, engine_cfg, draft_cfg))
            reason = pool_unsupported(pool, engine_cfg)
        except InvalidRequestError as error:
            if engine_cfg.kv_layout == "pool":
                raise
            pool, reason = None, str(error)
        if reason is None:
            return pool
        if engine_cfg.kv_layout == "pool":
            raise InvalidRequestError(f"kv_layout='pool' is not available for model {model_cfg.name!r}: {reason}")
        logger.info("KV memory: the shared layout (%s)", reason)
    num_pages = engine_cfg.num_kv_blocks or _legacy_pages(model_cfg, draft_cfg, engine_cfg)
    return build_layout(model_cfg, block, num_pages=num_pages, mode="shared", draft_cfg=draft_cfg,
                        checkpoint_interval=engine_cfg.state_checkpoint_tokens)


def _device_part(model_cfg, engine_cfg, draft_cfg) -> tuple | None:
    """`(local model config, dcp)` of one device of the engine's parallel layout (None: one device, or a
    layout that runs the shared layout anyway). Memory sizes then count one device's bytes."""
    parallel = engine_cfg.parallel
    if (parallel.is_single_device or draft_cfg is not None or engine_cfg.num_processes > 1
            or parallel.data_parallel_size > 1):
        return None
    from sharding.layouts import local_model_config

    return local_model_config(model_cfg, parallel), parallel.decode_context_parallel_size


def _legacy_pages(model_cfg, draft_cfg, engine_cfg) -> int:
    """Page ids of the shared layout from `kv_cache_memory_gb`: every kind's page behind each id."""
    page_bytes = sum(cfg.kv_bytes_per_page(engine_cfg.block_size) for cfg in (model_cfg, draft_cfg) if cfg)
    return max(16, int(engine_cfg.kv_cache_memory_gb * 2**30) // page_bytes)
