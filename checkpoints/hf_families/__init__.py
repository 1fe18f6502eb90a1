"""The model families an HF directory can hold, found by config.json's `model_type` (or `architectures`).

Each module in this package (not starting with "_") defines `FAMILY` (or `FAMILIES`, a tuple), an
`HFFamily` that turns config.json into a `ModelConfig` and the directory's tensors into agentjax's
flat parameter arrays. Adding a family is adding a module; nothing else changes. Host only: the
families read and convert on the host and never import jax.
"""
from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from agentjax.config import ModelConfig
from agentjax.errors import UnsupportedModelError
from checkpoints.hf_config import ConfigFields
from checkpoints.hf_tensors import HFTensors


@dataclass(frozen=True)
class HFFamily:
    """How one family's HF checkpoints become agentjax's config and parameters.

    `model_config(fields)` reads config.json (through `ConfigFields`, so bad fields are named) and
    returns the `ModelConfig` (its `name` is set by the loader). `convert_tensors(cfg, tensors)`
    returns `{agentjax checkpoint name: float32 array}`: it `take`s every tensor it uses and
    `ignore`s those it knowingly drops; `tensors.expected` holds the model's parameter shapes when
    the loader knows them.
    """

    name: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    model_config: Callable[[ConfigFields], ModelConfig]
    convert_tensors: Callable[[ModelConfig, HFTensors], dict[str, np.ndarray]]


@functools.cache
def registered_families() -> tuple[HFFamily, ...]:
    """Every family module's `FAMILY` / `FAMILIES`, in module name order."""
    families: list[HFFamily] = []
    for module_info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if module_info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        found = getattr(module, "FAMILIES", None) or (getattr(module, "FAMILY", None),)
        families.extend(f for f in found if isinstance(f, HFFamily))
    return tuple(families)


def family_for(raw: Mapping[str, Any], source: str = "config.json") -> HFFamily:
    """The family of a parsed config.json: by `model_type`, else by `architectures`; a named
    model_type must also list an architecture of its family when it lists any."""
    families = registered_families()
    model_type = raw.get("model_type")
    archs = raw.get("architectures") or []
    if not isinstance(archs, list):
        archs = [archs]
    if model_type is not None:
        family = next((f for f in families if model_type in f.model_types), None)
        if family is None:
            supported = sorted(t for f in families for t in f.model_types)
            raise UnsupportedModelError(
                f"{source}: unsupported model_type {model_type!r}; supported: {', '.join(supported)}"
            )
        if archs and not any(a in family.architectures for a in archs):
            raise UnsupportedModelError(
                f"{source}: model_type {model_type!r} with architectures {archs} is not supported; "
                f"supported architectures for it: {', '.join(family.architectures)}"
            )
        return family
    family = next((f for f in families for a in archs if a in f.architectures), None)
    if family is None:
        supported = sorted(a for f in families for a in f.architectures)
        raise UnsupportedModelError(
            f"{source}: unsupported architectures {archs} (and no model_type); supported: {', '.join(supported)}"
        )
    return family
