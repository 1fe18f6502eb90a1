"""The per-device model of a parallel layout: the decoder of the local config, with the projections and
experts that talk to other ranks swapped for their parallel forms.

`build_local_model` builds the decoder of `layouts.local_model_config` abstractly, then replaces (by
the layout rules) row-parallel projections with `RowParallelLinear`, and in batch-invariant numerics
column-parallel ones with `ColumnParallelLinear`; routed experts with `TensorParallelExperts` or
`ExpertParallelExperts`; shared experts with `TensorParallelFeedForward`. Parameter names stay those
of the single-device model, so a checkpoint's names place it. Runs inside `shard_map` only.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from agentjax.errors import ParallelLayoutError
from agentjax.models.layers import Linear
from agentjax.models.moe import GatedFeedForward, RoutedExperts, _weighted_sum
from agentjax.models.quantized import take_experts
from agentjax.numerics import dense, map_row_blocks
from sharding import collectives
from sharding.layouts import ParamPlan, local_model_config, plan_parameters
from sharding.mesh import ParallelConfig

INVARIANT = "batch_invariant"


def _columns(plan: ParamPlan) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(c) for c in row) for row in plan.column_index)


class ColumnParallelLinear(nnx.Module):
    """A projection whose output columns are split over `role` (no communication). In batch-invariant
    numerics it multiplies at the single-device width (`collectives.exact_columns`)."""

    def __init__(self, kernel: nnx.Param, plan: ParamPlan, parallel: ParallelConfig):
        self.kernel = kernel
        self.columns, self.width = _columns(plan), plan.global_shape[-1]
        self.parallel, self.role = parallel, plan.layout.role

    def __call__(self, x, numerics: str = "fast"):
        if numerics != INVARIANT:
            return dense(x, self.kernel[...], numerics)
        columns = jnp.asarray(self.columns, jnp.int32)[collectives.rank(self.parallel, self.role)]
        return collectives.exact_columns(x, self.kernel[...], columns, self.width)


class RowParallelLinear(nnx.Module):
    """A projection whose input (reduction) dimension is split over `role`: each rank multiplies its
    slice and an all-reduce sums the partial products. In batch-invariant numerics the kernel is split by
    output columns instead: all-gather the input, multiply exactly, all-gather the output."""

    def __init__(self, kernel: nnx.Param, plan: ParamPlan, parallel: ParallelConfig):
        self.kernel = kernel
        self.parallel, self.role = parallel, plan.layout.role
        self.columns = _columns(plan) if plan.column_index is not None else None
        self.width = plan.global_shape[-1]

    def __call__(self, x, numerics: str = "fast"):
        if numerics != INVARIANT:
            return collectives.sum_over(self.parallel, self.role, dense(x, self.kernel[...], numerics))
        whole = collectives.all_gather(self.parallel, self.role, x, axis=-1)
        columns = jnp.asarray(self.columns, jnp.int32)[collectives.rank(self.parallel, self.role)]
        mine = collectives.exact_columns(whole, self.kernel[...], columns, self.width)
        return collectives.all_gather(self.parallel, self.role, mine, axis=-1)


class GroupedParallelLinear(nnx.Module):
    """DeepSeek-V4's grouped low-rank output projection with its groups split over `role`: each rank
    projects its own groups. In batch-invariant numerics every group's input is all-gathered and the
    projection runs at the single-device group count with the rank's groups in place (XLA's CPU batched
    matmul rounds by the number of groups)."""

    def __init__(self, kernel: nnx.Param, plan: ParamPlan, parallel: ParallelConfig, exact: bool):
        self.kernel, self.groups = kernel, plan.global_shape[-3]
        self.parallel, self.role, self.exact = parallel, plan.layout.role, exact  # the layer passes no numerics

    def __call__(self, x):
        if not self.exact:
            return jnp.einsum("tgi,gio->tgo", x, self.kernel[...]).reshape(x.shape[0], -1)
        local = self.kernel[...]
        start = collectives.rank(self.parallel, self.role) * local.shape[0]
        every = collectives.all_gather(self.parallel, self.role, x, axis=1)
        kernel = jax.lax.dynamic_update_slice_in_dim(
            jnp.zeros((self.groups, *local.shape[1:]), local.dtype), local, start, axis=0)
        out = jax.lax.dynamic_slice_in_dim(jnp.einsum("tgi,gio->tgo", every, kernel), start, local.shape[0], axis=1)
        return out.reshape(x.shape[0], -1)


class TensorParallelFeedForward(GatedFeedForward):
    """The shared experts with `[gate | up]` columns and the down projection's rows split over TP."""

    def __init__(self, gate_up: nnx.Param, down: nnx.Param, activation, plans: tuple[ParamPlan, ParamPlan],
                 parallel: ParallelConfig):
        self.gate_up_proj, self.down_proj, self.activation = gate_up, down, activation
        self.parallel, self.role = parallel, plans[0].layout.role
        self.gate_up_columns, self.gate_up_width = _columns(plans[0]), plans[0].global_shape[-1]
        self.down_columns = _columns(plans[1]) if plans[1].column_index is not None else None
        self.down_width = plans[1].global_shape[-1]

    def __call__(self, x, numerics: str = "fast"):
        if numerics != INVARIANT:
            partial = self.activation.on_fused(x @ self.gate_up_proj[...]) @ self.down_proj[...]
            return collectives.sum_over(self.parallel, self.role, partial)
        rank = collectives.rank(self.parallel, self.role)
        up_columns = jnp.asarray(self.gate_up_columns, jnp.int32)[rank]
        hidden = self.activation.on_fused(collectives.exact_columns(x, self.gate_up_proj[...], up_columns,
                                                                    self.gate_up_width))
        whole = collectives.all_gather(self.parallel, self.role, hidden, axis=-1)
        down_columns = jnp.asarray(self.down_columns, jnp.int32)[rank]
        mine = collectives.exact_columns(whole, self.down_proj[...], down_columns, self.down_width)
        return collectives.all_gather(self.parallel, self.role, mine, axis=-1)


