"""Which KV tensors a model has, which group and slot each lives in, and each group's device shape.

A layer stores one or more KV tensors (MiniMax-M3's sparse layers store K/V and indexer keys); each
tensor has a spec, tensors of equal spec form one group (the manager's grouping), and a tensor's
slot is its index inside its group. The runner allocates one buffer per group,
`[num_slots, num_pages, *page_shape]`, indexed by the pool's page ids. Host only: never imports jax.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from agentjax.errors import InvalidRequestError
from agentjax.kv.specs import (CompressedLatentSpec, FullAttentionSpec, IndexerKeySpec, KVSpec, MLALatentSpec,
                               RecurrentStateSpec, RollingStateSpec, SlidingLatentSpec, SlidingWindowSpec,
                               fp8_row_bytes, group_layers)

# Tokens between saved recurrent states when nothing else is asked (rounded up to whole pages).
DEFAULT_CHECKPOINT_TOKENS = 64

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}

# vLLM's fp8_ds_mla (DeepSeek-V4 full-size plans, ARCHITECTURES.md "KV cache details"): 448 fp8 NoPE +
# 64 bf16 RoPE values + 8 B of scales per stored row, and FP8 indexer keys with their scale.
FP8_DS_MLA_ROW_BYTES = 584
FP8_INDEX_KEY_BYTES = 132
# `kv_cache_dtype` values: "auto" stores KV in the model's dtype, "fp8" stores the attention kinds (K/V of
# GQA/MHA layers, sliding or not, block-sparse or not; MLA latents) as float8_e4m3fn rows with a float32
# scale each. Recurrent states, indexer keys and DeepSeek-V4's kinds keep their own formats.
KV_CACHE_DTYPES = ("auto", "fp8")
FP8_KV_ROLES = ("kv", "latent")
# DeepSeek-V4's roles: window K=V rows, compressed entries, compressed indexer keys, and the two
# compressors' rolling per-token inputs.
COMPRESSED_ATTENTION_ROLES = ("window", "entries", "index_entries", "kv_state", "index_state")


@dataclass(frozen=True)
class KVTensor:
    """One layer's KV tensor: `role` is "kv" (K and V), "index" (indexer keys), "latent" (MLA), "state"
    (KDA), or one of DeepSeek-V4's COMPRESSED_ATTENTION_ROLES."""

    layer: int
    role: str
    spec: KVSpec


@dataclass(frozen=True)
class KVBufferSpec:
    """The device buffer of one group: `[num_slots, num_pages, *page_shape]` of `dtype`."""

    group_id: int
    kind: str
    num_slots: int
    page_shape: tuple[int, ...]
    dtype: str

    @property
    def bytes_per_page(self) -> int:
        count = self.num_slots * _DTYPE_BYTES[self.dtype]
        for size in self.page_shape:
            count *= size
        return count


