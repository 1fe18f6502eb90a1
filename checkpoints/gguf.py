"""GGUF files (llama and gemma3 architectures) into a `ModelConfig` and flat parameter arrays.

Reads metadata and tensors with `checkpoints.gguf_file` (the `gguf` package's quantisation types and
dequantisers, without its slow reader), dequantises every supported tensor type to
float32, undoes the Q/K row permutation that GGUF conversion applies to llama models, and maps
tensor names onto agentjax's parameter names. With `keep_blocks`, matrices in the Q4_0, Q4_1 and Q8_0
formats stay in their blocks instead (`agentjax.models.block_weights.BlockWeight`, checked bit for bit
against the float32 dequantisation), so the step reads a quarter of the bytes. Host only: jax is
imported only to build those BlockWeights.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import numpy as np

from agentjax.config import ModelConfig, RopeScaling
from agentjax.errors import ModelLoadError, UnsupportedModelError
from agentjax.progress import Throttle
from checkpoints.gguf_file import GGUFFile

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "gemma3")
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
# Gemma-3 alternates five sliding-window layers with one global layer.
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10_000.0

_LAYER_TENSORS = {
    "attn_norm": "input_norm.weight",
    "attn_q": "attn.q_proj.kernel",
    "attn_k": "attn.k_proj.kernel",
    "attn_v": "attn.v_proj.kernel",
    "attn_output": "attn.o_proj.kernel",
    "attn_q_norm": "attn.q_norm.weight",
    "attn_k_norm": "attn.k_norm.weight",
    "post_attention_norm": "post_attn_norm.weight",
    "ffn_norm": "pre_mlp_norm.weight",
    "ffn_gate": "mlp.gate_proj.kernel",
    "ffn_up": "mlp.up_proj.kernel",
    "ffn_down": "mlp.down_proj.kernel",
    "post_ffw_norm": "post_mlp_norm.weight",
}


def open_gguf(path: str | Path) -> GGUFFile:
    """The file's metadata and tensor views, with a clear error when it is missing or malformed."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    try:
        return GGUFFile(path)
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc


def metadata(reader: GGUFFile) -> dict[str, Any]:
    """All scalar and short metadata fields (token lists are left out)."""
    return {key: value for key, value in reader.metadata.items()
            if not (key.startswith("tokenizer.ggml.")
                    and key.rsplit(".", 1)[-1] in ("tokens", "scores", "token_type", "merges"))}