class TensorParallelExperts(RoutedExperts):
    """Routed experts with every expert's `[gate | up]` columns and down rows split over TP; each rank
    runs all experts on its slice, an all-reduce sums the partial outputs. In batch-invariant numerics the
    per-pair matmuls run at the single-device widths with the shard in place (see `exact_columns`)."""

    def __init__(self, gate_up: nnx.Param, down: nnx.Param, activation, num_experts: int,
                 plans: tuple[ParamPlan, ParamPlan], parallel: ParallelConfig, impl: str = "reference"):
        self.gate_up_proj, self.down_proj = gate_up, down
        self.activation, self.num_experts, self.impl = activation, num_experts, impl
        self.parallel, self.role = parallel, plans[0].layout.role
        self.gate_up_columns, self.gate_up_width = _columns(plans[0]), plans[0].global_shape[-1]
        self.down_columns = _columns(plans[1]) if plans[1].column_index is not None else None
        self.down_width = plans[1].global_shape[-1]

    def __call__(self, x, weights, expert_ids, numerics: str = "fast"):
        if numerics != INVARIANT:
            return collectives.sum_over(self.parallel, self.role, self._grouped(x, weights, expert_ids))
        rank = collectives.rank(self.parallel, self.role)
        up_columns = jnp.asarray(self.gate_up_columns, jnp.int32)[rank]
        down_columns = jnp.asarray(self.down_columns, jnp.int32)[rank]
        gate_up = _place_columns(self.gate_up_proj[...], up_columns, self.gate_up_width)
        down = _place_columns(self.down_proj[...], down_columns, self.down_width)

        def hidden_of(rows, ids):
            pairs = jnp.einsum("bd,bkdn->bkn", rows, gate_up[ids])
            return self.activation.on_fused(jnp.take(pairs, up_columns, axis=-1))

        hidden = collectives.all_gather(self.parallel, self.role, map_row_blocks(hidden_of, x, expert_ids), axis=-1)

        def output_of(rows, ids, row_weights):
            per_pair = jnp.take(jnp.einsum("bki,bkid->bkd", rows, down[ids]), down_columns, axis=-1)
            return _weighted_sum(per_pair, row_weights)

        mine = map_row_blocks(output_of, hidden, expert_ids, weights)
        return collectives.all_gather(self.parallel, self.role, mine, axis=-1)


def _place_columns(local, columns, width: int):
    """A zero array of the single-device width with the shard's columns in place (last dimension)."""
    return jnp.zeros((*local.shape[:-1], width), local.dtype).at[..., columns].set(local)


