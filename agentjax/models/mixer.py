"""The one way a token mixer is handed its batch: `PagedMixer` wraps the layer's KV in a `LayerKV`
(agentjax/kv_buffers.py) and gives the mixer that, from which it reads the batch and each KV role's pages,
table and per-token fields. A mixer never unpacks the KV memory or the slot map itself.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from flax import nnx
from jaxtyping import Array, Float

from agentjax.kv_buffers import LayerKV

if TYPE_CHECKING:
    from agentjax.ragged_batch import RaggedBatch


class PagedMixer(nnx.Module):
    """A token mixer over paged KV, called as `mixer(x, kv, batch, numerics, slots) -> (out, kv)`
    (agentjax/models/decoder_block.py). A subclass sets `kv_kinds` (role -> KV kind) and implements
    `mix(x, paged, numerics) -> out`, storing what its ops wrote into `paged`."""

    kv_kinds: dict[str, int]

    def __call__(self, x: Float[Array, "tokens hidden"], kv: tuple, batch: RaggedBatch, numerics: str,
                 slots: dict[str, Array]) -> tuple[Float[Array, "tokens hidden"], tuple]:
        paged = LayerKV(kv, batch, slots, self.kv_kinds)
        return self.mix(x, paged, numerics), paged.kv

    def mix(self, x: Float[Array, "tokens hidden"], paged: LayerKV, numerics: str) -> Float[Array, "tokens hidden"]:
        raise NotImplementedError
