"""sharding/modules.py: the parallel projections and experts against the single-device modules, inside a
shard_map over virtual CPU devices: bit-equal in batch-invariant numerics, close in fast numerics."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from agentjax.config import MoEConfig
from agentjax.models.moe import MoE
from sharding.layouts import LAYOUTS, plan_parameter
from sharding.mesh import ParallelConfig, axes, build_mesh
from sharding.modules import ExpertParallelExperts, RowParallelLinear, TensorParallelExperts
from tests.sharding.parity import need_devices

CONFIG = MoEConfig(num_experts=8, num_experts_per_token=2, expert_intermediate_size=32, scoring="sigmoid",
                   activation="swigluoai")


def _moe_inputs(tokens: int = 21):
    moe = MoE(16, CONFIG, rngs=nnx.Rngs(3))
    x = jax.random.normal(jax.random.key(1), (tokens, 16), jnp.float32)
    weights, ids = moe.router(x, "fast")
    return moe, x, weights, ids


@pytest.mark.parametrize("numerics", ["batch_invariant", "fast"])
def test_expert_parallel_experts_match_one_device(numerics):
    need_devices(4)
    moe, x, weights, ids = _moe_inputs()
    want = moe.experts(x, weights, ids, numerics)
    parallel = ParallelConfig(data_parallel_size=4, enable_expert_parallel=True)
    tokens_each = 6  # each data rank routes its own tokens (21 padded to 24)
    pad = 4 * tokens_each - x.shape[0]
    stacked = [jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape(4, tokens_each, *a.shape[1:])
               for a in (x, weights, ids)]

    module = ExpertParallelExperts(nnx.Param(moe.experts.gate_up_proj[...]), nnx.Param(moe.experts.down_proj[...]),
                                   moe.experts.activation, CONFIG.num_experts, parallel)
    mesh = build_mesh(parallel)
    experts = PartitionSpec(axes("expert"))
    graphdef, state = nnx.split(module)

    def body(state, x, w, i):
        return nnx.merge(graphdef, state)(x[0], w[0], i[0], numerics)[None]

    data = PartitionSpec(axes("data"))
    state_specs = jax.tree.map(lambda _: experts, state)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(state_specs, data, data, data), out_specs=data, check_vma=False)
    got = jax.jit(mapped)(state, *stacked).reshape(-1, 16)[: x.shape[0]]
    if numerics == "batch_invariant":
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    else:
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_expert_parallel_dispatch_hands_only_real_pairs_to_the_grouped_matmul():
    """DEP in fast numerics: the pairs each rank's grouped matmuls receive sum, over the ranks, to the real
    tokens' pairs: a pair another rank owns and every pair of a padding token (id `num_experts`, weight 0,
    as `MoE(real_tokens=...)` routes it) join no local group. The real tokens' outputs match one device,
    the padding tokens' are zero."""
    from agentjax.models.moe import expert_group_sizes

    need_devices(4)
    moe, x, weights, ids = _moe_inputs(tokens=24)
    padding = np.zeros(24, bool)
    padding[[2, 9, 21, 22, 23]] = True  # bucket padding at the end of ranks' rows, and inside them
    ids = jnp.where(padding[:, None], CONFIG.num_experts, ids)
    weights = jnp.where(padding[:, None], 0.0, weights)
    want = moe.experts(x, weights, ids, "fast")
    parallel = ParallelConfig(data_parallel_size=4, enable_expert_parallel=True)
    stacked = [a.reshape(4, 6, *a.shape[1:]) for a in (x, weights, ids)]
    module = ExpertParallelExperts(nnx.Param(moe.experts.gate_up_proj[...]), nnx.Param(moe.experts.down_proj[...]),
                                   moe.experts.activation, CONFIG.num_experts, parallel)
    graphdef, state = nnx.split(module)

    def body(state, x, w, i):
        experts = nnx.merge(graphdef, state)
        _, _, local_ids = experts.dispatch(x[0], i[0], w[0])
        pairs = expert_group_sizes(local_ids, experts.num_experts).sum()
        return experts(x[0], w[0], i[0], "fast")[None], pairs[None]

    data = PartitionSpec(axes("data"))
    mapped = jax.shard_map(body, mesh=build_mesh(parallel),
                           in_specs=(jax.tree.map(lambda _: PartitionSpec(axes("expert")), state), data, data, data),
                           out_specs=(data, data), check_vma=False)
    got, pairs = jax.jit(mapped)(state, *stacked)
    got = np.asarray(got).reshape(24, 16)
    assert int(np.asarray(pairs).sum()) == (24 - padding.sum()) * CONFIG.num_experts_per_token
    np.testing.assert_array_equal(got[padding], 0.0)
    np.testing.assert_allclose(got[~padding], np.asarray(want)[~padding], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("numerics", ["batch_invariant", "fast"])
def test_expert_parallel_experts_inside_tensor_parallel_match_one_device(numerics):
    """EP over data x TP: the TP ranks of a data rank hold the same tokens and each sends every other one."""
    need_devices(4)
    moe, x, weights, ids = _moe_inputs()
    want = moe.experts(x, weights, ids, numerics)
    parallel = ParallelConfig(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True)
    tokens_each = 11  # each data rank routes its own tokens (21 padded to 22), the same on both its TP ranks
    pad = 2 * tokens_each - x.shape[0]
    stacked = [jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape(2, tokens_each, *a.shape[1:])
               for a in (x, weights, ids)]
    module = ExpertParallelExperts(nnx.Param(moe.experts.gate_up_proj[...]), nnx.Param(moe.experts.down_proj[...]),
                                   moe.experts.activation, CONFIG.num_experts, parallel)
    graphdef, state = nnx.split(module)

    def body(state, x, w, i):
        return nnx.merge(graphdef, state)(x[0], w[0], i[0], numerics)[None]

    data = PartitionSpec(axes("data"))
    mapped = jax.shard_map(body, mesh=build_mesh(parallel),
                           in_specs=(jax.tree.map(lambda _: PartitionSpec(axes("expert")), state), data, data, data),
                           out_specs=data, check_vma=False)
    got = jax.jit(mapped)(state, *stacked).reshape(-1, 16)[: x.shape[0]]
    if numerics == "batch_invariant":
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    else:
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("numerics", ["batch_invariant", "fast"])
def test_tensor_parallel_experts_match_one_device(numerics):
    need_devices(4)
    moe, x, weights, ids = _moe_inputs()
    want = moe.experts(x, weights, ids, numerics)
    parallel = ParallelConfig(tensor_parallel_size=4)
    up = plan_parameter(None, parallel, "gate_up", LAYOUTS["fused_column"], tuple(moe.experts.gate_up_proj.shape),
                        numerics)
    down = plan_parameter(None, parallel, "down", LAYOUTS["mlp_row"], tuple(moe.experts.down_proj.shape), numerics)
    up_value = jnp.asarray(up.place(np.asarray(moe.experts.gate_up_proj[...])))
    down_value = jnp.asarray(down.place(np.asarray(moe.experts.down_proj[...])))
    mesh = build_mesh(parallel)

    def body(up_local, down_local, x, w, i):
        module = TensorParallelExperts(nnx.Param(up_local), nnx.Param(down_local), moe.experts.activation,
                                       CONFIG.num_experts, (up, down), parallel)
        return module(x, w, i, numerics)

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(PartitionSpec(*up.spec), PartitionSpec(*down.spec),
                                                      PartitionSpec(), PartitionSpec(), PartitionSpec()),
                           out_specs=PartitionSpec(), check_vma=False)
    got = jax.jit(mapped)(up_value, down_value, x, weights, ids)
    if numerics == "batch_invariant":
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    else:
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("numerics", ["batch_invariant", "fast"])
def test_row_parallel_projection_matches_one_device(numerics):
    need_devices(4)
    from agentjax.models.layers import Linear

    linear = Linear(64, 48, dtype="float32", rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(2), (13, 64), jnp.float32)
    want = linear(x, numerics)
    parallel = ParallelConfig(tensor_parallel_size=4)
    plan = plan_parameter(None, parallel, "o_proj", LAYOUTS["heads_row"], (64, 48), numerics)
    mesh = build_mesh(parallel)
    heads = PartitionSpec(None, axes("tensor"))

    def body(kernel, x_local):
        return RowParallelLinear(nnx.Param(kernel), plan, parallel)(x_local, numerics)

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(PartitionSpec(*plan.spec), heads), out_specs=PartitionSpec(),
                           check_vma=False)
    got = jax.jit(mapped)(linear.kernel[...], x)
    if numerics == "batch_invariant":
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    else:
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
