"""Parameter layouts by name, the rules table that maps each model parameter to one, and the local model.

`LAYOUTS` names every way a parameter is laid out over the mesh (replicated, split by query heads,
by KV heads with whole heads repeated when there are more ranks than heads, fused gate|up halves,
whole experts, ...). `RULES` maps a parameter's name inside a decoder block, per token-mixer and
feed-forward kind, to a layout name; everything else is replicated. `plan_parameters` resolves them
for a model and a `ParallelConfig`: the PartitionSpec of each parameter, the host-side transform that
places it (head repeats, gate|up interleave), its per-device shape, and (for the exact batch-invariant
matmuls) which global column each local column is. `local_model_config` is the per-device model the
sharded step runs inside `shard_map`. Pure layout logic: no collectives, never runs a step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from agentjax.errors import ParallelLayoutError
from agentjax.kv.cache_layout import kv_buffer_specs
from sharding.mesh import ParallelConfig, axes


@dataclass(frozen=True)
class Layout:
    """Split dimension `dim` (negative: from the end) over the ranks of `role`; `heads` names the
    (count, width) of whole heads in that dimension that may be repeated when ranks outnumber them;
    `fused` halves (gate|up) are each split, so a rank holds its share of both."""

    role: str | None = None
    dim: int | None = None
    heads: str | None = None
    fused: int = 1
    # a row-parallel projection: its reduction (input) dim is split; in batch-invariant numerics the
    # output dim is split instead and the input gathered (see sharding/modules.py)
    row: bool = False


LAYOUTS: dict[str, Layout] = {
    "replicated": Layout(),
    "heads_column": Layout("tensor", -1),
    "heads_row": Layout("tensor", -2, row=True),
    "kv_column": Layout("kv_heads", -1, heads="kv"),
    "index_column": Layout("kv_heads", -1, heads="index"),
    "state_column": Layout("kv_heads", -1),
    "state_row": Layout("kv_heads", -2, row=True),
    "state_channels": Layout("kv_heads", -3),  # KDA conv weights [channels, 1, K]
    "state_heads": Layout("kv_heads", -2),  # KDA A_log [1, 1, heads, 1]
    "mlp_column": Layout("tensor", -1),
    "mlp_row": Layout("tensor", -2, row=True),
    "fused_column": Layout("tensor", -1, fused=2),  # [gate | up] kernels
    "experts": Layout("expert", -3),  # [experts, in, out]: whole experts per rank
    "output_groups": Layout("tensor", -3),  # DeepSeek-V4's grouped low-rank output [groups, in, rank]
}

# Per block kind: parameter name inside the block -> layout name. Unnamed parameters are replicated
# (norms, routers, MLA's latent projections, the indexer's key, embeddings, the LM head).
_ATTENTION = {"attn.q_proj.kernel": "heads_column", "attn.k_proj.kernel": "kv_column",
              "attn.v_proj.kernel": "kv_column", "attn.o_proj.kernel": "heads_row"}
RULES: dict[str, dict[str, str]] = {
    "full_attention": _ATTENTION,
    "sliding_attention": _ATTENTION,
    "block_sparse_attention": {**_ATTENTION, "attn.index_q_proj.kernel": "index_column"},
    "mla": {"attn.q_proj.kernel": "heads_column", "attn.q_b_proj.kernel": "heads_column",
            "attn.kv_b_proj.kernel": "heads_column", "attn.g_proj.kernel": "heads_column",
            "attn.o_proj.kernel": "heads_row"},
    "kda": {**{f"attn.{name}.kernel": "state_column" for name in
               ("q_proj", "k_proj", "v_proj", "f_b_proj", "b_proj", "g_proj", "g_b_proj")},
            **{f"attn.{name}_conv1d.weight": "state_channels" for name in ("q", "k", "v")},
            "attn.A_log": "state_heads", "attn.dt_bias": "state_column", "attn.o_proj.kernel": "state_row"},
    "dense": {"mlp.gate_proj.kernel": "mlp_column", "mlp.up_proj.kernel": "mlp_column",
              "mlp.down_proj.kernel": "mlp_row"},
    # MoE with the experts' columns split over TP (no expert parallelism)
    "moe": {"mlp.experts.gate_up_proj": "fused_column", "mlp.experts.down_proj": "mlp_row",
            "mlp.shared_experts.gate_up_proj": "fused_column", "mlp.shared_experts.down_proj": "mlp_row"},
    # MoE under enable_expert_parallel: whole experts over the expert ranks; shared experts replicated
    "moe_expert_parallel": {"mlp.experts.gate_up_proj": "experts", "mlp.experts.down_proj": "experts"},
}
# DeepSeek-V4: heads (queries, sinks, output groups) split; the shared K=V rows, compressors and the
# indexer replicated (every head reads the same entries and selection)
_DSV4 = {"attn.q_b_proj.kernel": "heads_column", "attn.sinks": "heads_column", "attn.o_a_proj.kernel": "output_groups",
         "attn.o_b_proj.kernel": "heads_row"}
RULES.update({"swa_mqa": _DSV4, "csa": _DSV4, "hca": _DSV4})
RULES["hash_moe"] = RULES["moe"]
RULES["hash_moe_expert_parallel"] = RULES["moe_expert_parallel"]


@dataclass(frozen=True)
class ParamPlan:
    """How one parameter reaches the devices."""

    name: str
    layout: Layout
    global_shape: tuple[int, ...]
    placed_shape: tuple[int, ...]  # after `place` (head repeats), before splitting
    local_shape: tuple[int, ...]
    spec: tuple  # PartitionSpec entries
    # [ranks, local width]: the single-device column of each local column of the split last dim
    column_index: np.ndarray | None = field(default=None, compare=False, hash=False)
    repeat: int = 1  # each head repeated this many times before splitting
    head_width: int = 1

    def place(self, value: np.ndarray) -> np.ndarray:
        """The host-side transform before splitting: repeat whole heads, interleave fused halves."""
        value = np.asarray(value)
        return _place_last(value, self.repeat, self.head_width, self.layout.fused, self._ranks) \
            if self.layout.dim == -1 else value

    @property
    def _ranks(self) -> int:
        return self.column_index.shape[0] if self.column_index is not None else 1


def _place_last(value: np.ndarray, repeat: int, head_width: int, fused: int, ranks: int) -> np.ndarray:
    if repeat > 1:
        lead = value.shape[:-1]
        heads = value.shape[-1] // head_width
        value = np.repeat(value.reshape(*lead, heads, head_width), repeat, axis=-2).reshape(*lead, -1)
    if fused > 1:
        lead, width = value.shape[:-1], value.shape[-1]
        value = value.reshape(*lead, fused, ranks, width // (fused * ranks))
        value = np.swapaxes(value, -3, -2).reshape(*lead, width)
    return value


def _heads_of(cfg, heads: str | None) -> tuple[int, int] | None:
    if heads == "kv":
        return cfg.num_kv_heads, cfg.head_dim
    if heads == "index":
        return cfg.block_sparse.index_num_heads, cfg.block_sparse.index_head_dim
    return None


def block_kinds(cfg) -> dict[tuple[int, int], tuple[str, str]]:
    """(segment, period position) -> (mixer type, feed-forward type) of the block there."""
    from agentjax.models.layer_plan import layer_kinds, segments_of

    kinds = layer_kinds(cfg)
    return {(k, j): (kinds[seg.layer(0, j)].mixer, kinds[seg.layer(0, j)].mlp)
            for k, seg in enumerate(segments_of(cfg)) for j in range(seg.period)}


def layout_name(cfg, parallel: ParallelConfig, path: tuple) -> str:
    """The layout of one parameter, by its path in the decoder's state."""
    if path[0] != "segments" or parallel.role_size("tensor") * parallel.role_size("expert") == 1:
        return "replicated"
    mixer, mlp = block_kinds(cfg)[(int(path[1]), int(path[3]))]
    inner = ".".join(str(p) for p in path[4:])
    if parallel.enable_expert_parallel and mlp in ("moe", "hash_moe"):
        mlp = f"{mlp}_expert_parallel"
    for kind in (mixer, mlp):
        if inner in RULES.get(kind, {}):
            return RULES[kind][inner]
    return "replicated"


