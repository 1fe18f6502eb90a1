"""Before a checkpoint is read: do its weights and the KV pages fit the layout on the devices present?

`check_memory` sums, per local device, the bytes its shards of the parameters take (as stored:
quantised parts, bfloat16 floats) and the KV pages the engine will size, and compares them with what
the device has (its allocator's `bytes_limit`; on a CPU, the host's available memory shared by the
process's devices). It prints one line either way and raises `InsufficientMemoryError` with the
numbers when they do not fit. `kv_bytes_per_device` reads the KV memory layout the engine builds
(agentjax/engine_kv.py), so it follows the pool's accounting.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence

from agentjax.errors import InsufficientMemoryError

GB = 1e9


def device_capacity(device, local_devices: int) -> tuple[int, str]:
    """`(bytes, where)`: the device allocator's limit, or the host's available memory over its devices."""
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # some backends do not report memory  # noqa: BLE001
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), "device memory"
    available = _meminfo("MemAvailable")
    return available // max(1, local_devices), f"host memory available / {local_devices} local devices"


def _meminfo(field: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/meminfo has no {field}")


def kv_bytes_per_device(model_cfg, engine_cfg) -> int:
    """The KV memory one device holds: the engine's own layout (`engine_kv_layout`) whole on one device, a
    device's part of it under a parallel layout (a "pool" layout's local slabs, else the shared layout's
    pages of the device's buffers)."""
    from agentjax.engine_kv import engine_kv_layout

    layout = engine_kv_layout(model_cfg, engine_cfg)
    parallel = engine_cfg.parallel
    if parallel.is_single_device:
        return layout.total_bytes
    from sharding.layouts import local_model_config

    if layout.mode == "pool":
        from agentjax.kv.layout_build import local_layout

        local_cfg = local_model_config(model_cfg, parallel)
        return local_layout(layout, local_cfg, parallel.decode_context_parallel_size).total_bytes
    from sharding.layouts import local_kv_buffer_specs

    page_tokens = parallel.kv_page_tokens(engine_cfg.block_size)
    return layout.num_slabs * sum(spec.bytes_per_page for spec in local_kv_buffer_specs(model_cfg, parallel, page_tokens))


def check_memory(weight_bytes: dict, kv_bytes: int, layout: str, devices: Sequence, *, quiet: bool = False) -> None:
    """`weight_bytes[device]`: the bytes of weights a device will hold. Raise unless weights + KV fit each."""
    lines, short = [], []
    for device in devices:
        capacity, where = device_capacity(device, len(devices))
        need = weight_bytes.get(device, 0) + kv_bytes
        if need > capacity:
            short.append(f"{device}: needs {weight_bytes.get(device, 0) / GB:.2f} GB for weights on {layout} "
                         f"+ {kv_bytes / GB:.2f} GB KV; it has {capacity / GB:.2f} GB ({where})")
    worst = max(devices, key=lambda d: weight_bytes.get(d, 0))
    capacity, where = device_capacity(worst, len(devices))
    lines.append(f"[agentjax] memory check: {weight_bytes.get(worst, 0) / GB:.2f} GB of weights per device on {layout} "
                 f"(largest of {len(devices)} local devices) + {kv_bytes / GB:.2f} GB KV; each device has "
                 f"{capacity / GB:.2f} GB ({where}): {'does not fit' if short else 'fits'}")
    if not quiet:
        print(lines[0], file=sys.stderr, flush=True)
    if short:
        raise InsufficientMemoryError("the weights and KV pages do not fit the devices: " + "; ".join(short[:4])
                                      + (f"; and {len(short) - 4} more devices" if len(short) > 4 else ""))
