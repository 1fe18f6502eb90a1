"""The mixture-of-experts feed-forward block (MiniMax-M3, Kimi, later DeepSeek-V4) and its router.

`MoE(x)` routes each token to its top-k experts, runs the routed experts as one grouped matmul
(`jax.lax.ragged_dot` over the token-expert pairs sorted by expert) and adds the shared experts.
It never loops over experts in Python, and in "batch_invariant" numerics a token's output never
depends on the other tokens of the batch. A pure function of its inputs and parameters.

Routing (transformers 5.24.0's MiniMaxM3VLTopKRouter and KimiLinearTopkRouter, in float32):
`logits = x @ router.kernel`; `scores = softmax(logits)` or `sigmoid(logits)`; experts are chosen by
`scores + router.selection_bias` (DeepSeek-V3's `e_score_correction_bias`, used for choosing only),
restricted with grouped top-k to the `topk_groups` groups whose two best biased scores sum highest;
the weights are the UNBIASED scores of the chosen experts, divided by their sum (+1e-20) when
`renormalize`, times `routed_scaling_factor` (Kimi scales the weights, MiniMax the summed output:
the same up to rounding). The routed sum is `sum_j weight_j * down_e(act(x @ gate_up_e))`; shared
experts see the block's input and are added last. Kimi-K3's latent MoE (vLLM `KimiMoE`) runs the
routed experts in a latent space: `up(norm(routed(down(x))))`, the router and the shared experts
still reading `x`. A caller may pass `expert_ids` instead of letting the router choose; DeepSeek-V4's hash-routed
layers (`MoE(..., hash_table_rows=vocab)`) hold the table `hash_table [vocab, k]` (int32, HF
`gate.tid2eid`) and take their expert ids from it by token id, weights from the scores as above.
DeepSeek-V4's `sqrtsoftplus` (sqrt(softplus(logits))) is one more entry of `SCORING_FUNCTIONS`, and
its experts and shared expert use "clamped_swiglu" (activations.py).

Parameters (H hidden, D = latent_size or H, L latent_size, E experts, I expert_intermediate_size,
S shared size). Kernels are stored [in, out]; a fused gate_up holds the gate in its first half.
  router.kernel [H, E] f32        MiniMax `mlp.gate.weight` [E, H].T;  Kimi `gate.weight` [E, H].T
  router.selection_bias [E] f32   MiniMax `mlp.gate.e_score_correction_bias`;  Kimi `gate.e_score_correction_bias`
  experts.gate_up_proj [E, D, 2I] MiniMax `mlp.experts.gate_up_proj` [E, 2I, H].transpose(0, 2, 1);
                                  Kimi stack over e of concat([experts.{e}.w1.weight.T, experts.{e}.w3.weight.T], 1)
  experts.down_proj [E, I, D]     MiniMax `mlp.experts.down_proj` [E, H, I].transpose(0, 2, 1);
                                  Kimi stack over e of experts.{e}.w2.weight [D, I].T
  shared_experts.gate_up_proj [H, 2S]  MiniMax `mlp.shared_experts.gate_up_proj.weight` [2S, H].T;
                                  Kimi concat([shared_experts.gate_proj.weight.T, shared_experts.up_proj.weight.T], 1)
  shared_experts.down_proj [S, H] MiniMax `mlp.shared_experts.down_proj.weight` [H, S].T;  Kimi the same name, .T
  latent_down_proj [H, L], latent_norm [L], latent_up_proj [L, H]  (Kimi-K3 only)
                                  `routed_expert_down_proj.weight` [L, H].T, `routed_expert_norm.weight`,
                                  `routed_expert_up_proj.weight` [H, L].T
MiniMax names are under `model.layers.{i}.` as a minimax_m3_vl_text checkpoint saves them; a
minimax_m3_vl one saves `language_model.model.layers.{i}.block_sparse_moe.` with Kimi's per-expert
w1/w2/w3 and shared gate_proj/up_proj, and its bias as `block_sparse_moe.e_score_correction_bias`.
Kimi names are under `model.layers.{i}.block_sparse_moe.`. Config: MiniMax num_local_experts, num_experts_per_tok,
intermediate_size, shared_intermediate_size (one shared MLP), sigmoid + bias, routed_scaling_factor,
"swigluoai"; Kimi num_experts, num_experts_per_token, moe_intermediate_size, num_shared_experts
(S = moe_intermediate_size * num_shared_experts), sigmoid + bias, num_expert_group, topk_group,
moe_renormalize, routed_scaling_factor, hidden_act; K3 routed_expert_hidden_size, latent_moe_use_norm.

Bucket padding: `real_tokens` (a [tokens] mask; the decoder passes `real_token_mask(batch)`) routes
each padding row to no expert: its pairs get the id `num_experts` and weight 0, so they add nothing to
any expert's group size, sort past every group (the grouped matmuls, `ragged_dot` and the Pallas
kernel, give those rows zeros without a multiply) and the block's output there is the shared experts'
alone. `routed_pairs` counts the token-expert pairs a call hands to the expert matmuls.

Cost: on CPU, jax lowers ragged_dot to a masked dense dot (E times the FLOPs of the grouped one);
on GPU and TPU to XLA's ragged_dot instruction (not measured here). With `impl="kernel"` (the model's
attention_impl) the fast path runs `agentjax.kernels.grouped_matmul`'s Pallas kernel instead. The batch-invariant path gathers each token's k expert matrices per
fixed row block: right for CPU tests and exactness checks, not for full-size throughput.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from agentjax import kernels
from agentjax.errors import InvalidRequestError
from agentjax.layer_configs import MoEConfig
from agentjax.models.activations import GatedActivation
from agentjax.models.layers import dense, map_row_blocks
from agentjax.models.quantized import grouped_operand, take_experts

# Router scores from logits, one per name of `MOE_SCORINGS` (names as HF configs spell them).
SCORING_FUNCTIONS = {
    "softmax": lambda logits: jax.nn.softmax(logits, axis=-1),
    "sigmoid": jax.nn.sigmoid,
    "sqrtsoftplus": lambda logits: jnp.sqrt(jax.nn.softplus(logits)),
}

# Added to the sum of the chosen weights before renormalising, as transformers' Kimi and
# DeepSeek routers do (MiniMax adds nothing; the same in float32 unless the sum is below ~1e-13).
_RENORMALIZE_EPSILON = 1e-20


def gated_activation(config: MoEConfig) -> GatedActivation:
    """The experts' gated activation with the config's constants."""
    return GatedActivation(config.activation, config.swiglu_alpha, config.swiglu_limit,
                           config.situ_beta, config.situ_linear_beta)


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, fan_in: int) -> Array:
    return (jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)


def _in_row_blocks(fn, numerics: str, *arrays: Array) -> Array:
    """`fn(*arrays)` on rows; in "batch_invariant" numerics over fixed blocks of rows."""
    return map_row_blocks(fn, *arrays) if numerics == "batch_invariant" else fn(*arrays)


def expert_group_sizes(expert_ids: Int[Array, "..."], num_experts: int) -> Int[Array, " experts"]:
    """How many token-expert pairs each expert receives; ids outside [0, num_experts) (padding) count nowhere."""
    return jnp.bincount(expert_ids.reshape(-1), length=num_experts).astype(jnp.int32)


def routed_pairs(expert_ids: Int[Array, "tokens k"], num_experts: int) -> Int[Array, ""]:
    """The token-expert pairs sent to the expert matmuls: the sum of the experts' group sizes."""
    return expert_group_sizes(expert_ids, num_experts).sum()


