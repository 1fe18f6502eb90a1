"""Weights kept on the device as their checkpoint stores them, decoded inside the step (`StoredWeight`).

A published checkpoint's matrices are FP8 with block scales, MXFP8, MXFP4 or NVFP4 (checkpoints/
quant_config.py), and its other tensors often bfloat16. A `StoredWeight` holds those bytes (values,
scales, global scale: checkpoints/quant_codecs.py) and `weight[...]` decodes them in the step to the
model's dtype, so the device holds about the checkpoint's bytes while the matmuls see the float32
weights the host decoding gives, bit for bit (checkpoints/quant_codecs.py explains the rounding).
Like GGUF's `BlockWeight` it is a pytree of its parts, whose `__array__` decodes on the host;
`take_rows` gathers embedding rows before decoding them, and `grouped_operand` hands FP8 experts to the
MoE kernel undecoded.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from agentjax import kernels
from agentjax.models.block_weights import EncodedWeight
from checkpoints import quant_codecs
from checkpoints.quant_codecs import Codec


@jax.tree_util.register_pytree_node_class
class StoredWeight(EncodedWeight):
    """`values` (+ `scales`, + `global_scale` of shape `leading + (1, 1)`) in `codec`, read as `dtype`."""

    def __init__(self, values, scales=None, global_scale=None, *, codec: Codec, dtype: str = "float32"):
        self.values, self.scales, self.global_scale = values, scales, global_scale
        self.codec, self.compute_dtype = codec, dtype

    def tree_flatten(self):
        return (self.values, self.scales, self.global_scale), (self.codec, self.compute_dtype)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, codec=aux[0], dtype=aux[1])

    @property
    def parts(self) -> tuple:
        return self.values, self.scales, self.global_scale

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.values.shape)
        if self.codec.packed:
            shape[self.codec.packed_axis] *= 2
        return tuple(shape)

    @property
    def ndim(self) -> int:
        return len(self.values.shape)

    @property
    def dtype(self):
        return np.dtype(self.compute_dtype)

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(p.shape)) * np.dtype(p.dtype).itemsize for p in self.parts if p is not None)

    def dequantize(self, xp=jnp):
        out = quant_codecs.dequantize(self.values, self.scales, self.global_scale, self.codec, xp)
        return out.astype(self.compute_dtype)

    def take_rows(self, ids):
        """Rows `ids` of a table (axis -2) decoded; only the rows' bytes are gathered when blocks are one row."""
        codec = self.codec
        if codec.block[0] != 1 or (codec.packed and codec.packed_axis == -2) or self.ndim != 2:
            return jnp.take(self.dequantize(), ids, axis=0)
        scales = None if self.scales is None else jnp.take(self.scales, ids, axis=0)
        rows = StoredWeight(jnp.take(self.values, ids, axis=0), scales, self.global_scale, codec=codec,
                            dtype=self.compute_dtype)
        return rows.dequantize()


def take_experts(weight, ids):
    """`weight[...][ids]` for a stack of expert matrices `[E, ...]`: a stored weight gathers its parts'
    rows of those experts first and decodes only them (the same values)."""
    if not isinstance(weight, StoredWeight):
        return weight[ids]
    parts = [None if p is None else p[ids] for p in weight.parts]
    return StoredWeight(*parts, codec=weight.codec, dtype=weight.compute_dtype).dequantize()


def grouped_operand(weight):
    """The MoE kernel's operand for routed experts `[E, K, N]`: FP8 with block scales stays FP8
    (`kernels.Fp8Experts`); other formats are decoded here."""
    if not isinstance(weight, StoredWeight):
        return weight
    codec = weight.codec
    k, n = weight.values.shape[-2:]
    if (codec.values == "e4m3" and weight.ndim == 3 and codec.global_scale is False
            and k % codec.block[0] == 0 and n % codec.block[1] == 0):
        return kernels.Fp8Experts(values=weight.values, scales=weight.scales.astype(jnp.float32))
    return weight[...]


def stored_bytes(tree) -> int:
    """Bytes of every array in a parameter tree as it is held (StoredWeights by their parts)."""
    leaves = jax.tree.leaves(tree)
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in leaves)