class ExpertParallelExperts(RoutedExperts):
    """Whole experts over the expert ranks (DEP; with TP the expert ranks are data x TP, as vLLM's EP). Each
    token is sent (all_to_all) to every rank that holds one of its experts, with its expert ids there; the
    owner runs its local experts and the results come back by a second all_to_all. Fast numerics weight and
    sum a token's pairs on each owner; batch-invariant numerics send every pair's output back and sum on
    the token's rank in the single-device order (a token's pairs live on exactly one rank each, so adding
    the others' zeros is exact). Under TP the ranks of a TP group hold the same tokens: each sends every
    TP-th of them (the others route to no expert, as padding does) and a sum over the group, where each
    token has one non-zero term, gives every rank all of them. Bucket padding (id `total_experts`) is sent
    to no rank, and no received pair but a real one joins a group of the fast path's grouped matmuls."""

    def __init__(self, gate_up: nnx.Param, down: nnx.Param, activation, num_experts: int,
                 parallel: ParallelConfig, impl: str = "reference"):
        self.gate_up_proj, self.down_proj = gate_up, down
        self.activation, self.parallel, self.impl = activation, parallel, impl
        # `_grouped` groups the pairs by local expert; the router's ids are global
        self.total_experts = num_experts
        self.num_experts = num_experts // parallel.role_size("expert")

    def __call__(self, x, weights, expert_ids, numerics: str = "fast"):
        tp = self.parallel.role_size("tensor")
        if tp > 1:
            token = jnp.arange(expert_ids.shape[0], dtype=expert_ids.dtype)
            mine = (token % tp == collectives.rank(self.parallel, "tensor"))[:, None]
            expert_ids = jnp.where(mine, expert_ids, self.total_experts)  # another TP rank sends this token
            return collectives.sum_over(self.parallel, "tensor", self._routed(x, weights, expert_ids, numerics))
        return self._routed(x, weights, expert_ids, numerics)

    def _routed(self, x, weights, expert_ids, numerics: str):
        ranks = self.parallel.role_size("expert")
        tokens, k = expert_ids.shape
        if numerics == INVARIANT:  # the weights stay home: the token's rank sums its pairs
            recv_x, _, local_ids = self.dispatch(x, expert_ids)
            valid = local_ids < self.num_experts
            per_pair = map_row_blocks(self._pairs, recv_x, jnp.where(valid, local_ids, 0))
            per_pair = jnp.where(valid[..., None], per_pair, jnp.zeros((), per_pair.dtype))
            back = collectives.all_to_all(self.parallel, "expert", per_pair.reshape(ranks, tokens, k, -1))
            return _weighted_sum(back.sum(axis=0), weights)
        recv_x, recv_w, local_ids = self.dispatch(x, expert_ids, weights)
        out = self._grouped(recv_x, recv_w, local_ids)
        return collectives.all_to_all(self.parallel, "expert", out.reshape(ranks, tokens, -1)).sum(axis=0)

    def dispatch(self, x, expert_ids, weights=None):
        """The first all_to_all: `(rows, weights or None, local expert ids)` of the `ranks * tokens` rows this
        rank receives. A pair whose expert another rank owns, and every pair of a padding token (global id
        `total_experts`), gets the local id `num_experts` and weight 0: it joins no local expert's group,
        so the grouped matmuls give it zeros without a multiply."""
        ranks, local_experts = self.parallel.role_size("expert"), self.num_experts
        tokens, k = expert_ids.shape
        owner = expert_ids // local_experts
        mine = owner[None] == jnp.arange(ranks, dtype=expert_ids.dtype)[:, None, None]  # [ranks, T, k]
        send_x = jnp.where(mine.any(-1)[..., None], x[None], jnp.zeros((), x.dtype))
        send_ids = jnp.where(mine, expert_ids[None] % local_experts, local_experts)
        recv_x = collectives.all_to_all(self.parallel, "expert", send_x).reshape(ranks * tokens, -1)
        recv_ids = collectives.all_to_all(self.parallel, "expert", send_ids).reshape(ranks * tokens, k)
        if weights is None:
            return recv_x, None, recv_ids
        send_w = jnp.where(mine, weights[None], 0.0)
        recv_w = collectives.all_to_all(self.parallel, "expert", send_w).reshape(ranks * tokens, k)
        return recv_x, recv_w, recv_ids

    def _pairs(self, rows, ids):
        """Each row against its k gathered local experts: the single-device `_gathered` before its sum."""
        gate_up = jnp.einsum("bd,bkdn->bkn", rows, take_experts(self.gate_up_proj.get_value(), ids))
        return jnp.einsum("bki,bkid->bkd", self.activation.on_fused(gate_up), take_experts(self.down_proj.get_value(), ids))


def _get(root, path: tuple):
    node = root
    for part in path:
        node = node[part] if isinstance(part, int) else getattr(node, part)
    return node


def _set(root, path: tuple, value) -> None:
    parent = _get(root, path[:-1])
    if isinstance(path[-1], int):
        parent[path[-1]] = value
    else:
        setattr(parent, path[-1], value)


def _param(plan: ParamPlan, dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(plan.local_shape, dtype))


