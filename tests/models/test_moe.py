"""The MoE block against a float64 numpy per-token reference written from the routing formula."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from agentjax.config import MoEConfig
from agentjax.errors import InvalidRequestError, ModelLoadError, UnsupportedModelError
from agentjax.models.moe import MoE

HIDDEN = 24
NUMERICS = ("fast", "batch_invariant")


# ----------------------------------------------------------------------------- numpy reference

def _activation(cfg: MoEConfig, gate_up: np.ndarray) -> np.ndarray:
    gate, up = np.split(gate_up, 2, axis=-1)
    sigmoid = lambda v: 1.0 / (1.0 + np.exp(-v))  # noqa: E731
    if cfg.activation == "silu":
        return gate * sigmoid(gate) * up
    if cfg.activation == "clamped_swiglu":
        gate = np.minimum(gate, cfg.swiglu_limit)
        return gate * sigmoid(gate) * np.clip(up, -cfg.swiglu_limit, cfg.swiglu_limit)
    if cfg.activation == "gelu_tanh":
        return 0.5 * gate * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (gate + 0.044715 * gate**3))) * up
    if cfg.activation == "swigluoai":
        gate = np.minimum(gate, cfg.swiglu_limit)
        up = np.clip(up, -cfg.swiglu_limit, cfg.swiglu_limit)
        return (up + 1.0) * gate * sigmoid(cfg.swiglu_alpha * gate)
    assert cfg.activation == "situ"
    up = up if cfg.situ_linear_beta is None else cfg.situ_linear_beta * np.tanh(up / cfg.situ_linear_beta)
    return cfg.situ_beta * np.tanh(gate / cfg.situ_beta) * sigmoid(gate) * up


def _choose(cfg: MoEConfig, scores: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    choice = scores + (bias if bias is not None else 0.0)
    if cfg.num_expert_groups > 1:
        grouped = choice.reshape(cfg.num_expert_groups, -1)
        group_scores = np.sort(grouped, axis=-1)[:, -2:].sum(axis=-1)
        kept = np.argsort(-group_scores, kind="stable")[: cfg.topk_groups]
        mask = np.zeros(cfg.num_expert_groups, bool)
        mask[kept] = True
        choice = np.where(np.repeat(mask, grouped.shape[1]), choice, -np.inf)
    return np.argsort(-choice, kind="stable")[: cfg.num_experts_per_token]


def reference_moe(cfg: MoEConfig, p: dict[str, np.ndarray], x: np.ndarray, expert_ids=None) -> np.ndarray:
    """One token at a time, in float64."""
    out = np.zeros_like(x)
    for t, row in enumerate(x):
        logits = row @ p["router.kernel"]
        if cfg.scoring == "softmax":
            scores = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        elif cfg.scoring == "sqrtsoftplus":
            scores = np.sqrt(np.log1p(np.exp(logits)))
        else:
            scores = 1.0 / (1.0 + np.exp(-logits))
        ids = _choose(cfg, scores, p.get("router.selection_bias")) if expert_ids is None else expert_ids[t]
        weights = scores[ids]
        if cfg.renormalize:
            weights = weights / weights.sum()
        weights = weights * cfg.routed_scaling_factor
        expert_in = row @ p["latent_down_proj"] if cfg.latent_size else row
        routed = sum(w * _activation(cfg, expert_in @ p["experts.gate_up_proj"][e]) @ p["experts.down_proj"][e]
                     for w, e in zip(weights, ids))
        if cfg.latent_size:
            if cfg.latent_norm:
                routed = routed / np.sqrt(np.mean(routed**2) + cfg.norm_eps) * p["latent_norm"]
            routed = routed @ p["latent_up_proj"]
        if cfg.num_shared_experts:
            routed = routed + _activation(cfg, row @ p["shared_experts.gate_up_proj"]) @ p["shared_experts.down_proj"]
        out[t] = routed
    return out


# ----------------------------------------------------------------------------- helpers

def make_moe(cfg: MoEConfig, seed: int = 0, bias_scale: float = 0.3, hidden: int = HIDDEN,
             hash_table_rows: int | None = None) -> MoE:
    """A block with every parameter random (the selection bias, latent norm and hash table too), drawn with numpy."""
    moe = nnx.eval_shape(lambda: MoE(hidden, cfg, rngs=nnx.Rngs(0), hash_table_rows=hash_table_rows))
    rng = np.random.default_rng(seed)
    for path, variable in nnx.to_flat_state(nnx.state(moe)):
        shape, dtype = variable.get_value().shape, variable.get_value().dtype
        if path[-1] == "hash_table":
            value = np.stack([rng.permutation(cfg.num_experts)[:shape[1]] for _ in range(shape[0])])
        elif path[-1] == "selection_bias":
            value = rng.standard_normal(shape) * bias_scale
        elif path[-1] == "latent_norm":
            value = 1.0 + 0.5 * rng.standard_normal(shape)
        else:
            value = rng.standard_normal(shape) / np.sqrt(shape[-2])
        variable.set_value(jnp.asarray(value, dtype))
    return moe


def params_of(moe: MoE) -> dict[str, np.ndarray]:
    return {".".join(map(str, path)): np.asarray(v.get_value(), np.float64)
            for path, v in nnx.to_flat_state(nnx.state(moe))}


def tokens(n: int, seed: int = 7, hidden: int = HIDDEN) -> jnp.ndarray:
    return jnp.asarray(np.random.default_rng(seed).standard_normal((n, hidden)), jnp.float32)


@functools.partial(jax.jit, static_argnames=("graphdef", "numerics"))
def _forward(graphdef, state, x, expert_ids, numerics):
    return nnx.merge(graphdef, state)(x, numerics, expert_ids=expert_ids)


def run(moe: MoE, x, numerics: str = "fast", expert_ids=None) -> np.ndarray:
    """The block's output under jit, as a serving step runs it."""
    graphdef, state = nnx.split(moe)
    return np.asarray(_forward(graphdef, state, x, expert_ids, numerics))