def _weighted_sum(per_pair: Float[Array, "tokens k d"], weights: Float[Array, "tokens k"]) -> Array:
    """`sum_j weights[:, j] * per_pair[:, j]`, accumulated in float32."""
    return jnp.sum(per_pair.astype(jnp.float32) * weights[..., None], axis=1).astype(per_pair.dtype)


class TopKRouter(nnx.Module):
    """Scores experts per token and picks its top-k (optionally biased, optionally grouped)."""

    def __init__(self, hidden_size: int, config: MoEConfig, *, rngs: nnx.Rngs, chooses: bool = True):
        """`chooses=False`: the experts always come from the caller (hash routing), so no selection bias."""
        self.kernel = nnx.Param(_normal(rngs, (hidden_size, config.num_experts), jnp.float32, hidden_size))
        if config.use_routing_bias and chooses:
            self.selection_bias = nnx.Param(jnp.zeros((config.num_experts,), jnp.float32))
        self.config = config

    def __call__(
        self, x: Float[Array, "tokens hidden"], numerics: str = "fast", *,
        expert_ids: Int[Array, "tokens k"] | None = None,
    ) -> tuple[Float[Array, "tokens k"], Int[Array, "tokens k"]]:
        """Per-token expert weights (float32) and expert ids; given `expert_ids` are kept as they are."""
        logits = dense(x.astype(jnp.float32), self.kernel[...], numerics)
        if expert_ids is None:
            expert_ids = _in_row_blocks(self.choose_experts, numerics, logits)
        weights = _in_row_blocks(self.expert_weights, numerics, logits, expert_ids.astype(jnp.int32))
        return weights, expert_ids

    def scores(self, logits: Float[Array, "tokens experts"]) -> Float[Array, "tokens experts"]:
        return SCORING_FUNCTIONS[self.config.scoring](logits)

    def choose_experts(self, logits: Float[Array, "tokens experts"]) -> Int[Array, "tokens k"]:
        cfg = self.config
        choice = self.scores(logits)
        if cfg.use_routing_bias:
            choice = choice + self.selection_bias[...]
        if cfg.num_expert_groups > 1:
            per_group = cfg.num_experts // cfg.num_expert_groups
            grouped = choice.reshape(choice.shape[0], cfg.num_expert_groups, per_group)
            group_scores = jax.lax.top_k(grouped, 2)[0].sum(axis=-1)
            best_groups = jax.lax.top_k(group_scores, cfg.topk_groups)[1]
            kept_group = jax.nn.one_hot(best_groups, cfg.num_expert_groups, dtype=jnp.int32).sum(axis=1) > 0
            choice = jnp.where(jnp.repeat(kept_group, per_group, axis=1), choice, -jnp.inf)
        return jax.lax.top_k(choice, cfg.num_experts_per_token)[1].astype(jnp.int32)

    def expert_weights(self, logits: Float[Array, "tokens experts"], expert_ids: Int[Array, "tokens k"]
                       ) -> Float[Array, "tokens k"]:
        cfg = self.config
        weights = jnp.take_along_axis(self.scores(logits), expert_ids, axis=-1)
        if cfg.renormalize:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + _RENORMALIZE_EPSILON)
        return weights * cfg.routed_scaling_factor


