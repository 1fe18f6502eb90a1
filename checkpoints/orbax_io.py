"""Save converted model parameters with orbax and restore them, so a second start skips conversion.

A cache entry is a directory holding the orbax checkpoint of the flat parameter arrays, the
model config as JSON, and checksums.json: every array's CRC-32, recorded at conversion and
verified on restore, so a torn or bit-flipped entry fails with `CorruptCheckpointError` instead
of serving wrong weights. The size of every file orbax wrote is recorded too and checked before
orbax reads any: a truncated or missing file fails with one clear error, not hundreds of read
errors from orbax's reader threads. Entries are keyed by the source file's identity (path, size, mtime)
and the parameter format version, so a changed file or converter never serves stale weights.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from agentjax.config import ModelConfig
from agentjax.errors import CorruptCheckpointError
from checkpoints.integrity import manifest, verify_arrays, verify_config

logger = logging.getLogger(__name__)

# Bump when the meaning of converted parameters changes (names, layouts, norm conventions).
PARAM_FORMAT_VERSION = 1


def cache_key(source: Path) -> str:
    stat = source.stat()
    ident = f"{source.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|v{PARAM_FORMAT_VERSION}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def config_to_json(cfg: ModelConfig) -> str:
    return json.dumps(cfg.to_dict())


def config_from_json(text: str) -> ModelConfig:
    return ModelConfig.from_dict(json.loads(text))


CHECKSUMS_FILE = "checksums.json"


def save_params(directory: Path, cfg: ModelConfig, arrays: dict[str, np.ndarray]) -> None:
    """Write `arrays`, `cfg` and their checksums under `directory` (replaced atomically if it exists)."""
    import orbax.checkpoint as ocp

    directory = Path(directory)
    staging = directory.with_name(f"{directory.name}.staging-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    host_arrays = {k: np.asarray(v) for k, v in arrays.items()}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(staging.resolve() / "params", host_arrays)
    config_text = config_to_json(cfg)
    (staging / "config.json").write_text(config_text)
    recorded = {**manifest(host_arrays, config_text), "files": _file_sizes(staging)}
    (staging / CHECKSUMS_FILE).write_text(json.dumps(recorded))
    shutil.rmtree(directory, ignore_errors=True)
    staging.rename(directory)


def _drop_orphaned_read_errors() -> None:
    """After a failed restore, orbax's reader threads still finish the reads it had started; their
    event loop is closed by then, and each would print an "Event loop is closed" traceback through
    `sys.unraisablehook` (hundreds, burying the one warning that matters). Those, and only those,
    are dropped from now on."""
    previous = sys.unraisablehook
    if getattr(previous, "drops_orphaned_reads", False):
        return

    def hook(unraisable) -> None:
        error = unraisable.exc_value
        if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
            return
        previous(unraisable)

    hook.drops_orphaned_reads = True
    sys.unraisablehook = hook


def _file_sizes(entry: Path) -> dict[str, int]:
    """Size of every file under the entry's `params` directory, by path relative to the entry."""
    return {str(path.relative_to(entry)): path.stat().st_size
            for path in sorted((entry / "params").rglob("*")) if path.is_file()}


def _check_file_sizes(recorded: dict[str, int] | None, directory: Path, where: str) -> None:
    """`CorruptCheckpointError` naming the files that are gone or not their recorded size (an entry
    written before sizes were recorded passes: its checksums still catch a torn file)."""
    if recorded is None:
        return
    failures = []
    for name, size in recorded.items():
        path = directory / name
        actual = path.stat().st_size if path.is_file() else None
        if actual is None:
            failures.append(f"{name} is missing")
        elif actual != size:
            failures.append(f"{name} has {actual} bytes, recorded {size}")
    if failures:
        more = f" (and {len(failures) - 3} more)" if len(failures) > 3 else ""
        raise CorruptCheckpointError(f"{where}: {len(failures)} files are truncated or missing: "
                                     f"{'; '.join(failures[:3])}{more}")


def restore_params(directory: Path, verify: bool = True) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read back what `save_params` wrote, as host numpy arrays; with `verify`, every array is
    checked against the checksums recorded at save time (`CorruptCheckpointError` names the ones
    that fail, or says that the entry has no checksums)."""
    import orbax.checkpoint as ocp

    directory = Path(directory)
    where = f"cache entry {directory.name}"
    config_text = (directory / "config.json").read_text()
    recorded = None
    if verify:
        checksums_path = directory / CHECKSUMS_FILE
        if not checksums_path.is_file():
            raise CorruptCheckpointError(f"{where} has no {CHECKSUMS_FILE} (written before checksums were recorded)")
        try:
            recorded = json.loads(checksums_path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptCheckpointError(f"{where}: {CHECKSUMS_FILE} is not valid JSON ({exc})") from None
        verify_config(recorded, config_text, where)
        _check_file_sizes(recorded.get("files"), directory, where)
    cfg = config_from_json(config_text)
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            restored = checkpointer.restore(directory.resolve() / "params")
    except Exception:
        _drop_orphaned_read_errors()
        raise
    arrays = {name: np.asarray(value) for name, value in restored.items()}
    if recorded is not None:
        started = time.perf_counter()
        verify_arrays(recorded, arrays, where)
        logger.info("verified %d arrays of %s in %.2fs", len(arrays), directory.name, time.perf_counter() - started)
    return cfg, arrays
