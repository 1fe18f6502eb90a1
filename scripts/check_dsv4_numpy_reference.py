"""Check tests/models/dsv4_numpy_reference.py against transformers' DeepseekV4Attention itself.

Runs in the torch reference environment (never in the project's tests): for each layer kind of a tiny
random config (window 8, CSA 4:1 with a 3-head indexer keeping 3 entries, HCA 8:1, YaRN compress RoPE),
it builds transformers' attention module in float64 with random weights, runs a 45-token sequence
through its cache one token at a time (cached generate's decode) and in one cached prefill call, and
compares both with the numpy transcription on the same weights. transformers keeps RoPE angles,
RMS norms and the indexer in float32 even in a float64 module, so agreement is about 1e-6 of an output
of magnitude ~3. A CSA token whose indexer top-k boundary falls on tied scores (several entries at
exactly 0 once the ReLU zeroed every head) is reported and left out: torch.topk and the transcription
(lower entry first) may keep different entries there. Exits 1 if any other difference exceeds --tolerance.

    python scripts/check_dsv4_numpy_reference.py  # with transformers 5.24.0 and torch installed
"""
from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import numpy as np
import torch
from transformers import DeepseekV4Config
from transformers.cache_utils import DynamicCache
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention, DeepseekV4RotaryEmbedding

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "models"))
from dsv4_numpy_reference import dsv4_attention  # noqa: E402

WINDOW, LENGTH = 8, 45
KINDS = {"sliding_attention": "swa_mqa", "compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}


def configs():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}
    hf = DeepseekV4Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=3, layer_types=list(KINDS), mlp_layer_types=["moe"] * 3,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, partial_rotary_factor=8 / 32, q_lora_rank=16,
        o_lora_rank=8, o_groups=2, sliding_window=WINDOW, index_n_heads=3, index_head_dim=16, index_topk=3,
        rope_theta=10000.0, compress_rope_theta=160000.0, rope_parameters=yarn, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, max_position_embeddings=256)
    hf._attn_implementation = "eager"
    scaling = types.SimpleNamespace(kind="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=32.0,
                                    beta_slow=1.0, attention_factor=1.0, truncate=True)
    ours = types.SimpleNamespace(
        num_heads=4, head_dim=32, rope_dim=8, sliding_window=WINDOW, rope_theta=10000.0, rms_norm_eps=hf.rms_norm_eps,
        compressed_attention=types.SimpleNamespace(
            csa_rate=4, hca_rate=8, index_num_heads=3, index_head_dim=16, index_topk=3,
            compress_rope_theta=160000.0, compress_rope_scaling=scaling, o_groups=2))
    return hf, ours


def agentjax_params(module: DeepseekV4Attention, groups: int) -> dict[str, np.ndarray]:
    """transformers' weights under the mixer's names (agentjax/models/dsv4_attention.py), kernels [in, out]."""
    weights = {k: v.detach().numpy().astype(np.float64) for k, v in module.state_dict().items()}
    params = {f"{name}.kernel": weights[f"{name}.weight"].T for name in ("q_a_proj", "q_b_proj", "kv_proj", "o_b_proj")}
    params.update({name: weights[name] for name in ("q_a_norm.weight", "kv_norm.weight", "sinks")})
    grouped = weights["o_a_proj.weight"]
    params["o_a_proj.kernel"] = grouped.reshape(groups, -1, grouped.shape[1]).transpose(0, 2, 1)
    for source, target in (("compressor.", "compressor."), ("compressor.indexer.", "indexer.")):
        if source + "kv_proj.weight" in weights:
            for name in ("kv_proj", "gate_proj"):
                params[f"{target}{name}.kernel"] = weights[f"{source}{name}.weight"].T
            for name in ("position_bias", "kv_norm.weight"):
                params[target + name] = weights[source + name]
    if "compressor.indexer.q_b_proj.weight" in weights:
        params["indexer.q_b_proj.kernel"] = weights["compressor.indexer.q_b_proj.weight"].T
        params["indexer.weights_proj.kernel"] = weights["compressor.indexer.scorer.weights_proj.weight"].T
    return params


def run_transformers(module, rope, x) -> tuple[np.ndarray, np.ndarray]:
    """(token-by-token decode through the cache, one cached prefill call) outputs `[tokens, hidden]`."""
    config = module.config
    cache, decoded = DynamicCache(config=config), []
    with torch.no_grad():
        for t in range(x.shape[1]):
            pos = torch.tensor([[t]])
            embeddings = {kind: rope(x, pos, layer_type=kind) for kind in ("main", "compress")}
            mask = torch.zeros(1, 1, 1, min(t, WINDOW - 1) + 1, dtype=torch.float64)
            out, _ = module(x[:, t:t + 1], embeddings, pos, mask, cache=cache)
            decoded.append(out[0, 0].numpy())
        pos = torch.arange(x.shape[1])[None]
        embeddings = {kind: rope(x, pos, layer_type=kind) for kind in ("main", "compress")}
        query, key = pos[0][:, None], pos[0][None, :]
        mask = torch.where((key <= query) & (key > query - WINDOW), 0.0, float("-inf")).double()[None, None]
        prefill, _ = module(x, embeddings, pos, mask, cache=DynamicCache(config=config))
    return np.stack(decoded), prefill[0].numpy()


def boundary_ties(result: dict, ours) -> np.ndarray:
    """Per token: whether its top-k boundary falls on tied indexer scores (always False outside CSA)."""
    tied = np.zeros(len(result["out"]), bool)
    if "scores" not in result:
        return tied
    attention = ours.compressed_attention
    for t, row in enumerate(result["scores"]):
        ended = np.sort(row[:(t + 1) // attention.csa_rate])[::-1]
        k = attention.index_topk
        tied[t] = len(ended) > k and ended[k - 1] == ended[k]
    return tied


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tolerance", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    hf, ours = configs()
    torch.manual_seed(args.seed)
    rope = DeepseekV4RotaryEmbedding(hf).double()
    x = torch.randn(1, LENGTH, hf.hidden_size, dtype=torch.float64)
    worst = 0.0
    for layer, kind in enumerate(KINDS):
        module = DeepseekV4Attention(hf, layer).double()
        with torch.no_grad():
            for name, param in module.named_parameters():
                norm = "norm" in name
                param.copy_(torch.randn_like(param) * (0.1 if norm else 0.5) + (1.0 if norm else 0.0))
        decoded, prefill = run_transformers(module, rope, x)
        result = dsv4_attention(x[0].numpy(), agentjax_params(module, hf.o_groups), ours, KINDS[kind])
        reference, tied = result["out"], boundary_ties(result, ours)
        keep = ~tied
        errors = np.abs(decoded - reference)[keep].max(), np.abs(prefill - reference)[keep].max()
        worst = max(worst, *errors)
        print(f"{kind}: decode {errors[0]:.2e}, prefill {errors[1]:.2e} (mean |out| {np.abs(reference).mean():.2f})"
              + (f"; tokens with a tie at the top-k boundary, left out: {np.flatnonzero(tied).tolist()}" if tied.any() else ""))
    print("OK" if worst <= args.tolerance else f"FAILED: {worst:.2e} > {args.tolerance:.0e}")
    return int(worst > args.tolerance)


if __name__ == "__main__":
    sys.exit(main())