def checkpoint_tokens(block_size: int, requested: int | None = None) -> int:
    """Tokens between saved recurrent states: a whole number of pages."""
    tokens = requested or DEFAULT_CHECKPOINT_TOKENS
    return -(-tokens // block_size) * block_size


def cost_aware_checkpoint_tokens(cfg, block_size: int) -> int:
    """The default interval between saved recurrent states of `cfg`: the fewest tokens (a whole number of
    pages, at least DEFAULT_CHECKPOINT_TOKENS) whose prefix KV (attention K/V, MLA latents, compressed
    entries) weighs at least one state of every recurrent layer.

    An interval state and the prefix pages of its interval save the same prefill on a hit that lands in
    the interval (without either, the hit stops at the interval before), so at this interval a state
    saves at least as many FLOPs per byte as the pages beside it, and interval states never hold more
    than the attention KV of the prefixes they checkpoint. Kimi-K3 at full size (465 MB of state, 27 KB
    of bfloat16 latent per token): about 16.8K tokens; tiny presets: about 100."""
    tensors = kv_tensors(cfg)
    state = sum(t.spec.state_bytes for t in tensors if t.spec.hit_rule == "checkpoint")
    sample = 1024 * block_size  # whole entries of every compressed kind
    per_token = sum(t.spec.bytes_for_tokens(sample) for t in tensors if t.spec.hit_rule == "prefix") / sample
    if not state or not per_token:
        return checkpoint_tokens(block_size)
    return checkpoint_tokens(block_size, max(DEFAULT_CHECKPOINT_TOKENS, math.ceil(state / per_token)))


def _dtype_bytes(cfg) -> int:
    if cfg.dtype not in _DTYPE_BYTES:
        raise InvalidRequestError(f"unsupported KV dtype {cfg.dtype!r}; expected one of {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[cfg.dtype]


def check_kv_cache_dtype(cfg) -> None:
    """Raise if `cfg.kv_cache_dtype` is unknown, or "fp8" for a model with a kind that cannot take it."""
    dtype = getattr(cfg, "kv_cache_dtype", "auto")
    if dtype not in KV_CACHE_DTYPES:
        raise InvalidRequestError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {dtype!r}")
    refused = sorted({t for t in cfg.layer_types if t in ("swa_mqa", "csa", "hca")})
    if dtype == "fp8" and refused:
        raise InvalidRequestError(
            f"kv_cache_dtype='fp8' stores GQA/MHA K/V and MLA latents; model {cfg.name!r} has {', '.join(refused)} "
            f"layers, whose KV kinds ({', '.join(COMPRESSED_ATTENTION_ROLES)}) have no FP8 device format "
            "(compressed_attention.kv_format='fp8_ds_mla' sizes them for plans only): use kv_cache_dtype='auto'")
    if dtype == "fp8" and _dtype_bytes(cfg) > 4:
        raise InvalidRequestError(f"kv_cache_dtype='fp8' needs a 16- or 32-bit model dtype, got {cfg.dtype!r}")


def fp8_kv(cfg) -> bool:
    """Whether `cfg` stores its attention kinds as FP8 rows (`kv_cache_dtype="fp8"`)."""
    return getattr(cfg, "kv_cache_dtype", "auto") == "fp8"


def kv_tensors(cfg, checkpoint_interval: int = DEFAULT_CHECKPOINT_TOKENS) -> list[KVTensor]:
    """Every KV tensor of an `agentjax.config.ModelConfig`, in layer order."""
    nbytes = _dtype_bytes(cfg)
    page_tokens = required_page_tokens(cfg)
    fp8 = fp8_kv(cfg)
    attention = FullAttentionSpec(num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype_bytes=nbytes,
                                  required_page_tokens=page_tokens, fp8=fp8)
    layers = list(enumerate(cfg.layer_types))
    if cfg.mtp_kv_cache:  # the MTP layers, run by speculative decoding (agentjax/models/mtp.py)
        layers += [(cfg.num_layers + i, mtp_layer_type(cfg)) for i in range(cfg.num_mtp_modules)]
    tensors: list[KVTensor] = []
    for layer, layer_type in layers:
        if layer_type == "full_attention":
            tensors.append(KVTensor(layer, "kv", attention))
        elif layer_type == "sliding_attention":
            tensors.append(KVTensor(layer, "kv", SlidingWindowSpec(
                num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype_bytes=nbytes,
                sliding_window=cfg.sliding_window, fp8=fp8)))
        elif layer_type == "block_sparse_attention":
            tensors.append(KVTensor(layer, "kv", attention))
            tensors.append(KVTensor(layer, "index", IndexerKeySpec(
                ratio=1, entry_bytes=cfg.block_sparse.index_head_dim * nbytes, required_page_tokens=page_tokens)))
        elif layer_type == "mla":
            tensors.append(KVTensor(layer, "latent", MLALatentSpec(
                latent_dim=cfg.mla.kv_lora_rank, rope_dim=cfg.mla.qk_rope_head_dim, dtype_bytes=nbytes, fp8=fp8)))
        elif layer_type == "kda":
            tensors.append(KVTensor(layer, "state", RecurrentStateSpec(
                bytes_per_state=4 * cfg.kda.state_size, checkpoint_interval=checkpoint_interval)))
        elif layer_type in ("swa_mqa", "csa", "hca"):
            tensors += compressed_attention_tensors(cfg, layer_type, layer, nbytes)
        else:
            raise InvalidRequestError(f"layer {layer} has an unknown layer type {layer_type!r}")
    return tensors


def mtp_layer_type(cfg) -> str:
    """The token mixer of an MTP layer: DeepSeek-V4's (hyper-connected) sliding-window MQA, else
    MiniMax-M3's block-sparse attention (agentjax/models/mtp.py builds the same)."""
    return "swa_mqa" if cfg.hyper_connections is not None else "block_sparse_attention"


def compressed_attention_tensors(cfg, layer_type: str, layer: int, nbytes: int) -> list[KVTensor]:
    """A DeepSeek-V4 layer's tensors: "window" (K=V rows of the last `sliding_window` tokens, hit on any
    token); for csa/hca "entries" (one per `rate` tokens, hits whole pages) and "kv_state" (the
    compressor's float32 `[kv | gate]` inputs per token over its span: 2 blocks of 2-series rows for csa,
    1 block of 1-series rows for hca); for csa "index_entries" and "index_state" too (the indexer's)."""
    attention = cfg.compressed_attention
    fp8 = attention.kv_format == "fp8_ds_mla"
    row = FP8_DS_MLA_ROW_BYTES if fp8 else cfg.head_dim * nbytes
    tensors = [KVTensor(layer, "window", SlidingLatentSpec(ratio=1, entry_bytes=row, state_window=cfg.sliding_window))]
    if layer_type == "swa_mqa":
        return tensors
    rate, series = (attention.csa_rate, 2) if layer_type == "csa" else (attention.hca_rate, 1)
    tensors.append(KVTensor(layer, "entries", CompressedLatentSpec(ratio=rate, entry_bytes=row)))
    tensors.append(KVTensor(layer, "kv_state", RollingStateSpec(
        ratio=1, entry_bytes=4 * 2 * series * cfg.head_dim, state_window=series * rate)))
    if layer_type == "csa":
        key = FP8_INDEX_KEY_BYTES if fp8 else attention.index_head_dim * nbytes
        tensors.append(KVTensor(layer, "index_entries", IndexerKeySpec(ratio=rate, entry_bytes=key)))
        tensors.append(KVTensor(layer, "index_state", RollingStateSpec(
            ratio=1, entry_bytes=4 * 2 * 2 * attention.index_head_dim, state_window=2 * rate)))
    return tensors


def page_tokens_multiple(cfg) -> int:
    """Tokens a KV page must hold a multiple of: DeepSeek-V4's compression rates (a page holds whole
    entries), else 1."""
    attention = cfg.compressed_attention
    if attention is None:
        return 1
    rates = [attention.csa_rate if t == "csa" else attention.hca_rate for t in cfg.layer_types if t in ("csa", "hca")]
    return math.lcm(*rates) if rates else 1


def required_page_tokens(cfg) -> int | None:
    """Tokens per page the model's kernels demand (MiniMax-M3's block-sparse attention: 128), or None."""
    return cfg.block_sparse.required_page_tokens if cfg.block_sparse is not None else None


def kv_slots(cfg) -> dict[tuple[int, str], tuple[int, int]]:
    """`(layer, role) -> (group id, slot in the group's buffer)`; groups as the KV manager forms them."""
    tensors = kv_tensors(cfg)
    slots = {}
    for group_id, (_, members) in enumerate(group_layers([t.spec for t in tensors])):
        for slot, index in enumerate(members):
            slots[(tensors[index].layer, tensors[index].role)] = (group_id, slot)
    return slots


def kv_buffer_specs(cfg, page_size: int) -> list[KVBufferSpec]:
    """One device buffer per KV group, in group order."""
    demanded = required_page_tokens(cfg)
    if demanded is not None and page_size != demanded:
        raise InvalidRequestError(
            f"model {cfg.name!r} requires {demanded}-token KV pages (block_size={demanded}), got page_size={page_size}"
        )
    multiple = page_tokens_multiple(cfg)
    if page_size % multiple:
        raise InvalidRequestError(
            f"model {cfg.name!r} stores one compressed entry per {multiple} tokens at most, so a KV page must "
            f"hold a multiple of {multiple} tokens (block_size); got page_size={page_size}")
    if cfg.compressed_attention is not None and cfg.compressed_attention.kv_format != "model_dtype":
        raise InvalidRequestError(
            f"model {cfg.name!r} has kv_format={cfg.compressed_attention.kv_format!r}, which sizes KV plans only; "
            "device buffers need kv_format='model_dtype'")
    tensors = kv_tensors(cfg)
    buffers = []
    for group_id, (spec, members) in enumerate(group_layers([t.spec for t in tensors])):
        shape, dtype = kind_cell(cfg, tensors[members[0]].role, spec, page_size)
        buffers.append(KVBufferSpec(group_id, spec.kind, len(members), shape, dtype))
    return buffers


def kind_cell(cfg, role: str, spec: KVSpec, page_tokens: int) -> tuple[tuple[int, ...], str]:
    """Shape and dtype of one layer's share of one page of `page_tokens` tokens (a "cell") of the kind
    whose tensors have `role` and `spec`: K then V heads per token, indexer keys or MLA latent rows per
    token, DeepSeek-V4's rows and entries, or one float32 recurrent state. An FP8 K/V head row or latent
    row is its packed bytes as words of the model's dtype (`fp8_row_bytes`)."""
    if role == "kv":
        return (page_tokens, 2 * cfg.num_kv_heads, _row_width(cfg, cfg.head_dim)), cfg.dtype
    if role == "index":
        return (page_tokens, cfg.block_sparse.index_head_dim), cfg.dtype
    if role == "latent":
        return (page_tokens, _row_width(cfg, cfg.mla.latent_width)), cfg.dtype
    if role in COMPRESSED_ATTENTION_ROLES:
        return _compressed_attention_page(cfg, role, spec, page_tokens)
    return (cfg.kda.state_size,), "float32"  # a recurrent state, kept in float32 as the reference keeps it


def _row_width(cfg, values: int) -> int:
    """Words of the model's dtype one row of `values` takes: the values, or an FP8 row's packed bytes."""
    if not fp8_kv(cfg):
        return values
    word = _dtype_bytes(cfg)
    return fp8_row_bytes(values, word) // word


def dtype_bytes(dtype: str) -> int:
    """Bytes of one value of a KV dtype name."""
    if dtype not in _DTYPE_BYTES:
        raise InvalidRequestError(f"unsupported KV dtype {dtype!r}; expected one of {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[dtype]


def _compressed_attention_page(cfg, role: str, spec: KVSpec, page_size: int) -> tuple[tuple[int, ...], str]:
    """Page shape and dtype of a DeepSeek-V4 group: a row per token ("window"), an entry per `ratio`
    tokens ("entries", "index_entries"), float32 compressor inputs per token (width from the spec)."""
    if role == "window":
        return (page_size, cfg.head_dim), cfg.dtype
    if role == "entries":
        return (page_size // spec.ratio, cfg.head_dim), cfg.dtype
    if role == "index_entries":
        return (page_size // spec.ratio, cfg.compressed_attention.index_head_dim), cfg.dtype
    return (page_size, spec.entry_bytes // 4), "float32"


def state_group_ids(cfg) -> tuple[int, ...]:
    """Groups whose pages hold one recurrent state each (their batch table is the running state page)."""
    tensors = kv_tensors(cfg)
    return tuple(g for g, (spec, _) in enumerate(group_layers([t.spec for t in tensors])) if spec.hit_rule == "checkpoint")


def specs_from_model_config(cfg, checkpoint_interval: int = 64, owner: int = 0) -> list[KVSpec]:
    """The spec of every KV tensor of an `agentjax.config.ModelConfig`, in layer order
    (`kv_tensors` says which layer and role each belongs to), marked `owner`."""
    specs = [tensor.spec for tensor in kv_tensors(cfg, checkpoint_interval)]
    return [dataclasses.replace(spec, owner=owner) for spec in specs] if owner else specs