def _swap_modules(model, plans: dict, parallel: ParallelConfig, numerics: str, dtype) -> None:
    """Replace the modules whose parameters the rules split, by their parallel forms (in place)."""
    swaps = []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, Linear):
            plan = plans.get((*path, "kernel"))
            if plan is None or plan.layout.role is None or plan.local_shape == plan.global_shape:
                continue
            if plan.layout.row:
                swaps.append((path, RowParallelLinear(_param(plan, dtype), plan, parallel)))
            elif numerics == INVARIANT and plan.column_index is not None:
                swaps.append((path, ColumnParallelLinear(_param(plan, dtype), plan, parallel)))
        elif isinstance(node, RoutedExperts):
            impl = getattr(node, "impl", "reference")
            impl = impl if isinstance(impl, str) else impl.base  # the layout's ops wrap attention only
            if hasattr(node, "impl"):
                node.impl = impl
            up, down = plans[(*path, "gate_up_proj")], plans[(*path, "down_proj")]
            if up.local_shape == up.global_shape:
                continue
            if up.layout.role == "expert":
                swaps.append((path, ExpertParallelExperts(_param(up, dtype), _param(down, dtype), node.activation,
                                                          node.num_experts, parallel, impl)))
            else:
                swaps.append((path, TensorParallelExperts(_param(up, dtype), _param(down, dtype), node.activation,
                                                          node.num_experts, (up, down), parallel, impl)))
        elif type(node).__name__ == "GroupedLinear":  # DeepSeek-V4's output groups
            plan = plans.get((*path, "kernel"))
            if plan is not None and plan.local_shape != plan.global_shape:
                swaps.append((path, GroupedParallelLinear(_param(plan, dtype), plan, parallel, numerics == INVARIANT)))
        elif isinstance(node, GatedFeedForward):
            up, down = plans[(*path, "gate_up_proj")], plans[(*path, "down_proj")]
            if up.local_shape != up.global_shape:
                swaps.append((path, TensorParallelFeedForward(_param(up, dtype), _param(down, dtype), node.activation,
                                                              (up, down), parallel)))
    for path, module in swaps:
        _set(model, path, module)


def build_local_model(cfg, parallel: ParallelConfig, numerics: str, *, attention_impl=None):
    """`(graphdef, abstract local state, plans)` of the per-device model; `attention_impl` replaces the
    config's (the context-parallel attention ops). Raises `ParallelLayoutError` if a local parameter's
    shape disagrees with its layout (a rule missing for a module that splits it)."""
    from agentjax.models.decoder import Decoder

    plans = plan_parameters(cfg, parallel, numerics)
    local_cfg = local_model_config(cfg, parallel, attention_impl)

    def build():
        model = Decoder(local_cfg, rngs=nnx.Rngs(0))
        _swap_modules(model, plans, parallel, numerics, cfg.dtype)
        return model

    graphdef, state = nnx.split(nnx.eval_shape(build))
    for path, variable in nnx.to_flat_state(state):
        shape = tuple(variable.get_value().shape)
        if path not in plans or plans[path].local_shape != shape:
            expected = plans[path].local_shape if path in plans else "no such parameter"
            raise ParallelLayoutError(f"layout {parallel.name}: parameter {'.'.join(map(str, path))} is {shape} on a "
                                      f"device, its layout says {expected}")
    return graphdef, state, plans


def specs_of(params):
    """The PartitionSpec of every array of placed parameters (a StoredWeight's parts each their own)."""
    return jax.tree.map(lambda leaf: leaf.sharding.spec, params)


def local_specs(state, plans: dict):
    """The PartitionSpec of each parameter, as a state-shaped pytree (shard_map's in_specs)."""
    from jax.sharding import PartitionSpec

    flat = [(path, variable.replace(value=PartitionSpec(*plans[path].spec)))
            for path, variable in nnx.to_flat_state(state)]
    return nnx.from_flat_state(flat)


def _placed_on(value, mesh) -> bool:
    """Every array of a parameter (a StoredWeight's parts too) already sharded over `mesh`."""
    from jax.sharding import NamedSharding

    leaves = jax.tree.leaves(value)
    return bool(leaves) and all(isinstance(leaf, jax.Array) and isinstance(leaf.sharding, NamedSharding)
                                and leaf.sharding.mesh == mesh for leaf in leaves)


def place_parameters(params, plans: dict, mesh):
    """The single-device parameters laid out over `mesh` (transformed on the host where a layout
    repeats heads or interleaves gate|up halves), built shard by shard so every process supplies its own.
    Parameters already laid out over `mesh` (a streamed checkpoint, sharding/streaming_load.py) stay."""
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    flat = []
    for path, variable in nnx.to_flat_state(params):
        if path not in plans:
            continue  # MTP modules: loaded with the model, not run by the step
        if _placed_on(variable.get_value(), mesh):
            flat.append((path, variable))
            continue
        plan = plans[path]
        value = plan.place(np.asarray(jax.device_get(variable.get_value())))
        sharding = NamedSharding(mesh, PartitionSpec(*plan.spec))
        array = jax.make_array_from_callback(value.shape, sharding, lambda index, v=value: v[index])
        flat.append((path, variable.replace(value=array)))
    return nnx.from_flat_state(flat)
