"""Model parameters as an `nnx.State`, filled from flat `{"layers.0.attn.q_proj.kernel": array}` dicts.

Checkpoint readers produce flat numpy dicts with one name per layer; `params_from_arrays` checks
every name and shape against the abstract model and stacks the layers into the `[num_layers, ...]`
parameters of the model's `LayerStack` (`layers.block.*`); `arrays_from_params` splits them back.
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


_STACK_PREFIX = "layers.block."


def _per_layer_names(name: str, num_layers: int) -> list[str]:
    """Checkpoint names behind one model parameter: `layers.block.X` is `layers.{i}.X` for each layer."""
    if name.startswith(_STACK_PREFIX):
        return [f"layers.{i}.{name[len(_STACK_PREFIX):]}" for i in range(num_layers)]
    return [name]


def params_from_arrays(cfg: ModelConfig, arrays: Mapping[str, np.ndarray]) -> nnx.State:
    """Build the parameter state; every parameter must be present with the right shape."""
    _, abstract = split_model(cfg)
    flat = []
    missing = []
    expected_names = set()
    for path, variable in nnx.to_flat_state(abstract):
        name = _name(path)
        names = _per_layer_names(name, cfg.num_layers)
        expected_names.update(names)
        shape = tuple(variable.get_value().shape)
        each_shape = shape[1:] if name.startswith(_STACK_PREFIX) else shape
        absent = [n for n in names if n not in arrays]
        if absent:
            missing.extend(absent)
            continue
        for n in names:
            if tuple(arrays[n].shape) != each_shape:
                raise ModelLoadError(f"parameter {n} has shape {tuple(arrays[n].shape)}, the model expects {each_shape}")
        parts = [jnp.asarray(arrays[n], dtype=cfg.dtype) for n in names]
        value = jnp.stack(parts) if name.startswith(_STACK_PREFIX) else parts[0]
        flat.append((path, variable.replace(value=value)))
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} parameters, e.g. {missing[:3]}")
    extra = set(arrays) - expected_names
    if extra:
        raise ModelLoadError(f"checkpoint has {len(extra)} unexpected tensors, e.g. {sorted(extra)[:3]}")
    return nnx.from_flat_state(flat)


def arrays_from_params(params: nnx.State) -> dict[str, np.ndarray]:
    """The inverse of `params_from_arrays`: flat per-layer names to host numpy arrays."""
    arrays = {}
    for path, var in nnx.to_flat_state(params):
        name, value = _name(path), np.asarray(jax.device_get(var.get_value()))
        if name.startswith(_STACK_PREFIX):
            for i, part in enumerate(value):
                arrays[f"layers.{i}.{name[len(_STACK_PREFIX):]}"] = part
        else:
            arrays[name] = value
    return arrays


def random_params(cfg: ModelConfig, seed: int = 0) -> nnx.State:
    """Freshly initialised parameters (for presets and tests)."""
    return nnx.state(Decoder(cfg, rngs=nnx.Rngs(seed)))
