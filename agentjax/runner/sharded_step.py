"""The sharded step: one `shard_map` over the layout's mesh around the per-device model, jitted with the
KV buffers donated.

Inputs that differ per data rank (the ragged batch, sampling metadata, penalty and prompt-logprob
inputs) carry a leading `[data]` axis split over the `data` role and are replicated over the other
roles; parameters follow their layouts (sharding/layouts.py); each KV buffer is one array per device,
stacked on a leading device axis. Inside, the step is `agentjax.runner.step.sampling_step_function`
over the local model, so sampling, penalties and log probabilities are the single-device code.
PCP splits the batch's tokens per rank before the model and gathers the hidden states after it.
Runtime code of the runner (agentjax/runner/sharded_runner.py drives it); the layout rules it follows stay in
sharding/.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from agentjax.kernels import resolve_attention_impl
from agentjax.kv_buffers import DeviceLayout, KVPool
from agentjax.runner.step import sampling_step_function
from sharding.attention import ParallelAttentionOps, select_rank_tokens, unpermute_tokens
from sharding.layouts import local_kv_buffer_specs
from sharding.mesh import ParallelConfig, axes
from sharding.modules import build_local_model, local_specs


class ShardedStep:
    """The layout's mesh, the per-device model and its compiled steps (one per sampling variant)."""

    def __init__(self, cfg, parallel: ParallelConfig, mesh, numerics: str):
        self.cfg, self.parallel, self.mesh, self.numerics = cfg, parallel, mesh, numerics
        impl = None
        if parallel.role_size("tensor") > 1 or parallel.role_size("dcp") > 1 or parallel.role_size("pcp") > 1:
            context_parallel = parallel.role_size("dcp") > 1 or parallel.role_size("pcp") > 1
            base = resolve_attention_impl(cfg.attention_impl, context_parallel=context_parallel)  # "auto" chosen here
            impl = ParallelAttentionOps(base, parallel, cfg.num_heads, cfg.num_kv_heads,
                                        cfg.block_sparse.index_num_heads if cfg.block_sparse else 0,
                                        invariant=numerics == "batch_invariant")
        self.graphdef, state, self.plans = build_local_model(cfg, parallel, numerics, attention_impl=impl)
        self.param_specs = local_specs(state, self.plans)

    def device_sharding(self) -> NamedSharding:
        """Per-device buffers: a leading axis over every device."""
        return NamedSharding(self.mesh, PartitionSpec(axes("device")))

    def data_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec(axes("data")))

    def new_kv_pages(self, num_pages: int, page_size: int, kv_layout=None):
        """Zeroed KV buffers: per group `[devices, slots, pages, *local page shape]`; with a "pool"
        `kv_layout`, one pool `[devices, slabs, local slab words]` of the devices' parts of it."""
        devices = self.parallel.num_devices
        if kv_layout is not None and kv_layout.mode == "pool":
            local = self.local_kv_layout(kv_layout)
            shape = (devices, local.num_slabs, local.slab_words)
            zeros = jax.jit(functools.partial(jnp.zeros, shape, local.dtype), out_shardings=self.device_sharding())
            return KVPool(zeros(), DeviceLayout.of(local))
        buffers = []
        for spec in local_kv_buffer_specs(self.cfg, self.parallel, page_size):
            shape = (devices, spec.num_slots, num_pages, *spec.page_shape)
            zeros = jax.jit(functools.partial(jnp.zeros, shape, spec.dtype), out_shardings=self.device_sharding())
            buffers.append(zeros())
        return tuple(buffers)

    def local_kv_layout(self, kv_layout):
        """One device's part of a "pool" layout (agentjax/kv/layout_build.py `local_layout`)."""
        from agentjax.kv.layout_build import local_layout
        from sharding.layouts import local_model_config

        return local_layout(kv_layout, local_model_config(self.cfg, self.parallel),
                            self.parallel.decode_context_parallel_size)

    def forward(self, params, kv_pages: tuple, batch, pcp_tokens=None):
        """The per-device forward: `(hidden of every token of the batch, kv_pages)`."""
        model = nnx.merge(self.graphdef, params)
        if pcp_tokens is None:
            return model(kv_pages, batch, self.numerics)
        local_batch = select_rank_tokens(self.parallel, batch, pcp_tokens)
        hidden, kv_pages = model(kv_pages, local_batch, self.numerics)
        return unpermute_tokens(self.parallel, hidden, pcp_tokens, batch.num_tokens), kv_pages

    def logits(self, params, hidden):
        return nnx.merge(self.graphdef, params).logits(hidden, self.numerics)

    @functools.lru_cache(maxsize=32)
    def sampling_step(self, greedy_only: bool, penalties: bool = False, logprobs_mode: str | None = None,
                      prompt_logprobs: bool = False):
        """Jitted `(params, kv, batch, sampling[, penalties, prompt_inputs], pcp_tokens) -> (tokens[, aux], kv)`,
        every per-row input and output with a leading `[data]` axis; kv donated."""
        extended = penalties or logprobs_mode is not None or prompt_logprobs
        uses_pcp = self.parallel.prefill_context_parallel_size > 1

        def per_device(params, kv_pages, stacked, pcp_tokens):
            kv_pages = jax.tree.map(lambda buffer: buffer[0], kv_pages)  # this device's buffers (or pool)
            inputs = jax.tree.map(lambda a: a[0], stacked)
            tokens_of_rank = pcp_tokens[0] if uses_pcp else None
            forward = functools.partial(self._forward_with_tokens, pcp_tokens=tokens_of_rank)
            step = sampling_step_function(forward, self.logits, greedy_only, penalties=penalties,
                                          logprobs_mode=logprobs_mode, prompt_logprobs=prompt_logprobs)
            out = step(params, kv_pages, *inputs)
            *results, kv_pages = out
            results = jax.tree.map(lambda a: a[None], tuple(results))
            return (*results, jax.tree.map(lambda buffer: buffer[None], kv_pages))

        data = PartitionSpec(axes("data"))
        device = PartitionSpec(axes("device"))
        pcp_spec = PartitionSpec(axes("pcp")) if uses_pcp else PartitionSpec()
        num_results = 2 if extended else 1

        def run(params, kv_pages, stacked, pcp_tokens):
            kv_specs = jax.tree.map(lambda _: device, kv_pages)
            in_specs = (self.param_specs, kv_specs, jax.tree.map(lambda _: data, stacked), pcp_spec)
            out_specs = (*([data] * num_results), kv_specs)
            mapped = jax.shard_map(per_device, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                                   check_vma=False)
            return mapped(params, kv_pages, stacked, pcp_tokens)

        return jax.jit(run, donate_argnums=(1,))

    def _forward_with_tokens(self, params, kv_pages, batch, *, pcp_tokens):
        return self.forward(params, kv_pages, batch, pcp_tokens)


