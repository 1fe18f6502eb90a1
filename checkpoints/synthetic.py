"""Synthetic MiniMax-M3 checkpoints of any size in a published format, written tensor by tensor with numpy.

`minimax_m3(directory, sizes, fmt)` writes config.json, `model-0000k-of-0000n.safetensors` shards and
`model.safetensors.index.json` with the tensor names of the published MiniMax-M3 checkpoints (the VL
wrapper's `language_model.model.layers.{i}.block_sparse_moe.experts.{e}.w1/w2/w3`, ...): its routed and
shared experts, dense MLPs and attention projections quantised in `fmt` ("nvfp4", "mxfp8", or "bf16" for
none), embeddings, norms and routers in bfloat16. Quantised matrices hold random codes and scales drawn
directly (no float pass), so gigabytes write at disk speed; the model is deterministic (seeded), not
trained. Host only: never imports jax.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from checkpoints.quant_codecs import E4M3
from checkpoints.quant_writer import ShardWriter, quant_config


@dataclass(frozen=True)
class Sizes:
    layers: int = 4
    dense_layers: int = 1
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 32
    experts: int = 16
    experts_per_token: int = 2
    expert_inner: int = 256
    shared_inner: int = 256
    dense_inner: int = 512
    vocab: int = 512


def _e4m3_codes(rng, shape, max_exponent: int) -> np.ndarray:
    """Random E4M3 bytes of magnitude below 2**(max_exponent - 6) (never NaN)."""
    sign = rng.integers(0, 2, shape, dtype=np.uint8) << 7
    exponent = rng.integers(1, max_exponent + 1, shape, dtype=np.uint8) << 3
    return (sign | exponent | rng.integers(0, 8, shape, dtype=np.uint8)).view(E4M3)


def _matrix(rng, name: str, rows: int, cols: int, fmt: str) -> dict[str, np.ndarray]:
    if fmt == "bf16":
        return {name: (rng.standard_normal((rows, cols), np.float32) * 0.02).astype(ml_dtypes.bfloat16)}
    base = name.removesuffix(".weight")
    if fmt == "nvfp4":
        return {name: rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8),
                f"{base}.weight_scale": _e4m3_codes(rng, (rows, cols // 16), 7),
                f"{base}.weight_scale_2": np.asarray(0.02 / 6, np.float32),
                f"{base}.input_scale": np.ones((), np.float32)}
    if fmt == "mxfp8":
        return {name: _e4m3_codes(rng, (rows, cols), 7),
                f"{base}.weight_scale": np.full((rows, cols // 32), 127 - 7, np.uint8)}
    raise ValueError(f"synthetic MiniMax-M3 formats: nvfp4, mxfp8, bf16; got {fmt!r}")


def _float(rng, shape, scale=0.02) -> np.ndarray:
    return (rng.standard_normal(shape, np.float32) * scale).astype(ml_dtypes.bfloat16)


def _config(s: Sizes, fmt: str) -> dict:
    layer_types = ["full_attention"] * s.layers
    mlp_types = ["dense"] * s.dense_layers + ["sparse"] * (s.layers - s.dense_layers)
    text = dict(model_type="minimax_m3_vl_text", hidden_size=s.hidden, num_hidden_layers=s.layers,
                num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=s.head_dim,
                intermediate_size=s.expert_inner, shared_intermediate_size=s.shared_inner,
                dense_intermediate_size=s.dense_inner, num_local_experts=s.experts,
                num_experts_per_tok=s.experts_per_token, vocab_size=s.vocab, layer_types=layer_types,
                mlp_layer_types=mlp_types, max_position_embeddings=4096, rms_norm_eps=1e-6,
                rope_parameters={"partial_rotary_factor": 0.5, "rope_theta": 10000.0, "rope_type": "default"},
                routed_scaling_factor=2.0, scoring_func="sigmoid", swiglu_alpha=1.702, swiglu_beta=1.0,
                swiglu_limit=7.0, use_qk_norm=True, tie_word_embeddings=False, num_mtp_modules=0)
    config = {"architectures": ["MiniMaxM3SparseForConditionalGeneration"], "model_type": "minimax_m3_vl",
              "text_config": text, "tie_word_embeddings": False, "synthetic_sizes": asdict(s)}
    if fmt != "bf16":
        config["quantization_config"] = quant_config(fmt, (128, 128), ["lm_head"])
    return config


def minimax_m3(directory: Path, sizes: Sizes, fmt: str, *, shards: int = 16, seed: int = 0) -> Path:
    """Write the checkpoint; returns `directory`. About `shards` files of equal size."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    s, rng = sizes, np.random.default_rng(seed)
    writer = ShardWriter(directory, max(1, checkpoint_bytes(sizes, fmt) // shards + 1))
    root = "language_model.model."
    writer.add(root + "embed_tokens.weight", _float(rng, (s.vocab, s.hidden)))
    for i in range(s.layers):
        layer = f"{root}layers.{i}."
        writer.add(layer + "input_layernorm.weight", np.zeros(s.hidden, ml_dtypes.bfloat16))
        writer.add(layer + "post_attention_layernorm.weight", np.zeros(s.hidden, ml_dtypes.bfloat16))
        for p, rows, cols in (("q", s.heads * s.head_dim, s.hidden), ("k", s.kv_heads * s.head_dim, s.hidden),
                              ("v", s.kv_heads * s.head_dim, s.hidden), ("o", s.hidden, s.heads * s.head_dim)):
            for name, array in _matrix(rng, f"{layer}self_attn.{p}_proj.weight", rows, cols, fmt).items():
                writer.add(name, array)
        for p in ("q_norm", "k_norm"):
            writer.add(f"{layer}self_attn.{p}.weight", np.zeros(s.head_dim, ml_dtypes.bfloat16))
        if i < s.dense_layers:
            mats = [("mlp.gate_proj", s.dense_inner, s.hidden), ("mlp.up_proj", s.dense_inner, s.hidden),
                    ("mlp.down_proj", s.hidden, s.dense_inner)]
        else:
            moe = layer + "block_sparse_moe."
            writer.add(moe + "gate.weight", _float(rng, (s.experts, s.hidden)))
            writer.add(moe + "e_score_correction_bias", np.zeros(s.experts, np.float32))
            mats = [(f"block_sparse_moe.experts.{e}.{w}", *shape) for e in range(s.experts)
                    for w, shape in (("w1", (s.expert_inner, s.hidden)), ("w3", (s.expert_inner, s.hidden)),
                                     ("w2", (s.hidden, s.expert_inner)))]
            mats += [("block_sparse_moe.shared_experts.gate_proj", s.shared_inner, s.hidden),
                     ("block_sparse_moe.shared_experts.up_proj", s.shared_inner, s.hidden),
                     ("block_sparse_moe.shared_experts.down_proj", s.hidden, s.shared_inner)]
        for module, rows, cols in mats:
            for name, array in _matrix(rng, f"{layer}{module}.weight", rows, cols, fmt).items():
                writer.add(name, array)
    writer.add(root + "norm.weight", np.zeros(s.hidden, ml_dtypes.bfloat16))
    writer.add("language_model.lm_head.weight", _float(rng, (s.vocab, s.hidden)))
    writer.close()
    (directory / "config.json").write_text(json.dumps(_config(s, fmt), indent=2))
    return directory


def checkpoint_bytes(s: Sizes, fmt: str) -> int:
    """The tensor bytes `minimax_m3` writes for these sizes (to size shards and pick medium sizes)."""
    per_value = {"bf16": 2.0, "nvfp4": 0.5 + 1 / 16, "mxfp8": 1 + 1 / 32}[fmt]
    attention = 2 * s.hidden * s.head_dim * (s.heads + s.kv_heads)
    moe = 3 * s.experts * s.hidden * s.expert_inner + 3 * s.hidden * s.shared_inner
    dense = 3 * s.hidden * s.dense_inner
    matrices = s.layers * attention + s.dense_layers * dense + (s.layers - s.dense_layers) * moe
    return int(matrices * per_value + 2 * s.vocab * s.hidden * 2)
