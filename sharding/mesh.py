"""Mesh axes named by role, the parallel settings, and the start-up check that a layout fits a model.

`ROLES` is the one table of axis roles (data, attn_dp, expert, tensor, kv_heads, dcp, pcp): each role
names the mesh axes it spans. Layers and layouts ask for roles, never for raw axis strings.
`ParallelConfig` holds vLLM's settings (tensor_parallel_size, data_parallel_size,
enable_expert_parallel, decode_context_parallel_size, prefill_context_parallel_size);
`check_layout` rejects a combination that does not fit the model or the devices before anything is
built. Host only at import time: jax is imported inside `build_mesh`.
"""
from __future__ import annotations

from dataclasses import dataclass

from agentjax.errors import ParallelLayoutError

# The physical mesh axes, outermost first. The TP group is tensor x dcp (DCP runs inside TP, as in
# vLLM), so `tensor` has size tensor_parallel_size / decode_context_parallel_size.
MESH_AXES = ("data", "pcp", "tensor", "dcp")

# Role -> the mesh axes it spans. An axis of size 1 in a layout is harmless in every role.
ROLES: dict[str, tuple[str, ...]] = {
    # ranks that run their own requests (DP); with the experts sharded over them too this is DEP
    "data": ("data",),
    # DEP's attention data parallelism: the data ranks, each attending its own requests
    "attn_dp": ("data",),
    # routed experts under enable_expert_parallel: every rank of data x TP holds its share (vLLM's EP = DP x TP)
    "expert": ("data", "tensor", "dcp"),
    # the TP group: query heads, MLP and expert columns, the rows a row-parallel projection reduces over
    "tensor": ("tensor", "dcp"),
    # KV heads, indexer heads and recurrent-state heads: the TP group without DCP (replicated over DCP)
    "kv_heads": ("tensor",),
    # decode context parallelism: KV interleaved over these ranks token by token
    "dcp": ("dcp",),
    # prefill context parallelism: a step's tokens split DualChunkSwap-style over these ranks
    "pcp": ("pcp",),
    # every device (per-device buffers such as the KV pages)
    "device": MESH_AXES,
}

# Layer types each context-parallel layout can run. DCP splits a layer's KV by token, so the layer's
# attention must be a softmax over its own cached rows (GQA, MLA) or keep no per-token KV (KDA's state,
# replicated over DCP ranks); PCP splits a step's tokens, so no layer may carry a recurrence across them.
DCP_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "mla", "kda"})
PCP_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "block_sparse_attention", "mla"})
# Layer types with tensor-parallel rules (sharding/layouts.py).
TP_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "block_sparse_attention", "mla", "kda",
                            "swa_mqa", "csa", "hca"})