def assert_matches_reference(moe: MoE, cfg: MoEConfig, x, numerics: str, expert_ids=None) -> None:
    ours = run(moe, x, numerics, expert_ids)
    ref = reference_moe(cfg, params_of(moe), np.asarray(x, np.float64),
                        None if expert_ids is None else np.asarray(expert_ids))
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=2e-5)


def routed_ids(moe: MoE, x) -> np.ndarray:
    return np.sort(np.asarray(moe.router(x)[1]), axis=-1)


SOFTMAX = MoEConfig(num_experts=8, num_experts_per_token=2, expert_intermediate_size=16)
MINIMAX_LIKE = MoEConfig(num_experts=8, num_experts_per_token=2, expert_intermediate_size=16, num_shared_experts=1,
                         shared_intermediate_size=20, scoring="sigmoid", use_routing_bias=True,
                         routed_scaling_factor=2.0, activation="swigluoai", swiglu_limit=0.8)
GROUPED = MoEConfig(num_experts=16, num_experts_per_token=3, expert_intermediate_size=12, num_shared_experts=2,
                    scoring="sigmoid", use_routing_bias=True, num_expert_groups=4, topk_groups=2,
                    routed_scaling_factor=2.5)
# DeepSeek-V4: sqrt-softplus scores with a selection bias, renormalised, x2.5, one shared expert, SwiGLU with
# clamped inputs (a limit low enough to bind).
DSV4_LIKE = MoEConfig(num_experts=8, num_experts_per_token=2, expert_intermediate_size=16, num_shared_experts=1,
                      scoring="sqrtsoftplus", use_routing_bias=True, routed_scaling_factor=2.5,
                      activation="clamped_swiglu", swiglu_limit=0.5)
KIMI_K3_LIKE = MoEConfig(num_experts=8, num_experts_per_token=2, expert_intermediate_size=16, num_shared_experts=2,
                         scoring="sigmoid", use_routing_bias=True, activation="situ", situ_beta=0.5,
                         situ_linear_beta=1.5, latent_size=12, latent_norm=True)


# ----------------------------------------------------------------------------- routing semantics

@pytest.mark.parametrize("numerics", NUMERICS)
@pytest.mark.parametrize("cfg", [
    SOFTMAX,
    dataclasses.replace(SOFTMAX, renormalize=False, routed_scaling_factor=1.5, activation="gelu_tanh"),
], ids=["renormalized", "raw_scaled_gelu"])
def test_softmax_router_matches_reference(cfg, numerics):
    assert_matches_reference(make_moe(cfg), cfg, tokens(13), numerics)


