"""Save converted model parameters with orbax and restore them, so a second start skips conversion.

A cache entry is a directory holding the orbax checkpoint of the flat parameter arrays and the
model config as JSON. Entries are keyed by the source file's identity (path, size, mtime) and the
parameter format version, so a changed file or converter never serves stale weights.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
from pathlib import Path

import numpy as np

from agentjax.config import ModelConfig, RopeScaling

logger = logging.getLogger(__name__)

# Bump when the meaning of converted parameters changes (names, layouts, norm conventions).
PARAM_FORMAT_VERSION = 1


def cache_key(source: Path) -> str:
    stat = source.stat()
    ident = f"{source.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|v{PARAM_FORMAT_VERSION}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def config_to_json(cfg: ModelConfig) -> str:
    return json.dumps(dataclasses.asdict(cfg))


def config_from_json(text: str) -> ModelConfig:
    fields = json.loads(text)
    if fields.get("rope_scaling"):
        fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
    for name in ("layer_types", "eos_token_ids"):
        fields[name] = tuple(fields[name])
    return ModelConfig(**fields)


def save_params(directory: Path, cfg: ModelConfig, arrays: dict[str, np.ndarray]) -> None:
    """Write `arrays` and `cfg` under `directory` (replaced atomically if it exists)."""
    import orbax.checkpoint as ocp

    directory = Path(directory)
    staging = directory.with_name(directory.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(staging.resolve() / "params", {k: np.asarray(v) for k, v in arrays.items()})
    (staging / "config.json").write_text(config_to_json(cfg))
    shutil.rmtree(directory, ignore_errors=True)
    staging.rename(directory)


def restore_params(directory: Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read back what `save_params` wrote, as host numpy arrays."""
    import orbax.checkpoint as ocp

    directory = Path(directory)
    cfg = config_from_json((directory / "config.json").read_text())
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(directory.resolve() / "params")
    return cfg, {name: np.asarray(value) for name, value in restored.items()}