@dataclass(frozen=True)
class ParallelConfig:
    """vLLM's parallel settings. DCP runs inside the TP group (it divides tensor_parallel_size)."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size", "decode_context_parallel_size",
                     "prefill_context_parallel_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ParallelLayoutError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.tensor_parallel_size % self.decode_context_parallel_size:
            raise ParallelLayoutError(
                f"decode_context_parallel_size={self.decode_context_parallel_size} must divide "
                f"tensor_parallel_size={self.tensor_parallel_size} (DCP runs inside the TP group)")

    @classmethod
    def from_settings(cls, settings) -> "ParallelConfig":
        """From an `EngineConfig` (or anything with the same field names)."""
        return cls(**{name: getattr(settings, name) for name in cls.__dataclass_fields__})

    @property
    def axis_sizes(self) -> dict[str, int]:
        dcp = self.decode_context_parallel_size
        return {"data": self.data_parallel_size, "pcp": self.prefill_context_parallel_size,
                "tensor": self.tensor_parallel_size // dcp, "dcp": dcp}

    @property
    def num_devices(self) -> int:
        return self.data_parallel_size * self.prefill_context_parallel_size * self.tensor_parallel_size

    @property
    def is_single_device(self) -> bool:
        return self.num_devices == 1

    def role_size(self, role: str) -> int:
        """How many ranks a role spans in this layout (1: the role is not split)."""
        size = 1
        for axis in axes(role):
            size *= self.axis_sizes[axis]
        return size

    @property
    def name(self) -> str:
        """A short name of the layout, e.g. "tp4", "dep8", "tp4-dcp2", "pcp2-tp2", "single"."""
        parts = []
        if self.data_parallel_size > 1:
            parts.append(f"{'dep' if self.enable_expert_parallel else 'dp'}{self.data_parallel_size}")
        if self.prefill_context_parallel_size > 1:
            parts.append(f"pcp{self.prefill_context_parallel_size}")
        if self.tensor_parallel_size > 1:
            parts.append(f"tp{self.tensor_parallel_size}")
        if self.decode_context_parallel_size > 1:
            parts.append(f"dcp{self.decode_context_parallel_size}")
        return "-".join(parts) or "single"

    def kv_page_tokens(self, block_size: int) -> int:
        """Tokens of one KV page as the KV manager and the scheduler count them: with DCP a page id
        holds `block_size` tokens on each of the DCP ranks, interleaved token by token."""
        return block_size * self.decode_context_parallel_size


def axes(role: str) -> tuple[str, ...]:
    """The mesh axes of a role (see `ROLES`)."""
    if role not in ROLES:
        raise ParallelLayoutError(f"unknown mesh role {role!r}; known: {', '.join(ROLES)}")
    return ROLES[role]


def _split_heads(what: str, count: int, ranks: int, *, may_replicate: bool) -> None:
    """`count` heads over `ranks`: an even split, or (for KV-like heads) whole heads repeated."""
    if count % ranks == 0 or (may_replicate and ranks % count == 0):
        return
    allowed = "a divisor or a multiple" if may_replicate else "a divisor"
    raise ParallelLayoutError(f"{what}={count} cannot be split over {ranks} ranks: the rank count must be "
                              f"{allowed} of it")


def check_layout(cfg, parallel: ParallelConfig, *, available_devices: int, block_size: int = 16) -> None:
    """Raise `ParallelLayoutError` naming the first setting that does not fit `cfg` (a ModelConfig)
    or the devices; a single-device layout always fits."""
    if parallel.num_devices > available_devices:
        raise ParallelLayoutError(
            f"layout {parallel.name} needs data_parallel_size x prefill_context_parallel_size x "
            f"tensor_parallel_size = {parallel.num_devices} devices; {available_devices} exist")
    if parallel.is_single_device:
        return
    layer_types = set(cfg.layer_types)
    dcp, pcp = parallel.decode_context_parallel_size, parallel.prefill_context_parallel_size
    if dcp > 1 and pcp > 1:
        raise ParallelLayoutError("decode_context_parallel_size and prefill_context_parallel_size cannot both be "
                                  f"> 1 yet; got {dcp} and {pcp}")
    if (dcp > 1 or pcp > 1) and cfg.attention_impl == "kernel":  # "auto" resolves to the reference there
        raise ParallelLayoutError(f"context parallelism runs the reference attention only; attention_impl="
                                  f"{cfg.attention_impl!r} (its kernels read rows from cu_q_lens/kv_lens, which a "
                                  "rank's token or KV shard does not follow)")
    if dcp > 1:
        _check_context_parallel(cfg, "decode", layer_types, DCP_LAYER_TYPES)
        if cfg.sliding_window and "sliding_attention" in layer_types and cfg.sliding_window % dcp:
            raise ParallelLayoutError(f"decode_context_parallel_size={dcp} must divide sliding_window="
                                      f"{cfg.sliding_window} (each DCP rank keeps window / dcp of its tokens)")
        required = getattr(cfg.block_sparse, "required_page_tokens", None)
        if required and parallel.kv_page_tokens(block_size) != required:
            raise ParallelLayoutError(f"the model needs {required}-token pages; block_size={block_size} x "
                                      f"decode_context_parallel_size={dcp} gives {parallel.kv_page_tokens(block_size)}")
    if pcp > 1:
        _check_context_parallel(cfg, "prefill", layer_types, PCP_LAYER_TYPES)
    tp = parallel.tensor_parallel_size
    if tp > 1:
        _check_tensor_parallel(cfg, parallel, layer_types)
    _check_experts(cfg, parallel)


def _check_context_parallel(cfg, kind: str, layer_types: set, allowed: frozenset) -> None:
    bad = sorted(layer_types - allowed)
    if not bad:
        return
    if cfg.architecture == "deepseek_v4":
        raise ParallelLayoutError(
            f"{kind} context parallelism does not apply to DeepSeek-V4's compressed sparse attention stack "
            f"(layer types {', '.join(bad)}); use data_parallel_size with enable_expert_parallel (DEP) or "
            f"tensor_parallel_size")
    raise ParallelLayoutError(f"{kind}_context_parallel_size > 1 cannot run layer types {', '.join(bad)} of "
                              f"{cfg.name}; it runs {', '.join(sorted(allowed))}")


def _check_tensor_parallel(cfg, parallel: ParallelConfig, layer_types: set) -> None:
    tp, kv_ranks = parallel.role_size("tensor"), parallel.role_size("kv_heads")
    bad = sorted(layer_types - TP_LAYER_TYPES)
    if bad:
        raise ParallelLayoutError(f"tensor_parallel_size > 1 has no rules yet for layer types {', '.join(bad)} of "
                                  f"{cfg.name}; use data_parallel_size (DP/DEP) for it")
    attention = layer_types & {"full_attention", "sliding_attention", "block_sparse_attention", "mla", "swa_mqa",
                               "csa", "hca"}
    if attention:
        _split_heads("num_heads", cfg.num_heads, tp, may_replicate=False)
    if attention & {"swa_mqa", "csa", "hca"}:
        _split_heads("compressed_attention o_groups", cfg.compressed_attention.o_groups, tp, may_replicate=False)
    if attention - {"mla", "swa_mqa", "csa", "hca"}:
        _split_heads("num_kv_heads", cfg.num_kv_heads, kv_ranks, may_replicate=True)
    if "block_sparse_attention" in layer_types:
        _split_heads("block_sparse index_num_heads", cfg.block_sparse.index_num_heads, kv_ranks, may_replicate=True)
        if cfg.block_sparse.index_num_heads % cfg.num_kv_heads and kv_ranks > cfg.num_kv_heads:
            raise ParallelLayoutError(
                f"KV heads repeated over {kv_ranks} ranks need index_num_heads ({cfg.block_sparse.index_num_heads}) "
                f"to be a multiple of num_kv_heads ({cfg.num_kv_heads})")
    if "kda" in layer_types:
        _split_heads("kda num_heads", cfg.kda.num_heads, kv_ranks, may_replicate=False)
    if "dense" in cfg.mlp_layer_types and cfg.intermediate_size % tp:
        raise ParallelLayoutError(f"intermediate_size={cfg.intermediate_size} cannot be split over "
                                  f"tensor_parallel_size={tp}")


def _check_experts(cfg, parallel: ParallelConfig) -> None:
    if cfg.moe is None or not {"moe", "hash_moe"} & set(cfg.mlp_layer_types):
        return
    moe, tp = cfg.moe, parallel.role_size("tensor")
    if parallel.enable_expert_parallel:
        ranks = parallel.role_size("expert")
        if moe.num_experts % ranks:
            raise ParallelLayoutError(
                f"num_experts={moe.num_experts} cannot be split over the {ranks} expert-parallel ranks "
                f"(data_parallel_size x tensor_parallel_size)")
    elif tp > 1 and moe.expert_intermediate_size % tp:
        raise ParallelLayoutError(f"moe expert_intermediate_size={moe.expert_intermediate_size} cannot be split "
                                  f"over tensor_parallel_size={tp}; enable_expert_parallel shards whole experts")
    if tp > 1 and moe.num_shared_experts and moe.shared_size % tp:
        raise ParallelLayoutError(f"the shared experts' width {moe.shared_size} cannot be split over "
                                  f"tensor_parallel_size={tp}")


def build_mesh(parallel: ParallelConfig, devices=None):
    """The `jax.sharding.Mesh` of a layout over the first `num_devices` devices (all processes')."""
    import jax
    import numpy as np

    devices = list(devices if devices is not None else jax.devices())
    if len(devices) < parallel.num_devices:
        raise ParallelLayoutError(f"layout {parallel.name} needs {parallel.num_devices} devices; "
                                  f"{len(devices)} exist")
    sizes = parallel.axis_sizes
    grid = np.asarray(devices[:parallel.num_devices], dtype=object).reshape([sizes[a] for a in MESH_AXES])
    return jax.sharding.Mesh(grid, MESH_AXES)