def plan_parameter(cfg, parallel: ParallelConfig, name: str, layout: Layout, shape: tuple[int, ...],
                   numerics: str) -> ParamPlan:
    """Resolve a layout for one parameter of `shape`; in batch-invariant numerics a row layout splits
    its output dimension instead (the exact row-parallel matmul, sharding/modules.py)."""
    if layout.role is None:
        return ParamPlan(name, layout, shape, shape, shape, (None,) * len(shape))
    ranks = parallel.role_size(layout.role)
    if ranks == 1:
        return ParamPlan(name, layout, shape, shape, shape, (None,) * len(shape))
    if layout.row and numerics == "batch_invariant":
        layout = Layout(layout.role, -1, row=True)
    dim = len(shape) + layout.dim
    placed, repeat, width = list(shape), 1, 1
    heads = _heads_of(cfg, layout.heads)
    if heads is not None:
        count, width = heads
        if ranks > count:
            repeat = ranks // count
            placed[dim] = count * repeat * width
    if placed[dim] % (ranks * layout.fused):
        raise ParallelLayoutError(f"{name}: dimension {shape[dim]} cannot be split over {ranks} ranks")
    local = list(placed)
    local[dim] //= ranks
    spec = [None] * len(shape)
    spec[dim] = axes(layout.role)
    column_index = None
    if layout.dim == -1:
        columns = _place_last(np.arange(shape[-1]), repeat, width, layout.fused, ranks)
        column_index = columns.reshape(ranks, -1)
    return ParamPlan(name, layout, shape, tuple(placed), tuple(local), tuple(spec), column_index, repeat, width)


