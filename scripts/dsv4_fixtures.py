"""DeepSeek-V4 fixtures for scripts/make_model_fixtures.py: tiny random DeepseekV4ForCausalLM
checkpoints and transformers' reference outputs, with where its two decoding paths part.

Run only through make_model_fixtures.py with the torch venv (never from project tests). Besides the
common reference (prompt logits, cached `generate` greedy tokens with top-1 margins, the uncached
step-by-step tokens), each reference.npz records the last prompt position's logits from the cached
prefill, how far the single-shot (uncached) forward's logits at prompt positions move when tokens
are appended (`noncausal_*`), and, per generated step, whether a CSA layer's lightning indexer had
a tie at its top-k boundary (equal scores, typically several exactly 0 after the ReLU), which
torch.topk breaks differently for different entry counts: that is where the two paths part.
The MTP module, which transformers does not build, is added in the upstream checkpoint spelling.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

VOCAB = 512

# Fixture a's model shape (below), which the other small-width fixtures change in a few fields.
DSV4_A_SHAPE = dict(
    max_position_embeddings=1024, hidden_size=64, num_hidden_layers=4,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    num_attention_heads=4, head_dim=32, qk_rope_head_dim=8, q_lora_rank=32, o_lora_rank=32, o_groups=2,
    sliding_window=16, index_n_heads=4, index_head_dim=16, index_topk=8,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, routed_scaling_factor=2.5,
    swiglu_limit=10.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
    rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                     "beta_fast": 32.0, "beta_slow": 1.0},
)

DSV4_FIXTURES = {
    # ARCHITECTURES.md 5.1's layer pattern, rates, window, top-k, heads, mHC and MoE routing, at
    # narrower widths (hidden 64) so the checkpoint stays under 2 MB.
    "deepseek-v4-a": dict(
        # prompt_seed: a prompt without indexer ties (in the prompt or in the 24 cached steps); the "parting"
        # prompt is one where transformers' cached generate and its uncached forward part (at step 15).
        DSV4_A_SHAPE, seed=41, prompt_seed=3029, extra_prompt_seeds={"parting": 3004}, prompt_len=72,
    ),
    # Pro's layer pattern (two HCA layers, then CSA at even and HCA at odd layers), other rates (CSA 8,
    # HCA 32), two hash layers, three residual streams, a clamp that binds (0.75), plain compress RoPE.
    "deepseek-v4-b": dict(
        seed=42, prompt_len=100, max_position_embeddings=4096, hidden_size=48, num_hidden_layers=5,
        layer_types=["heavily_compressed_attention", "heavily_compressed_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention", "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 8, "heavily_compressed_attention": 32},
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"],
        num_attention_heads=6, head_dim=32, qk_rope_head_dim=16, q_lora_rank=24, o_lora_rank=16, o_groups=3,
        sliding_window=12, index_n_heads=8, index_head_dim=16, index_topk=4,
        n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, routed_scaling_factor=1.5,
        swiglu_limit=0.75, hc_mult=3, hc_sinkhorn_iters=7, hc_eps=1e-4, rms_norm_eps=1e-5,
        rope_theta=50000.0, compress_rope_theta=40000.0, rope_parameters=None,
    ),
    # The held-out configs of issue 36, weights from transformers' own initialisation at a larger
    # initializer_range. c: heavily compressed first layer, no sliding layer, rates 4 and 16, window 8,
    # index top-k 6, two residual streams with 5 Sinkhorn iterations, a hash-routed first MoE layer,
    # bos/eos ids set, a 20-token prompt; the "tie" prompt is one where transformers' indexer meets tied
    # scores at its top-k boundary (several entries exactly 0) and torch.topk's choice decides step 10.
    "deepseek-v4-c": dict(
        DSV4_A_SHAPE, seed=3, prompt_seed=307, extra_prompt_seeds={"tie": 302}, prompt_len=20, init="transformers",
        initializer_range=0.08,
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"],
        sliding_window=8, index_topk=6, hc_mult=2, hc_sinkhorn_iters=5, rope_parameters=None, bos_token_id=0,
        eos_token_id=1,
    ),
    # d: a sliding first layer, rates 4 and 32 (pages of 32 tokens), index top-k 5, three residual streams,
    # initializer_range 0.05, a 72-token prompt whose 18 CSA entries the indexer cuts to 5; transformers'
    # indexer meets ties at steps 8, 10, 14 and 20 and torch.topk's choice decides step 8.
    "deepseek-v4-d": dict(
        DSV4_A_SHAPE, seed=6, prompt_seed=613, prompt_len=72, init="transformers", initializer_range=0.05,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 32},
        index_topk=5, hc_mult=3, rope_parameters=None, bos_token_id=0, eos_token_id=1,
    ),
    # The heavily compressed rates of published checkpoints' shape (4 and 32, 4 and 128), which need KV pages
    # of 32 or 128 tokens for their entries: loaded with the default settings (agentjax/kv/layout.py); with a
    # small byte-level tokenizer, so `agentjax serve` can return text. The indexer keeps every entry of these
    # prompts (top-64), so no index tie leaves transformers' choice to torch.topk (fixture a covers selection).
    "deepseek-v4-rates-4-32": dict(
        DSV4_A_SHAPE, seed=43, prompt_len=80, tokenizer=True, index_topk=64,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 32},
    ),
    "deepseek-v4-rates-4-128": dict(
        DSV4_A_SHAPE, seed=44, prompt_len=144, tokenizer=True, max_position_embeddings=2048, index_topk=64,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    ),
}


# Spec keys that are not config fields: seeds, prompt length and "init" ("transformers": keep transformers' own
# initialisation at the spec's initializer_range for every tensor it draws at random, see `build`).
SPEC_ONLY = ("seed", "prompt_seed", "extra_prompt_seeds", "prompt_len", "init", "tokenizer")


def build_config(spec: dict):
    from transformers import DeepseekV4Config

    kwargs = {k: v for k, v in spec.items() if k not in SPEC_ONLY}
    if kwargs.get("rope_parameters") is None:
        kwargs.pop("rope_parameters", None)
    defaults = dict(vocab_size=VOCAB, num_key_value_heads=1, n_shared_experts=1, num_nextn_predict_layers=1,
                    scoring_func="sqrtsoftplus", norm_topk_prob=True, hidden_act="silu", tie_word_embeddings=False,
                    pad_token_id=None, bos_token_id=None, eos_token_id=None)
    return DeepseekV4Config(**{**defaults, **kwargs})


def _hash_table(shape: tuple[int, ...], num_experts: int, gen: torch.Generator) -> torch.Tensor:
    """tid2eid: for every token id, `top_k` distinct experts (a real table never repeats one)."""
    vocab, top_k = shape
    return torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(vocab)])


def random_value(name: str, shape: tuple[int, ...], gen: torch.Generator, num_experts: int,
                 common: Callable) -> torch.Tensor:
    """DeepSeek-V4's tensors beyond the common rules (`common(name, shape, gen)`): the hash table, and
    the mHC biases and compressors' position biases, drawn large enough to matter."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "tid2eid":
        return _hash_table(shape, num_experts, gen)
    if leaf in ("base", "hc_base", "hc_attn_base", "hc_ffn_base", "hc_head_base", "position_bias", "ape"):
        return torch.randn(shape, generator=gen, dtype=torch.float32) * 0.5
    return common(name, shape, gen)


