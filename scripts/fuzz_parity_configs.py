"""The random configurations and weights of `scripts/fuzz_parity.py`, one distribution per family.

Runs in the transformers environment (never in the project's tests). `draw(family, seed)` gives the
transformers config fields of one tiny model, the prompt length and the prefill chunk; `build(draw)`
makes the model with transformers' own initialisation at the drawn `initializer_range` and then
gives the tensors transformers leaves at zero or one (norm weights, biases, sinks, compressor position
biases, mHC bases and scales, routing biases, hash tables, KDA decay parameters) random values, so
every feature moves the output; MTP modules (which transformers does not build) are added in the
upstream spelling. The distributions are fixed here: changing one changes what a seed means.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

import dsv4_fixtures
import fixture_weights

FAMILIES = ("deepseek-v4", "kimi-linear", "minimax-m3")
# Fuzzed configs that exposed a bug, kept as test fixtures (scripts/make_model_fixtures.py writes them to
# tests/models/data/<name>): name -> (family, config seed).
FIXTURES = {
    "fuzz-deepseek-v4-41": ("deepseek-v4", 41),  # norm_topk_prob=false (transformers renormalises anyway)
    "fuzz-kimi-linear-3": ("kimi-linear", 3),  # tie_word_embeddings=true (never tied) and no shared experts
    "fuzz-minimax-m3-7": ("minimax-m3", 7),  # YaRN RoPE (the loader refused it)
}
DSV4_KINDS = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")


@dataclass
class Draw:
    family: str
    seed: int
    fields: dict  # the transformers config's keyword arguments
    prompt_len: int
    chunk: int  # prefill chunk of agentjax's chunked run
    wrapper: bool = False  # MiniMax-M3: saved through the VL wrapper
    mtp: int = 0
    notes: dict = field(default_factory=dict)


def _prompt_len(rng: random.Random) -> int:
    """1..2000 tokens: a quarter short (1..64), the rest log-uniform over 16..2000."""
    if rng.random() < 0.25:
        return rng.randint(1, 64)
    return int(round(math.exp(rng.uniform(math.log(16), math.log(2000)))))


def _common(rng: random.Random) -> dict:
    vocab = rng.choice([256, 512, 1000])
    special = rng.random() < 0.5
    return dict(vocab_size=vocab, initializer_range=round(rng.uniform(0.02, 0.1), 4),
                rms_norm_eps=rng.choice([1e-6, 1e-5]), tie_word_embeddings=rng.random() < 0.3,
                bos_token_id=0 if special else None, eos_token_id=1 if special else None,
                pad_token_id=vocab - 1 if special and rng.random() < 0.5 else None)


def _yarn(rng: random.Random) -> dict:
    return {"rope_type": "yarn", "factor": rng.choice([2.0, 4.0, 8.0, 16.0]),
            "original_max_position_embeddings": rng.choice([32, 64, 128, 256]),
            "beta_fast": rng.choice([16.0, 32.0]), "beta_slow": rng.choice([1.0, 2.0])}


def draw_deepseek_v4(rng: random.Random) -> dict:
    layers = rng.randint(2, 5)
    kinds = [rng.choice(DSV4_KINDS) for _ in range(layers)]
    heads = rng.choice([2, 4, 6, 8])
    head_dim = rng.choice([16, 32, 64])
    rotary = rng.choice([0.25, 0.5])
    experts = rng.choice([4, 8, 16])
    hashed = rng.randint(0, min(3, layers))
    return dict(
        hidden_size=rng.choice([32, 48, 64, 96]), num_hidden_layers=layers, layer_types=kinds,
        compress_rates={"compressed_sparse_attention": rng.choice([2, 4, 8]),
                        "heavily_compressed_attention": rng.choice([8, 16, 32, 64])},
        mlp_layer_types=["hash_moe"] * hashed + ["moe"] * (layers - hashed),
        num_attention_heads=heads, num_key_value_heads=1, head_dim=head_dim,
        partial_rotary_factor=rotary, q_lora_rank=rng.choice([16, 32, 48]),
        o_groups=rng.choice([g for g in (1, 2, 3, 4) if heads % g == 0]), o_lora_rank=rng.choice([8, 16, 32]),
        sliding_window=rng.choice([4, 8, 16, 32, 64]), index_n_heads=rng.choice([1, 2, 4, 8]),
        # the indexer rotates its last rotary channels: its heads are at least that wide
        index_head_dim=rng.choice([d for d in (8, 16, 32) if d >= head_dim * rotary]), index_topk=rng.randint(1, 16),
        n_routed_experts=experts, n_shared_experts=1, num_experts_per_tok=rng.randint(1, min(4, experts)),
        moe_intermediate_size=rng.choice([8, 16, 32]), scoring_func=rng.choice(["sqrtsoftplus", "sigmoid"]),
        norm_topk_prob=rng.random() < 0.8, routed_scaling_factor=rng.choice([1.0, 1.5, 2.5]),
        swiglu_limit=rng.choice([0.5, 2.0, 10.0, 100.0]), hc_mult=rng.randint(1, 4),
        hc_sinkhorn_iters=rng.randint(1, 20), hc_eps=rng.choice([1e-6, 1e-4]),
        rope_theta=rng.choice([10000.0, 50000.0]), compress_rope_theta=rng.choice([40000.0, 160000.0]),
        rope_parameters=_yarn(rng) if rng.random() < 0.5 else None, max_position_embeddings=4096,
        hidden_act="silu",
    )


def draw_kimi_linear(rng: random.Random) -> dict:
    layers = rng.randint(2, 5)
    # at least one MLA layer: transformers' generate cannot run a KDA-only model (its cache has no length)
    full = sorted(rng.sample(range(1, layers + 1), rng.randint(1, layers)))
    heads = rng.choice([1, 2, 3, 4])
    experts = rng.choice([4, 8, 16])
    groups = rng.choice([g for g in (1, 2, 4) if experts // g >= 2])
    topk_group = rng.randint(1, groups)
    choosable = topk_group * experts // groups
    dense = rng.randint(0, layers)
    return dict(
        hidden_size=rng.choice([32, 48, 64, 80]), intermediate_size=rng.choice([32, 64, 128]),
        moe_intermediate_size=rng.choice([8, 16, 32]), num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads, q_lora_rank=rng.choice([None, 16, 32]), kv_lora_rank=rng.choice([16, 32, 48]),
        qk_nope_head_dim=rng.choice([8, 16, 24]), qk_rope_head_dim=rng.choice([4, 8, 16]),
        v_head_dim=rng.choice([8, 16, 24]),
        linear_attn_config={"kda_layers": [i for i in range(1, layers + 1) if i not in full], "full_attn_layers": full,
                            "num_heads": rng.choice([1, 2, 3]), "head_dim": rng.choice([8, 16, 32]),
                            "short_conv_kernel_size": rng.choice([2, 3, 4])},
        mlp_layer_types=["dense"] * dense + ["sparse"] * (layers - dense),
        num_experts=experts, num_experts_per_token=rng.randint(1, min(4, choosable)),
        num_shared_experts=rng.choice([0, 1, 2]), num_expert_group=groups, topk_group=topk_group,
        routed_scaling_factor=rng.choice([1.0, 1.5, 2.446]), moe_renormalize=rng.random() < 0.8,
        model_max_length=4096, hidden_act="silu", mla_use_nope=True, moe_router_activation_func="sigmoid",
        use_grouped_topk=groups > 1,
    )


def draw_minimax_m3(rng: random.Random) -> dict:
    layers = rng.randint(2, 5)
    kv_heads = rng.choice([1, 2])
    heads = kv_heads * rng.choice([1, 2, 3])
    head_dim = rng.choice([16, 32, 64])
    factor = rng.choice([0.25, 0.5, 1.0])
    topk = rng.randint(1, 6)
    rope = {"rope_type": "default", "rope_theta": rng.choice([10000.0, 5000000.0]), "partial_rotary_factor": factor}
    if rng.random() < 0.3:
        rope.update(_yarn(rng))
    return dict(
        hidden_size=rng.choice([32, 48, 64]), num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, rotary_dim=int(head_dim * factor), rope_parameters=rope,
        intermediate_size=rng.choice([16, 32]), shared_intermediate_size=rng.choice([16, 32, 48]),
        dense_intermediate_size=rng.choice([32, 64, 128]), num_local_experts=rng.choice([4, 8, 16]),
        num_experts_per_tok=rng.randint(1, 4), routed_scaling_factor=rng.choice([1.0, 2.0]),
        swiglu_alpha=rng.choice([1.5, 1.702]), swiglu_limit=rng.choice([1.0, 2.0, 7.0]),
        # transformers spreads each indexer head's block choice over heads // index_n_heads query heads
        index_n_heads=rng.choice([i for i in (1, 2, 4) if heads % i == 0]), index_head_dim=rng.choice([16, 32]),
        index_block_size=rng.choice([4, 8, 16, 32]), index_topk_blocks=topk,
        index_local_blocks=rng.randint(0, min(2, topk)),
        layer_types=[rng.choice(["full_attention", "minimax_m3_sparse"]) for _ in range(layers)],
        mlp_layer_types=[rng.choice(["dense", "sparse"]) for _ in range(layers)], max_position_embeddings=4096,
        scoring_func="sigmoid", use_routing_bias=True, n_shared_experts=1, swiglu_beta=1.0, use_qk_norm=True,
        qk_norm_type="per_head", use_gemma_norm=True, attention_output_gate=False,
    )


DRAWERS = {"deepseek-v4": draw_deepseek_v4, "kimi-linear": draw_kimi_linear, "minimax-m3": draw_minimax_m3}


def draw(family: str, seed: int) -> Draw:
    rng = random.Random(f"{family}:{seed}")
    fields = {**_common(rng), **DRAWERS[family](rng)}
    mtp = rng.choice([0, 1]) if family != "kimi-linear" else 0
    if family == "deepseek-v4":
        fields["num_nextn_predict_layers"] = mtp
    if family == "minimax-m3":
        fields["num_mtp_modules"] = mtp
    return Draw(family, seed, fields, prompt_len=_prompt_len(rng), chunk=rng.choice([8, 16, 32, 64, 128, 256]),
                wrapper=family == "minimax-m3" and rng.random() < 0.3, mtp=mtp)


# ---------------------------------------------------------------- models

def _special(family: str, name: str, shape: tuple, gen: torch.Generator, experts: int) -> torch.Tensor | None:
    """A random value for a tensor transformers initialises to a constant, or None (keep its init)."""
    leaf = name.rsplit(".", 1)[-1]
    gemma = family == "minimax-m3"

    def common(n, s, g):
        return fixture_weights.random_value(n, s, g, gemma_norms=gemma, lm_head_gain=2.0)

    if family == "deepseek-v4":
        if leaf in ("tid2eid", "position_bias") or len(shape) == 1:
            return dsv4_fixtures.random_value(name, shape, gen, experts, common)
        return None
    if leaf in ("A_log", "dt_bias") or len(shape) == 1 or ("conv1d" in name and len(shape) == 3):
        return common(name, shape, gen)
    return None


def _config(d: Draw):
    if d.family == "deepseek-v4":
        from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

        fields = {k: v for k, v in d.fields.items() if v is not None or k != "rope_parameters"}
        return DeepseekV4Config(**fields), DeepseekV4ForCausalLM, ""
    if d.family == "kimi-linear":
        from transformers import KimiLinearConfig, KimiLinearForCausalLM

        return KimiLinearConfig(**d.fields), KimiLinearForCausalLM, ""
    from transformers import (MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLConfig, MiniMaxM3VLForCausalLM,
                              MiniMaxM3VLTextConfig)

    if d.wrapper:
        vocab = d.fields["vocab_size"]
        config = MiniMaxM3VLConfig(text_config=d.fields, vision_config=fixture_weights.TINY_VISION,
                                   projector_hidden_size=32, image_token_index=vocab - 2, video_token_index=vocab - 1)
        return config, MiniMaxM3SparseForConditionalGeneration, "language_model.model."
    return MiniMaxM3VLTextConfig(**d.fields), MiniMaxM3VLForCausalLM, "model."


def build(d: Draw):
    """`(model, its class, extra MTP tensors)`; transformers' errors on the config propagate."""
    config, cls, prefix = _config(d)
    torch.manual_seed(d.seed)
    model = cls(config).eval()
    gen = torch.Generator().manual_seed(d.seed)
    experts = d.fields.get("n_routed_experts", 0)
    with torch.no_grad():
        for name, tensor in sorted(model.state_dict().items()):
            if not tensor.is_floating_point() and not name.endswith("tid2eid"):
                continue
            value = _special(d.family, name, tuple(tensor.shape), gen, experts)
            if value is not None:
                tensor.copy_(value)
    extra = {}
    if d.mtp and d.family == "deepseek-v4":
        def common(n, s, g):
            return fixture_weights.random_value(n, s, g, gemma_norms=False, lm_head_gain=2.0)

        extra = {n: dsv4_fixtures.random_value(n, s, gen, experts, common)
                 for n, s in sorted(dsv4_fixtures.mtp_tensor_shapes(config).items())}
    elif d.mtp and d.family == "minimax-m3":
        text = dict(d.fields)
        extra = {n: fixture_weights.random_value(n, s, gen, gemma_norms=True, lm_head_gain=2.0)
                 for n, s in sorted(fixture_weights.mtp_tensor_shapes(text, prefix).items())}
    return model, cls, extra