def plan_parameters(cfg, parallel: ParallelConfig, numerics: str) -> dict[tuple, ParamPlan]:
    """Every parameter of the decoder (MTP modules excluded: the step does not run them) -> its plan."""
    from flax import nnx

    from agentjax.models.params import split_model

    _, abstract = split_model(cfg.replace(num_mtp_modules=0))
    plans = {}
    for path, variable in nnx.to_flat_state(abstract):
        name = ".".join(str(p) for p in path)
        layout = LAYOUTS[layout_name(cfg, parallel, path)]
        plans[path] = plan_parameter(cfg, parallel, name, layout, tuple(variable.get_value().shape), numerics)
    return plans


def local_model_config(cfg, parallel: ParallelConfig, attention_impl=None):
    """The model one device runs: head counts, MLP and expert widths divided by their ranks (KV-like
    heads at least one), MTP modules dropped, `attention_impl` (the layout's attention ops) if given.
    The router still scores every expert."""
    tp, kv_ranks = parallel.role_size("tensor"), parallel.role_size("kv_heads")
    changes: dict = {"num_mtp_modules": 0}
    if attention_impl is not None:
        changes["attention_impl"] = attention_impl
    heads = {}
    if tp > 1:
        changes["intermediate_size"] = cfg.intermediate_size // tp
        heads = {"num_heads": cfg.num_heads // tp, "num_kv_heads": max(1, cfg.num_kv_heads // kv_ranks)}
        if cfg.kda is not None:
            changes["kda"] = _replace(cfg.kda, num_heads=cfg.kda.num_heads // kv_ranks)
        if getattr(cfg, "compressed_attention", None) is not None:
            changes["compressed_attention"] = _replace(cfg.compressed_attention,
                                                       o_groups=cfg.compressed_attention.o_groups // tp)
        if cfg.block_sparse is not None:
            changes["block_sparse"] = _replace(cfg.block_sparse,
                                               index_num_heads=max(1, cfg.block_sparse.index_num_heads // kv_ranks))
        if cfg.moe is not None and not parallel.enable_expert_parallel:
            shared = cfg.moe.shared_intermediate_size
            changes["moe"] = _replace(cfg.moe, expert_intermediate_size=cfg.moe.expert_intermediate_size // tp,
                                      shared_intermediate_size=None if shared is None else shared // tp)
    local = cfg.replace(**changes)
    # Set past ModelConfig's check: with DCP a rank holds num_heads / tp query heads but the KV heads of
    # its whole DCP group (the context-parallel attention all-gathers the group's queries).
    for name, value in heads.items():
        object.__setattr__(local, name, value)
    return local


def _replace(config, **changes):
    import dataclasses

    return dataclasses.replace(config, **changes)


def local_kv_buffer_specs(cfg, parallel: ParallelConfig, page_size: int):
    """The KV buffers one device holds (`kv_buffer_specs` of the local model, at a rank's page size)."""
    return kv_buffer_specs(local_model_config(cfg, parallel), page_size // parallel.decode_context_parallel_size)