def config_from_metadata(meta: dict[str, Any], name: str = "model") -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    num_layers = int(get("block_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // num_heads)
    scaling = None
    scaling_type = meta.get(f"{arch}.rope.scaling.type")
    if scaling_type == "linear":
        scaling = RopeScaling(kind="linear", factor=float(get("rope.scaling.factor")))
    elif scaling_type not in (None, "none"):
        raise UnsupportedModelError(f"unsupported RoPE scaling {scaling_type!r}; supported: linear")
    common = dict(
        architecture=arch,
        vocab_size=0,  # filled from the embedding table
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or num_heads),
        head_dim=head_dim,
        max_position_embeddings=int(get("context_length")),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10_000.0)),
        rope_scaling=scaling,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(x for x in [meta.get("tokenizer.ggml.eos_token_id")] if x is not None),
        name=name,
    )
    if arch == "gemma3":
        window = int(get("attention.sliding_window"))
        layer_types = tuple(
            "full_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN == 0 else "sliding_attention"
            for i in range(num_layers)
        )
        return ModelConfig(
            **common,
            local_rope_theta=GEMMA3_LOCAL_ROPE_THETA,
            sliding_window=window,
            layer_types=layer_types,
            hidden_activation="gelu_tanh",
            embedding_multiplier=math.sqrt(hidden),
            use_qk_norm=True,
            use_sandwich_norms=True,
        )
    return ModelConfig(**common)


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo GGUF's llama Q/K row permutation ([out, in] rows: interleaved pairs back to halves)."""
    out_features = weight.shape[0]
    head_dim = out_features // num_heads
    return (
        weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def dequantize(tensor: Any) -> np.ndarray:
    """A GGUF tensor as float32 in numpy's row-major order (GGUF's dims reversed)."""
    import gguf

    type_name = tensor.tensor_type.name
    if type_name not in SUPPORTED_TENSOR_TYPES:
        raise UnsupportedModelError(
            f"tensor {tensor.name} has unsupported type {type_name}; supported: {', '.join(SUPPORTED_TENSOR_TYPES)}"
        )
    array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.ascontiguousarray(array.reshape(shape), dtype=np.float32)


# Block layouts kept on the device: (bytes per block of 32, has a float16 minimum, integer kind).
_BLOCK_FORMATS = {"Q4_0": (18, False, "nibbles"), "Q4_1": (20, True, "nibbles"), "Q8_0": (34, False, "int8")}


def block_parts(tensor: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
    """`(q, scale, offset)` of a Q4_0, Q4_1 or Q8_0 tensor in numpy's [out, in] order, blocks of 32 along
    `in` (value = q * scale + offset; Q4_0's `(q - 8) * d` becomes offset `-8 d`); None for other types."""
    layout = _BLOCK_FORMATS.get(tensor.tensor_type.name)
    if layout is None:
        return None
    block_bytes, has_min, kind = layout
    out_features, in_features = (int(d) for d in reversed(tensor.shape))
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(-1, block_bytes)
    scale = raw[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
    if kind == "int8":
        q = raw[:, 2:].copy().view(np.int8)
        offset = None
    else:
        start = 4 if has_min else 2
        nibbles = raw[:, start:]
        q = np.concatenate([nibbles & 15, nibbles >> 4], axis=1)  # element j in the low, j + 16 in the high nibble
        offset = raw[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0] if has_min else -8.0 * scale
    blocks = (out_features, in_features // 32)
    return (q.reshape(out_features, in_features), scale.reshape(blocks),
            None if offset is None else offset.reshape(blocks))


def param_name(gguf_name: str) -> str | None:
    """agentjax's parameter name for a GGUF tensor name, or None if it has no role."""
    if gguf_name == "token_embd.weight":
        return "embed"
    if gguf_name == "output_norm.weight":
        return "final_norm.weight"
    if gguf_name == "output.weight":
        return "lm_head"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _LAYER_TENSORS:
        return f"layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    return None


def _is_kernel(name: str) -> bool:
    return name.endswith("kernel") or name == "lm_head"


def host_bytes(array) -> int:
    """Bytes of a converted array on the host (a BlockWeight: its blocks' parts)."""
    if isinstance(array, np.ndarray):
        return int(array.nbytes)
    return sum(int(part.nbytes) for part in array.parts() if part is not None)


def load_gguf(path: str | Path, keep_blocks: bool = False) -> tuple[ModelConfig, dict[str, Any], GGUFFile]:
    """`(config, flat float32 arrays, the open file)`; the file's metadata serves the tokenizer. With `keep_blocks`, the
    embedding and the kernels stored as Q4_0, Q4_1 or Q8_0 are BlockWeights instead of float32 arrays."""
    reader = open_gguf(path)
    meta = metadata(reader)
    cfg = config_from_metadata(meta, name=Path(path).stem)
    arrays: dict[str, np.ndarray] = {}
    throttle, converted_bytes = Throttle(), 0
    for index, tensor in enumerate(reader.tensors):
        if throttle.due():
            logger.info("converting %s: %d/%d tensors, %.0f MB, %.1f s", Path(path).name, index, len(reader.tensors),
                        converted_bytes / 1e6, throttle.elapsed)
        name = param_name(tensor.name)
        if name is None:
            if tensor.name == "rope_freqs.weight":
                raise UnsupportedModelError(f"{path}: per-frequency RoPE factors (rope_freqs) are not supported")
            logger.warning("ignoring GGUF tensor %s", tensor.name)
            continue
        array = dequantized = dequantize(tensor)
        parts = block_parts(tensor) if keep_blocks and (name == "embed" or _is_kernel(name)) else None
        if parts is not None:
            from agentjax.models.block_weights import BlockWeight

            array = BlockWeight(*parts, axis=-1)
            if not np.array_equal(np.asarray(array), dequantized):  # never seen; float32 is the safe side
                logger.warning("%s: tensor %s (%s) does not read back from its blocks as it dequantises; "
                               "keeping it as float32", path, tensor.name, tensor.tensor_type.name)
                array, parts = dequantized, None
        if _is_kernel(name):
            if cfg.architecture == "llama" and name.endswith(("q_proj.kernel", "k_proj.kernel")):
                heads = cfg.num_heads if name.endswith("q_proj.kernel") else cfg.num_kv_heads
                array = array.map_parts(lambda p, h=heads: unpermute_qk(p, h)) if parts else unpermute_qk(array, heads)
            # [out, in] -> [in, out]
            array = array.swap_last_axes() if parts else np.ascontiguousarray(array.T)
        arrays[name] = array
        converted_bytes += host_bytes(array)
    if "embed" not in arrays:
        raise ModelLoadError(f"{path} has no token_embd.weight tensor")
    cfg = cfg.replace(vocab_size=arrays["embed"].shape[0], tie_word_embeddings="lm_head" not in arrays)
    return cfg, arrays, reader
