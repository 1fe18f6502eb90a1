"""Model parameters as an `nnx.State`, filled from flat `{"layers.0.attn.q_proj.kernel": array}` dicts.

Checkpoint readers produce flat numpy dicts with one name per layer; `params_from_arrays` checks
every name and shape against the abstract model first (nothing reaches the device before all of
them pass), then stacks the layers into the `[repeats, ...]` parameters of the model's segments
(`segments.{k}.blocks.{j}.*`, see layer_plan.py; a BlockWeight part by part); `arrays_from_params`
splits them back (as float32).
"""
from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from agentjax.config import ModelConfig
from agentjax.models.block_weights import BlockWeight
from agentjax.models.decoder import Decoder
from agentjax.models.layer_plan import per_layer_names


def abstract_model(cfg: ModelConfig) -> Decoder:
    """The model's structure with shape-only parameters (no memory, no compute)."""
    return nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))


def split_model(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    return nnx.split(abstract_model(cfg))


def _name(path: tuple) -> str:
    return ".".join(str(part) for part in path)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint name the model needs, with the shape of its array (one entry per layer)."""
    _, abstract = split_model(cfg)
    shapes = {}
    for path, variable in nnx.to_flat_state(abstract):
        name = _name(path)
        names = per_layer_names(cfg, name)
        shape = tuple(variable.get_value().shape)
        for n in names:
            shapes[n] = shape[1:] if len(names) > 1 or name != n else shape
    return shapes


def check_arrays(cfg: ModelConfig, arrays: Mapping[str, np.ndarray]) -> None:
    """Raise `TensorMismatchError` naming every missing, unexpected or wrongly shaped tensor."""
    from checkpoints.validate import check_tensors

    check_tensors(expected_shapes(cfg), arrays)


def params_from_arrays(cfg: ModelConfig, arrays: Mapping[str, np.ndarray]) -> nnx.State:
    """Build the parameter state; every parameter must be present with the right shape (checked
    for all of them before any array is placed on the device)."""
    check_arrays(cfg, arrays)
    _, abstract = split_model(cfg)
    flat = []
    for path, variable in nnx.to_flat_state(abstract):
        name = _name(path)
        names = per_layer_names(cfg, name)
        # Integer parameters (a hash-routing table) keep their integer type; weights take the model's.
        dtype = variable.get_value().dtype if jnp.issubdtype(variable.get_value().dtype, jnp.integer) else cfg.dtype
        flat.append((path, variable.replace(value=_device_value([arrays[n] for n in names], dtype, names != [name]))))
    return nnx.from_flat_state(flat)


def _device_value(values: list, dtype, stacked: bool):
    """One parameter on the device: an array, or the layers' arrays stacked. BlockWeights stay blocks when
    the model is float32 and every layer's is of one format; else they are dequantised here."""
    first = values[0]
    if isinstance(first, BlockWeight) and jnp.dtype(dtype) == jnp.float32 and all(first.same_format(v) for v in values):
        return BlockWeight.stack(values) if stacked else first.to_device()
    if stacked:
        return jnp.stack([jnp.asarray(np.asarray(v), dtype=dtype) for v in values])
    return jnp.asarray(np.asarray(first), dtype=dtype)


def arrays_from_params(cfg: ModelConfig, params: nnx.State) -> dict[str, np.ndarray]:
    """The inverse of `params_from_arrays`: flat per-layer names to host numpy arrays."""
    arrays = {}
    for path, var in nnx.to_flat_state(params):
        name, value = _name(path), np.asarray(jax.device_get(var.get_value()))
        names = per_layer_names(cfg, name)
        if names == [name]:
            arrays[name] = value
        else:
            for n, part in zip(names, value):
                arrays[n] = part
    return arrays


def random_params(cfg: ModelConfig, seed: int = 0) -> nnx.State:
    """Freshly initialised parameters (for presets and tests)."""
    return nnx.state(Decoder(cfg, rngs=nnx.Rngs(seed)))