@pytest.mark.parametrize("numerics", NUMERICS)
def test_sigmoid_router_with_selection_bias_shared_expert_and_scaling_matches_reference(numerics):
    moe, x = make_moe(MINIMAX_LIKE), tokens(13)
    unbiased = make_moe(MINIMAX_LIKE)
    unbiased.router.selection_bias[...] = jnp.zeros(MINIMAX_LIKE.num_experts)
    assert (routed_ids(moe, x) != routed_ids(unbiased, x)).any(), "the bias must change some token's choice"
    assert_matches_reference(moe, MINIMAX_LIKE, x, numerics)


@pytest.mark.parametrize("numerics", NUMERICS)
def test_grouped_top_k_picks_only_from_the_best_groups(numerics):
    moe, x = make_moe(GROUPED), tokens(13)
    ids = np.asarray(moe.router(x, numerics)[1])
    groups_used = {len(set(row // 4)) for row in ids}
    assert max(groups_used) <= GROUPED.topk_groups
    ungrouped = make_moe(dataclasses.replace(GROUPED, num_expert_groups=1, topk_groups=1))
    assert (routed_ids(moe, x) != routed_ids(ungrouped, x)).any(), "grouping must change some token's choice"
    assert_matches_reference(moe, GROUPED, x, numerics)


@pytest.mark.parametrize("numerics", NUMERICS)
def test_latent_moe_with_norm_situ_and_two_shared_experts_matches_reference(numerics):
    assert_matches_reference(make_moe(KIMI_K3_LIKE), KIMI_K3_LIKE, tokens(13), numerics)


@pytest.mark.parametrize("numerics", NUMERICS)
def test_given_expert_ids_replace_the_choice_and_take_weights_from_scores(numerics):
    moe, x = make_moe(MINIMAX_LIKE), tokens(6)
    given = jnp.array([[0, 1], [7, 3], [3, 7], [2, 2], [5, 0], [6, 4]], jnp.int32)
    weights, ids = moe.router(x, numerics, expert_ids=given)
    assert (np.asarray(ids) == np.asarray(given)).all()
    np.testing.assert_allclose(np.asarray(weights).sum(axis=-1), MINIMAX_LIKE.routed_scaling_factor, rtol=1e-6)
    assert_matches_reference(moe, MINIMAX_LIKE, x, numerics, expert_ids=given)


@pytest.mark.parametrize("numerics", NUMERICS)
def test_sqrtsoftplus_router_with_bias_clamped_swiglu_and_shared_expert_matches_reference(numerics):
    moe, x = make_moe(DSV4_LIKE), tokens(13)
    unclamped = dataclasses.replace(DSV4_LIKE, swiglu_limit=1e6)
    assert np.abs(run(moe, x) - reference_moe(unclamped, params_of(moe), np.asarray(x, np.float64))).max() > 1e-3
    assert_matches_reference(moe, DSV4_LIKE, x, numerics)


@pytest.mark.parametrize("numerics", NUMERICS)
def test_hash_routed_block_takes_experts_from_its_table_by_token_id(numerics):
    vocab = 11
    moe, x = make_moe(DSV4_LIKE, hash_table_rows=vocab), tokens(9)
    token_ids = jnp.asarray([3, 0, 10, 3, 7, 5, 5, 1, 9], jnp.int32)
    table = np.asarray(moe.hash_table[...])
    assert moe.hash_table[...].dtype == jnp.int32 and table.shape == (vocab, 2)
    graphdef, state = nnx.split(moe)
    ours = np.asarray(jax.jit(lambda s, x, t: nnx.merge(graphdef, s)(x, numerics, token_ids=t))(state, x, token_ids))
    expected_ids = table[np.asarray(token_ids)]
    learned = make_moe(DSV4_LIKE)  # the same router kernel (same seed), choosing for itself
    assert (np.sort(expected_ids, axis=-1) != routed_ids(learned, x)).any(), "the table must differ from the router"
    assert not hasattr(moe.router, "selection_bias")  # a hash-routed layer never chooses: no bias
    ref = reference_moe(DSV4_LIKE, params_of(moe), np.asarray(x, np.float64), expected_ids)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=2e-5)


def test_hash_routed_block_without_token_ids_is_an_error():
    moe = make_moe(DSV4_LIKE, hash_table_rows=5)
    with pytest.raises(InvalidRequestError, match="token_ids"):
        moe(tokens(2))


# ----------------------------------------------------------------------------- edge cases of the grouping

@pytest.mark.parametrize("numerics", NUMERICS)
def test_most_experts_empty(numerics):
    cfg = dataclasses.replace(GROUPED, num_experts_per_token=1)
    moe, x = make_moe(cfg), tokens(3)
    assert len(set(np.asarray(moe.router(x)[1]).ravel())) <= 3
    assert_matches_reference(moe, cfg, x, numerics)


@pytest.mark.parametrize("numerics", NUMERICS)
def test_all_tokens_on_one_expert(numerics):
    cfg = dataclasses.replace(MINIMAX_LIKE, num_experts_per_token=1)
    moe, x = make_moe(cfg), tokens(11)
    moe.router.selection_bias[...] = jnp.zeros(cfg.num_experts).at[5].set(10.0)
    assert (np.asarray(moe.router(x)[1]) == 5).all()
    assert_matches_reference(moe, cfg, x, numerics)


@pytest.mark.parametrize("numerics", NUMERICS)
def test_top_k_equal_to_num_experts(numerics):
    cfg = dataclasses.replace(MINIMAX_LIKE, num_experts=4, num_experts_per_token=4)
    moe, x = make_moe(cfg), tokens(9)
    assert (routed_ids(moe, x) == np.arange(4)).all()
    assert_matches_reference(moe, cfg, x, numerics)


@pytest.mark.parametrize("numerics", NUMERICS)
@pytest.mark.parametrize("num_tokens", [1, 5, 8, 19])
def test_one_token_and_ragged_token_counts(num_tokens, numerics):
    assert_matches_reference(make_moe(GROUPED), GROUPED, tokens(num_tokens, seed=num_tokens), numerics)


@functools.partial(jax.jit, static_argnames=("graphdef", "numerics"))
def _forward_padded(graphdef, state, x, real_tokens, numerics):
    return nnx.merge(graphdef, state)(x, numerics, real_tokens=real_tokens, with_stats=True)


@pytest.mark.parametrize("impl, numerics", [("reference", "fast"), ("reference", "batch_invariant"),
                                            ("kernel", "fast")])
def test_padding_rows_reach_no_expert(impl, numerics):
    """5 real rows in an 8-row bucket: 5 x k pairs reach the experts (the grouped matmuls' group sizes), the
    real rows' outputs are those of the same rows with the padding routed, the padding rows get the shared
    experts alone. "kernel" runs the Pallas grouped matmul (interpret mode on a CPU)."""
    cfg = MINIMAX_LIKE
    moe = make_moe(cfg)
    moe.experts.impl = impl
    x = tokens(8, seed=3)
    real = jnp.arange(8) < 5
    graphdef, state = nnx.split(moe)
    out, pairs = _forward_padded(graphdef, state, x, real, numerics)
    routed_all, pairs_all = _forward_padded(graphdef, state, x, jnp.ones(8, bool), numerics)
    assert int(pairs) == 5 * cfg.num_experts_per_token and int(pairs_all) == 8 * cfg.num_experts_per_token
    np.testing.assert_array_equal(np.asarray(out)[:5], np.asarray(routed_all)[:5])
    shared_only = np.asarray(moe.shared_experts(x, numerics))[5:]
    np.testing.assert_allclose(np.asarray(out)[5:], shared_only, rtol=1e-6, atol=1e-6)
    ref = reference_moe(cfg, params_of(moe), np.asarray(x, np.float64))
    np.testing.assert_allclose(np.asarray(out)[:5], ref[:5], rtol=1e-4, atol=2e-5)


# ----------------------------------------------------------------------------- numerics and transforms

# Width at which XLA's CPU matmuls already pick their strategy by row count (at 24 they do not).
WIDE = 256


@pytest.mark.parametrize("cfg", [
    dataclasses.replace(GROUPED, expert_intermediate_size=128),
    dataclasses.replace(KIMI_K3_LIKE, expert_intermediate_size=128, latent_size=128),
    dataclasses.replace(SOFTMAX, expert_intermediate_size=128),
], ids=["grouped", "latent", "softmax"])
def test_batch_invariant_row_is_bitwise_equal_alone_and_inside_batches(cfg):
    moe = make_moe(cfg, hidden=WIDE)
    row = tokens(1, seed=99, hidden=WIDE)
    alone = {numerics: run(moe, row, numerics)[0] for numerics in NUMERICS}
    fast_differs = False
    for size in (3, 17, 64):
        for position in (0, size // 2, size - 1):
            batch = np.array(tokens(size, seed=size, hidden=WIDE))
            batch[position] = row[0]
            inside = run(moe, batch, "batch_invariant")[position]
            assert np.array_equal(inside, alone["batch_invariant"]), f"row differs at position {position} of {size}"
            fast_differs |= not np.array_equal(run(moe, batch, "fast")[position], alone["fast"])
    if jax.default_backend() == "cpu":
        assert fast_differs, "fast numerics never differed: these shapes no longer test batch invariance"


def test_fast_path_is_two_grouped_matmuls_without_a_loop_over_experts():
    moe = make_moe(GROUPED)
    eqns = jax.make_jaxpr(lambda x: moe(x))(tokens(5)).jaxpr.eqns
    names = [eqn.primitive.name for eqn in eqns]
    assert names.count("ragged_dot_general") == 2
    assert "scan" not in names and "while" not in names


@pytest.mark.parametrize("numerics", NUMERICS)
def test_jit_matches_eager_and_grad_reaches_exactly_the_chosen_experts(numerics):
    cfg = dataclasses.replace(GROUPED, num_experts_per_token=1)
    moe, x = make_moe(cfg), tokens(3)
    graphdef, state = nnx.split(moe)

    def loss(state, x):
        return jnp.sum(nnx.merge(graphdef, state)(x, numerics) ** 2)

    eager = moe(x, numerics)
    jitted = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, numerics))(state, x)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), rtol=1e-6, atol=1e-6)
    grads = jax.jit(jax.grad(loss))(state, x)
    flat = {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(grads)}
    assert all(np.isfinite(g).all() for g in flat.values())
    chosen = set(np.asarray(moe.router(x)[1]).ravel().tolist())
    touched = {e for e in range(cfg.num_experts) if np.abs(flat["experts.gate_up_proj"][e]).sum() > 0}
    assert touched == chosen
    assert np.abs(flat["router.kernel"]).sum() > 0
    assert np.abs(flat["shared_experts.down_proj"]).sum() > 0