class RoutedExperts(nnx.Module):
    """The routed experts' weights as [E, ...] arrays, applied to each token's chosen experts."""

    def __init__(self, input_size: int, config: MoEConfig, *, dtype: str, rngs: nnx.Rngs, impl: str = "reference"):
        """`impl="kernel"`: the fast path's grouped matmuls run `agentjax.kernels.grouped_matmul`'s kernel."""
        experts, inner = config.num_experts, config.expert_intermediate_size
        self.gate_up_proj = nnx.Param(_normal(rngs, (experts, input_size, 2 * inner), dtype, input_size))
        self.down_proj = nnx.Param(_normal(rngs, (experts, inner, input_size), dtype, inner))
        self.activation = gated_activation(config)
        self.num_experts = experts
        self.impl = impl

    def __call__(
        self, x: Float[Array, "tokens d"], weights: Float[Array, "tokens k"],
        expert_ids: Int[Array, "tokens k"], numerics: str = "fast",
    ) -> Float[Array, "tokens d"]:
        if numerics == "batch_invariant":
            return map_row_blocks(self._gathered, x, weights, expert_ids)
        return self._grouped(x, weights, expert_ids)

    def _grouped(self, x: Array, weights: Array, expert_ids: Array) -> Array:
        """One ragged_dot per projection over the token-expert pairs sorted by expert."""
        tokens, k = expert_ids.shape
        flat_ids = expert_ids.reshape(-1)
        order = jnp.argsort(flat_ids, stable=True)
        group_sizes = expert_group_sizes(flat_ids, self.num_experts)
        pair_rows = x[order // k]
        if isinstance(self.impl, str) and kernels.resolve_attention_impl(self.impl) == "kernel":
            matmul = functools.partial(kernels.grouped_matmul, impl="kernel")
            # FP8 experts reach the kernel as FP8 (agentjax.models.quantized); other stored formats decode here
            gate_up_weights, down_weights = (grouped_operand(p.get_value()) for p in (self.gate_up_proj, self.down_proj))
        else:  # "reference"
            matmul = jax.lax.ragged_dot
            gate_up_weights, down_weights = self.gate_up_proj[...], self.down_proj[...]
        gate_up = matmul(pair_rows, gate_up_weights, group_sizes)
        out_sorted = matmul(self.activation.on_fused(gate_up), down_weights, group_sizes)
        per_pair = jnp.zeros_like(out_sorted).at[order].set(out_sorted)
        return _weighted_sum(per_pair.reshape(tokens, k, -1), weights)

    def _gathered(self, x: Array, weights: Array, expert_ids: Array) -> Array:
        """Each row against its own k gathered expert matrices: no arithmetic shared between rows. A
        padding row (id `num_experts`, weight 0) still multiplies inside its fixed row block: the block's
        shape is what keeps a row's arithmetic independent of the batch."""
        expert_ids = jnp.minimum(expert_ids, self.num_experts - 1)
        gate_up = jnp.einsum("bd,bkdn->bkn", x, take_experts(self.gate_up_proj.get_value(), expert_ids))
        per_pair = jnp.einsum("bki,bkid->bkd", self.activation.on_fused(gate_up),
                              take_experts(self.down_proj.get_value(), expert_ids))
        return _weighted_sum(per_pair, weights)


class GatedFeedForward(nnx.Module):
    """`down(act(x @ gate_up))` with a fused [gate | up] kernel: the shared experts as one MLP."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: GatedActivation, *,
                 dtype: str, rngs: nnx.Rngs):
        self.gate_up_proj = nnx.Param(_normal(rngs, (hidden_size, 2 * intermediate_size), dtype, hidden_size))
        self.down_proj = nnx.Param(_normal(rngs, (intermediate_size, hidden_size), dtype, intermediate_size))
        self.activation = activation

    def __call__(self, x: Float[Array, "tokens hidden"], numerics: str = "fast") -> Float[Array, "tokens hidden"]:
        def feed_forward(rows: Array) -> Array:
            return self.activation.on_fused(rows @ self.gate_up_proj[...]) @ self.down_proj[...]

        return _in_row_blocks(feed_forward, numerics, x)


def _rms_norm(x: Array, weight: Array, eps: float, numerics: str) -> Array:
    """Kimi's RMSNorm: normalise in float32, back to the input dtype, then scale by `weight`."""
    def normalize(rows: Array) -> Array:
        x32 = rows.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        return (weight * normed.astype(rows.dtype)).astype(rows.dtype)

    return _in_row_blocks(normalize, numerics, x)


def _random_hash_table(rngs: nnx.Rngs, rows: int, config: MoEConfig) -> Array:
    """`k` distinct experts per token id, drawn uniformly (for random presets; checkpoints give theirs)."""
    keys = jax.random.uniform(rngs.params(), (rows, config.num_experts))
    return jnp.argsort(keys, axis=-1)[:, :config.num_experts_per_token].astype(jnp.int32)


class MoE(nnx.Module):
    """Router, routed experts (optionally in a latent space) and shared experts of one layer; with
    `hash_table_rows`, a token-id -> experts table chooses the experts instead of the router."""

    def __init__(self, hidden_size: int, config: MoEConfig, *, dtype: str = "float32", rngs: nnx.Rngs,
                 hash_table_rows: int | None = None, impl: str = "reference"):
        self.router = TopKRouter(hidden_size, config, rngs=rngs, chooses=hash_table_rows is None)
        if hash_table_rows is not None:
            self.hash_table = nnx.Param(_random_hash_table(rngs, hash_table_rows, config))
        self.hashed = hash_table_rows is not None
        expert_width = hidden_size
        if config.latent_size is not None:
            expert_width = config.latent_size
            self.latent_down_proj = nnx.Param(_normal(rngs, (hidden_size, expert_width), dtype, hidden_size))
            if config.latent_norm:
                self.latent_norm = nnx.Param(jnp.ones((expert_width,), dtype))
            self.latent_up_proj = nnx.Param(_normal(rngs, (expert_width, hidden_size), dtype, expert_width))
        self.experts = RoutedExperts(expert_width, config, dtype=dtype, rngs=rngs, impl=impl)
        if config.num_shared_experts:
            self.shared_experts = GatedFeedForward(hidden_size, config.shared_size, gated_activation(config),
                                                   dtype=dtype, rngs=rngs)
        self.config = config

    def __call__(
        self, x: Float[Array, "tokens hidden"], numerics: str = "fast", *,
        token_ids: Int[Array, " tokens"] | None = None, expert_ids: Int[Array, "tokens k"] | None = None,
        real_tokens: Array | None = None, with_stats: bool = False,
    ):
        """The block's output for each token; `expert_ids` (in [0, E)) replaces the router's choice, and a
        hash-routed block looks them up by `token_ids` (required there). `real_tokens` ([tokens] bool):
        rows where it is False are bucket padding and reach no expert. With `with_stats`, returns
        `(output, routed_pairs)`: the token-expert pairs sent to the expert matmuls."""
        cfg = self.config
        if self.hashed and expert_ids is None:
            if token_ids is None:
                raise InvalidRequestError("a hash-routed MoE layer needs the token_ids of its rows (got None)")
            expert_ids = jnp.take(self.hash_table[...], token_ids, axis=0)
        weights, expert_ids = self.router(x, numerics, expert_ids=expert_ids)
        if real_tokens is not None:
            expert_ids = jnp.where(real_tokens[:, None], expert_ids, cfg.num_experts)
            weights = jnp.where(real_tokens[:, None], weights, jnp.zeros((), weights.dtype))
        routed_input = x
        if cfg.latent_size is not None:
            routed_input = dense(x, self.latent_down_proj[...], numerics)
        out = self.experts(routed_input, weights, expert_ids, numerics)
        if cfg.latent_size is not None:
            if cfg.latent_norm:
                out = _rms_norm(out, self.latent_norm[...], cfg.norm_eps, numerics)
            out = dense(out, self.latent_up_proj[...], numerics)
        if cfg.num_shared_experts:
            out = out + self.shared_experts(x, numerics)
        return (out, routed_pairs(expert_ids, cfg.num_experts)) if with_stats else out