def constant_at_init(name: str, shape: tuple[int, ...]) -> bool:
    """Tensors transformers initialises to a constant (norm weights, sinks, mHC bases and scales, routing
    biases, position biases) or to zeros (the hash table)."""
    return name.rsplit(".", 1)[-1] in ("tid2eid", "position_bias") or len(shape) == 1


def mtp_tensor_shapes(config) -> dict[str, tuple[int, ...]]:
    """One MTP module in the upstream checkpoint spelling (`mtp.{k}.*`): its own enorm/hnorm,
    e_proj/h_proj, final norm and hyper-head, and a sliding-window-only block with a learned-router
    MoE and its two hyper-connections (transformers skips `mtp.*` on load)."""
    h, hc, heads, hd = config.hidden_size, config.hc_mult, config.num_attention_heads, config.head_dim
    q, groups, o_rank = config.q_lora_rank, config.o_groups, config.o_lora_rank
    experts, inner = config.n_routed_experts, config.moe_intermediate_size
    mix = (2 + hc) * hc
    root = "mtp.0."
    shapes = {
        root + "enorm.weight": (h,), root + "hnorm.weight": (h,), root + "norm.weight": (h,),
        root + "e_proj.weight": (h, h), root + "h_proj.weight": (h, h),
        root + "hc_head_fn": (hc, hc * h), root + "hc_head_base": (hc,), root + "hc_head_scale": (1,),
        root + "attn_norm.weight": (h,), root + "ffn_norm.weight": (h,),
        root + "attn.wq_a.weight": (q, h), root + "attn.q_norm.weight": (q,),
        root + "attn.wq_b.weight": (heads * hd, q), root + "attn.wkv.weight": (hd, h),
        root + "attn.norm.weight": (hd,), root + "attn.wo_a.weight": (groups * o_rank, heads * hd // groups),
        root + "attn.wo_b.weight": (h, groups * o_rank), root + "attn.attn_sink": (heads,),
        root + "ffn.gate.weight": (experts, h), root + "ffn.gate.bias": (experts,),
        root + "ffn.shared_experts.w1.weight": (inner, h), root + "ffn.shared_experts.w2.weight": (h, inner),
        root + "ffn.shared_experts.w3.weight": (inner, h),
    }
    for sub in ("attn", "ffn"):
        shapes.update({root + f"hc_{sub}_fn": (mix, hc * h), root + f"hc_{sub}_base": (mix,),
                       root + f"hc_{sub}_scale": (3,)})
    for e in range(experts):
        shapes.update({root + f"ffn.experts.{e}.w1.weight": (inner, h), root + f"ffn.experts.{e}.w2.weight": (h, inner),
                       root + f"ffn.experts.{e}.w3.weight": (inner, h)})
    return shapes


def build(spec: dict, common: Callable):
    """The model (random weights), its class and the MTP tensors to add to its checkpoint."""
    from transformers import DeepseekV4ForCausalLM

    config = build_config(spec)
    torch.manual_seed(spec["seed"])
    model = DeepseekV4ForCausalLM(config)
    gen = torch.Generator().manual_seed(spec["seed"])
    keep_init = spec.get("init") == "transformers"
    with torch.no_grad():
        for name, tensor in sorted(model.state_dict().items()):
            if keep_init and not constant_at_init(name, tuple(tensor.shape)):
                continue
            tensor.copy_(random_value(name, tuple(tensor.shape), gen, config.n_routed_experts, common))
    gen = torch.Generator().manual_seed(spec["seed"] + 1000)
    mtp = {name: random_value(name, shape, gen, config.n_routed_experts, common)
           for name, shape in sorted(mtp_tensor_shapes(config).items())}
    return model, DeepseekV4ForCausalLM, mtp


# ---------------------------------------------------------------- reference diagnostics

class IndexerTieRecorder:
    """Records, for each call of every CSA layer's indexer scorer, whether the scores of one query row
    tie at the top-k boundary among the entries that row may see (so torch.topk's choice is arbitrary)."""

    def __init__(self, model):
        self.calls: list[list[tuple[torch.Tensor, int, int]]] = []  # per forward: (scores, rate, top_k)
        self._patched = []
        for layer in model.model.layers:
            compressor = layer.self_attn.compressor
            indexer = getattr(compressor, "indexer", None)
            if indexer is None:
                continue
            scorer, original = indexer.scorer, indexer.scorer.forward

            def forward(q, compressed_kv, hidden_states, _original=original, _indexer=indexer):
                scores = _original(q, compressed_kv, hidden_states)
                self.current.append((scores.detach().clone(), _indexer.compress_rate, _indexer.index_topk))
                return scores

            scorer.forward = forward
            self._patched.append((scorer, original))
        self.current: list = []

    def next_forward(self) -> None:
        self.current = []
        self.calls.append(self.current)

    def restore(self) -> None:
        for scorer, original in self._patched:
            scorer.forward = original

    @staticmethod
    def row_ties(scores: torch.Tensor, row: int, position: int, rate: int, top_k: int) -> bool:
        visible = (position + 1) // rate
        if visible <= top_k:
            return False
        ordered = torch.sort(scores[0, row, :visible], descending=True).values
        return bool(ordered[top_k - 1] == ordered[top_k])

    def forward_ties(self, call: int, row: int, position: int) -> bool:
        return any(self.row_ties(s, row, position, rate, k) for s, rate, k in self.calls[call])


@torch.no_grad()
def reference_outputs(model, prompt: torch.Tensor, new_tokens: int) -> dict[str, np.ndarray]:
    from fuzz_parity_reference import greedy_generate, top2_margins

    length = prompt.numel()
    ties = IndexerTieRecorder(model)
    ties.next_forward()
    prompt_logits = model(input_ids=prompt[None], use_cache=False).logits[0].float()
    prompt_ties = [ties.forward_ties(0, p, p) for p in range(length)]

    first_cached = len(ties.calls)
    original_forward = model.forward

    def counted_forward(*args, **kwargs):
        ties.next_forward()
        return original_forward(*args, **kwargs)

    model.forward = counted_forward
    out = greedy_generate(model, prompt, new_tokens)
    model.forward = original_forward
    generated = out.sequences[0, length:]
    step_logits = torch.stack([s[0].float() for s in out.logits])
    if generated.numel() != new_tokens or not torch.equal(step_logits.argmax(-1), generated):
        raise RuntimeError("generate did not produce the greedy tokens of its own logits")
    # Call first_cached is the prefill (its last row decides step 0); call first_cached + t decodes step t.
    cached_ties = [ties.forward_ties(first_cached, length - 1, length - 1)]
    cached_ties += [ties.forward_ties(first_cached + t, 0, length - 1 + t) for t in range(1, new_tokens)]

    uncached_ids, max_abs_diff, uncached_ties, shift, first_moved = [], [], [], [], []
    for t in range(new_tokens):  # uncached forward over prompt + the cached run's first t tokens
        ties.next_forward()
        seq = torch.cat([prompt, generated[:t]])
        logits = model(input_ids=seq[None], use_cache=False).logits[0].float()
        last = logits[-1]
        uncached_ids.append(int(last.argmax()))
        max_abs_diff.append(float((last - step_logits[t]).abs().max()))
        uncached_ties.append(ties.forward_ties(len(ties.calls) - 1, seq.numel() - 1, seq.numel() - 1))
        moved = (logits[:length] - prompt_logits).abs().max(dim=-1).values
        shift.append(float(moved.max()))
        over = torch.nonzero(moved > 1e-3).flatten()
        first_moved.append(int(over[0]) if over.numel() else -1)
    ties.restore()
    uncached = torch.tensor(uncached_ids)
    stable = stable_outputs(model, prompt, new_tokens) if any(prompt_ties + cached_ties + uncached_ties) else {}
    return stable | {
        "prompt_ids": prompt.numpy().astype(np.int32),
        "prompt_logits": prompt_logits.numpy().astype(np.float32),
        "last_prompt_logits": step_logits[0].numpy().astype(np.float32),
        "prompt_indexer_boundary_tie": np.asarray(prompt_ties),
        "generated_ids": generated.numpy().astype(np.int32),
        "generated_logits": step_logits.numpy().astype(np.float32),
        "generated_margins": top2_margins(step_logits),
        "cached_indexer_boundary_tie": np.asarray(cached_ties),
        "uncached_step_ids": uncached.numpy().astype(np.int32),
        "uncached_indexer_boundary_tie": np.asarray(uncached_ties),
        "cached_uncached_agree": (uncached == generated).numpy(),
        "cached_uncached_max_abs_diff": np.asarray(max_abs_diff, np.float32),
        # How far the single-shot forward's prompt logits move once t tokens follow the prompt (t = 0..N-1),
        # and the first prompt position that moves by more than 1e-3 (-1: none).
        "noncausal_prompt_shift": np.asarray(shift, np.float32),
        "noncausal_first_position": np.asarray(first_moved, np.int32),
    }


def stable_outputs(model, prompt: torch.Tensor, new_tokens: int) -> dict[str, np.ndarray]:
    """transformers' prompt logits and cached greedy generate with the indexer's top-k ties broken toward
    the lower entry (agentjax's rule), recorded where its own run met a tie."""
    from fuzz_parity_reference import reference, stable_indexer_topk

    with stable_indexer_topk():
        ref = reference(model, prompt, new_tokens)
    return {"stable_prompt_logits": ref["prompt_logits"].astype(np.float32),
            "stable_generated_ids": ref["generated_ids"].astype(np.int32),
            "stable_generated_logits": ref["generated_logits"].astype(np.float32),
            "stable_generated_margins": ref["margins"].astype(np.float32)}


def summary(ref: dict[str, np.ndarray]) -> dict:
    """What the fixture log line adds for DeepSeek-V4."""
    return {
        "min_margin": round(float(ref["generated_margins"].min()), 5),
        "cached_uncached_disagree_steps": [int(i) for i in np.flatnonzero(~ref["cached_uncached_agree"])],
        "last_prompt_single_shot_vs_cached": float(np.abs(ref["prompt_logits"][-1] - ref["last_prompt_logits"]).max()),
        "last_prompt_indexer_tie": bool(ref["prompt_indexer_boundary_tie"][-1]),
        "prompt_positions_with_indexer_ties": [int(i) for i in np.flatnonzero(ref["prompt_indexer_boundary_tie"])],
        "cached_steps_with_indexer_ties": [int(i) for i in np.flatnonzero(ref["cached_indexer_boundary_tie"])],
        "uncached_steps_with_indexer_ties": [int(i) for i in np.flatnonzero(ref["uncached_indexer_boundary_tie"])],
        "noncausal_max_shift": round(float(ref["noncausal_prompt_shift"].max()), 5),
        "noncausal_first_positions": sorted({int(p) for p in ref["noncausal_first_position"] if p >= 0}),
    }