def test_bfloat16_experts_keep_the_input_dtype():
    moe = MoE(HIDDEN, KIMI_K3_LIKE, dtype="bfloat16", rngs=nnx.Rngs(0))
    out = run(moe, tokens(4).astype(jnp.bfloat16))
    assert out.dtype == jnp.bfloat16 and out.shape == (4, HIDDEN) and np.isfinite(out.astype(np.float32)).all()
    assert moe.router.kernel[...].dtype == jnp.float32


# ----------------------------------------------------------------------------- config errors

@pytest.mark.parametrize("changes, error, words", [
    ({"num_experts_per_token": 9}, ModelLoadError, "num_experts_per_token must be in [1, 8]"),
    ({"num_experts_per_token": 0}, ModelLoadError, "num_experts_per_token must be >= 1"),
    ({"num_expert_groups": 3}, ModelLoadError, "num_expert_groups=3 must divide num_experts=8"),
    ({"num_expert_groups": 8}, ModelLoadError, "two best experts"),
    ({"num_expert_groups": 4, "topk_groups": 5}, ModelLoadError, "topk_groups must be in [1, 4]"),
    ({"num_expert_groups": 4, "topk_groups": 1, "num_experts_per_token": 3}, ModelLoadError, "[1, 2]"),
    ({"scoring": "sqrt_softplus"}, UnsupportedModelError, "'sqrt_softplus'"),
    ({"activation": "relu2"}, UnsupportedModelError, "'relu2'"),
    ({"swiglu_limit": 0.0}, ModelLoadError, "swiglu_limit must be > 0"),
    ({"latent_norm": True}, ModelLoadError, "latent_norm needs a latent_size"),
    ({"num_shared_experts": 1, "shared_intermediate_size": 0}, ModelLoadError, "shared_intermediate_size"),
])
def test_config_rejects_out_of_range_values_by_name(changes, error, words):
    with pytest.raises(error) as raised:
        dataclasses.replace(SOFTMAX, **changes)
    assert words in str(raised.value)


def test_shared_size_defaults_to_expert_width_times_count():
    assert GROUPED.shared_size == 24
    assert MINIMAX_LIKE.shared_size == 20
    assert SOFTMAX.shared_size == 0


def test_every_scoring_the_config_accepts_has_its_router_function():
    from agentjax.layer_configs import MOE_SCORINGS
    from agentjax.models.moe import SCORING_FUNCTIONS

    assert tuple(SCORING_FUNCTIONS) == MOE_SCORINGS
