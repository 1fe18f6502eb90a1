"""Gated activations of feed-forward blocks: `act(gate, up)` for dense MLPs and MoE experts alike.

One `GatedActivation` names the kind and its constants; calling it on the gate and up projections
gives the value the down projection reads. Pure elementwise jnp, computed in float32 and cast back to
the input dtype: no matmuls, no parameters, no model or runner imports.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from agentjax.layer_configs import check_gated_activation



@dataclass(frozen=True)
class GatedActivation:
    """A gated activation and its constants (only the kind's own constants are read).

    - "silu": `silu(gate) * up`.
    - "gelu_tanh": `gelu_tanh(gate) * up`.
    - "swigluoai": `gate' = min(gate, limit)`, `up' = clip(up, -limit, limit)`,
      `(up' + 1) * gate' * sigmoid(alpha * gate')` (transformers' MiniMaxM3VL `_apply_gate`).
    - "situ": `beta * tanh(gate / beta) * sigmoid(gate) * up'`, where `up' = linear_beta *
      tanh(up / linear_beta)`, or `up` itself when `situ_linear_beta` is None (Kimi-K3's SiTU-GLU).
    - "clamped_swiglu": `silu(min(gate, limit)) * clip(up, -limit, limit)` (transformers' DeepseekV4
      experts and shared expert, `limit` = swiglu_limit).
    """

    kind: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    situ_beta: float = 4.0
    situ_linear_beta: float | None = 25.0

    def __post_init__(self) -> None:
        check_gated_activation(self.kind, self.swiglu_limit, self.situ_beta, self.situ_linear_beta)

    def __call__(self, gate: Float[Array, "*rows n"], up: Float[Array, "*rows n"]) -> Float[Array, "*rows n"]:
        dtype = gate.dtype
        gate = gate.astype(jnp.float32)
        up = up.astype(jnp.float32)
        if self.kind == "silu":
            out = jax.nn.silu(gate) * up
        elif self.kind == "gelu_tanh":
            out = jax.nn.gelu(gate, approximate=True) * up
        elif self.kind == "clamped_swiglu":
            out = jax.nn.silu(jnp.minimum(gate, self.swiglu_limit)) * jnp.clip(up, -self.swiglu_limit,
                                                                               self.swiglu_limit)
        elif self.kind == "swigluoai":
            gate = jnp.minimum(gate, self.swiglu_limit)
            up = jnp.clip(up, -self.swiglu_limit, self.swiglu_limit)
            out = (up + 1.0) * (gate * jax.nn.sigmoid(gate * self.swiglu_alpha))
        else:  # situ
            gated = self.situ_beta * jnp.tanh(gate / self.situ_beta) * jax.nn.sigmoid(gate)
            if self.situ_linear_beta is not None:
                up = self.situ_linear_beta * jnp.tanh(up / self.situ_linear_beta)
            out = gated * up
        return out.astype(dtype)

    def on_fused(self, gate_up: Float[Array, "*rows two_n"]) -> Float[Array, "*rows n"]:
        """The activation of a fused `[gate | up]` projection (gate in the first half)."""
        gate, up = jnp.split(gate_up, 2, axis=-1)
        return self(gate, up)
