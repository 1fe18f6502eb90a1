"""Model parameters as an `nnx.State`, filled from flat `{"layers.0.attn.q_proj.kernel": array}` dicts.

Checkpoint readers produce flat numpy dicts under these names; `params_from_arrays` checks every
name and shape against the abstract model and builds the state that the jitted steps take.
"""
from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from agentjax.config import ModelConfig
from agentjax.errors import ModelLoadError
from agentjax.models.decoder import Decoder


def abstract_model(cfg: ModelConfig) -> Decoder:
    """The model's structure with shape-only parameters (no memory, no compute)."""
    return nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))


def split_model(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    return nnx.split(abstract_model(cfg))


def _name(path: tuple) -> str:
    return ".".join(str(part) for part in path)


def params_from_arrays(cfg: ModelConfig, arrays: Mapping[str, np.ndarray]) -> nnx.State:
    """Build the parameter state; every parameter must be present with the right shape."""
    _, abstract = split_model(cfg)
    flat = []
    missing = []
    for path, variable in nnx.to_flat_state(abstract):
        name = _name(path)
        if name not in arrays:
            missing.append(name)
            continue
        array = arrays[name]
        if tuple(array.shape) != tuple(variable.get_value().shape):
            raise ModelLoadError(
                f"parameter {name} has shape {tuple(array.shape)}, the model expects {tuple(variable.get_value().shape)}"
            )
        flat.append((path, variable.replace(value=jnp.asarray(array, dtype=cfg.dtype))))
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} parameters, e.g. {missing[:3]}")
    extra = set(arrays) - {_name(path) for path, _ in nnx.to_flat_state(abstract)}
    if extra:
        raise ModelLoadError(f"checkpoint has {len(extra)} unexpected tensors, e.g. {sorted(extra)[:3]}")
    return nnx.from_flat_state(flat)


def arrays_from_params(params: nnx.State) -> dict[str, np.ndarray]:
    """The inverse of `params_from_arrays`: flat names to host numpy arrays."""
    return {_name(path): np.asarray(jax.device_get(var.get_value())) for path, var in nnx.to_flat_state(params)}


def random_params(cfg: ModelConfig, seed: int = 0) -> nnx.State:
    """Freshly initialised parameters (for presets and tests)."""
    return nnx.state(Decoder(cfg, rngs=nnx.Rngs(seed)))