def stack_for_data(trees: list):
    """Per-data-rank pytrees of equal shapes as one pytree with a leading `[data]` axis (host numpy)."""
    return jax.tree.map(lambda *leaves: np.stack([np.asarray(leaf) for leaf in leaves]), *trees)


def lowered_step_text(cfg, parallel: ParallelConfig, numerics: str, rank_rows: list, *, page_size: int = 16,
                      num_pages: int = 64, mesh=None) -> str:
    """The lowered StableHLO of one greedy step over `rank_rows` (one row list per data rank, as
    `ModelRunner.execute` takes rows), with abstract parameters and KV buffers: nothing is allocated,
    so full-size models lower too."""
    from agentjax.kv.cache_layout import state_group_ids
    from agentjax.ragged_batch import RaggedBatch
    from agentjax.runner.sampler import SamplingMetadata
    from sharding.attention import pcp_token_split
    from sharding.mesh import build_mesh

    mesh = mesh if mesh is not None else build_mesh(parallel)
    sharded = ShardedStep(cfg, parallel, mesh, numerics)
    def abstract(spec, plan):
        return jax.ShapeDtypeStruct(plan.placed_shape, _dtype_of(cfg, plan), sharding=NamedSharding(mesh, spec))

    params = jax.tree.map(abstract, sharded.param_specs, _plan_tree(sharded),
                          is_leaf=lambda x: isinstance(x, PartitionSpec))
    kv = tuple(jax.ShapeDtypeStruct((parallel.num_devices, spec.num_slots, num_pages, *spec.page_shape), spec.dtype,
                                    sharding=sharded.device_sharding())
               for spec in local_kv_buffer_specs(cfg, parallel, page_size))
    groups = state_group_ids(cfg)
    batches = [RaggedBatch.build(rows, page_size, state_groups=groups) for rows in rank_rows]
    metas = [SamplingMetadata.greedy(b.num_seqs, cfg.vocab_size) for b in batches]
    pcp = parallel.prefill_context_parallel_size
    tokens = (pcp_token_split(batches[0].cu_q_lens, batches[0].num_tokens, pcp) if pcp > 1
              else np.zeros((1,), np.int32))
    step = sharded.sampling_step(True)
    return step.lower(params, kv, stack_for_data(list(zip(batches, metas))), tokens).as_text()


def _plan_tree(sharded: ShardedStep):
    """The parameter plans as a state-shaped pytree (leaves: ParamPlan)."""
    flat = [(path, variable.replace(value=sharded.plans[path])) for path, variable in nnx.to_flat_state(
        sharded.param_specs)]
    return nnx.from_flat_state(flat)


def _dtype_of(cfg, plan) -> str:
    return "int32" if plan.name.endswith("hash_table") else cfg.dtype
