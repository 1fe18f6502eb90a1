"""What the roofline cost model needs to know about a model: weights by kind and, per layer kind,
the key streams a query token reads (with their FLOPs and bytes per entry) and its fixed state.

The full-size DeepSeek-V4-Pro, Kimi-K3 and MiniMax-M3 shapes are written out here from
../shared/ARCHITECTURES.md sections 0, 4 and 6 (the presets in agentjax/models/presets.py should
replace them once all three exist); `shape_from_model_config` derives a shape from any runnable
`ModelConfig` (SmolLM2, the tiny presets). Host only: never imports jax, never loads weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from agentjax.errors import InvalidRequestError

DTYPE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "fp8": 1.0, "mxfp4": 4.25 / 8, "nvfp4": 4.5 / 8}


@dataclass(frozen=True)
class KeyStream:
    """Entries one query token reads in one layer. Every `ratio` tokens are stored as one entry
    (compressed attention); only the last `window` tokens are visible (None: all); at most `topk`
    entries are selected (sparse attention). `tp_shards`: TP ranks the stored entries split across
    (GQA: the KV heads; a latent or an indexer key: 1, replicated).

    MLA rows of several tokens may instead expand each entry once (`expand_flops_per_entry`, the
    kv_b up-projection) and then pay `expanded_flops_per_entry` per query and entry; the cost model
    takes the cheaper form per row, as the prefill and decode kernels do.
    """

    flops_per_entry: float
    bytes_per_entry: float
    ratio: int = 1
    window: int | None = None
    topk: int | None = None
    tp_shards: int = 1
    expand_flops_per_entry: float = 0.0
    expanded_flops_per_entry: float = 0.0

    def entries(self, visible_tokens: np.ndarray) -> np.ndarray:
        """Entries read by a query that sees `visible_tokens` tokens (its position + 1)."""
        tokens = np.asarray(visible_tokens, dtype=np.float64)
        if self.window is not None:
            tokens = np.minimum(tokens, self.window)
        entries = np.floor(tokens / self.ratio) if self.ratio > 1 else tokens
        return np.minimum(entries, self.topk) if self.topk is not None else entries

    @property
    def stored_bytes_per_token(self) -> float:
        """Bytes a token adds to the cache for good (window streams are bounded: 0 here)."""
        return 0.0 if self.window is not None else self.bytes_per_entry / self.ratio

    @property
    def bounded_bytes(self) -> float:
        """Bytes a sequence holds at most for a window stream."""
        return self.window * self.bytes_per_entry / self.ratio if self.window is not None else 0.0


@dataclass(frozen=True)
class Mixer:
    """One token-mixer kind. `state_bytes`: fixed state a sequence holds per layer;
    `state_traffic_bytes`: state bytes read and written per row per step; `state_tp_shards`: TP
    ranks the state splits across; `state_flops_per_token`: recurrence FLOPs per token."""

    name: str
    streams: tuple[KeyStream, ...] = ()
    state_bytes: float = 0.0
    state_traffic_bytes: float = 0.0
    state_tp_shards: int = 1
    state_flops_per_token: float = 0.0

    @property
    def stored_bytes_per_token(self) -> float:
        return sum(s.stored_bytes_per_token for s in self.streams)

    @property
    def fixed_bytes_per_sequence(self) -> float:
        return self.state_bytes + sum(s.bounded_bytes for s in self.streams)


@dataclass(frozen=True)
class MoEShape:
    layers: int
    experts: int
    top_k: int
    params_per_expert: float
    bytes_per_param: float


@dataclass(frozen=True)
class ModelShape:
    """Weights: `dense_params` are every per-token weight outside the routed experts, the
    embedding and the LM head (attention projections, shared experts, dense FFNs, routers)."""

    name: str
    hidden: int
    vocab: int
    mixers: tuple[tuple[Mixer, int], ...]
    dense_params: float
    dense_bytes_per_param: float
    lm_head_params: float
    lm_head_bytes_per_param: float
    embedding_params: float
    moe: MoEShape | None
    page_tokens: int
    max_context: int
    activation_bytes: float = 2.0
    source: str = ""
    kv_dtype: str = ""  # what the KV streams' bytes assume ("fp8": ARCHITECTURES.md's plans)
    # The engine's accounting of KV memory (`engine_kv_terms`): when set, capacity comes from it
    kv_terms: tuple["KVTerm", ...] = ()

    @property
    def num_layers(self) -> int:
        return sum(count for _, count in self.mixers)

    @property
    def kv_bytes_per_token(self) -> float:
        return sum(count * mixer.stored_bytes_per_token for mixer, count in self.mixers)

    @property
    def fixed_bytes_per_sequence(self) -> float:
        return sum(count * mixer.fixed_bytes_per_sequence for mixer, count in self.mixers)

    @property
    def routed_params(self) -> float:
        return 0.0 if self.moe is None else self.moe.layers * self.moe.experts * self.moe.params_per_expert

    @property
    def active_params(self) -> float:
        """Per-token parameters (LM head and embedding included, as ARCHITECTURES.md counts)."""
        routed = 0.0 if self.moe is None else self.moe.layers * self.moe.top_k * self.moe.params_per_expert
        return self.dense_params + routed + self.lm_head_params + self.embedding_params

    @property
    def total_params(self) -> float:
        return self.dense_params + self.routed_params + self.lm_head_params + self.embedding_params

    def weight_bytes(self) -> dict[str, float]:
        """Stored weight bytes by kind (the embedding at the LM head's width)."""
        moe = self.moe
        return {"dense": self.dense_params * self.dense_bytes_per_param,
                "experts": 0.0 if moe is None else self.routed_params * moe.bytes_per_param,
                "lm_head": self.lm_head_params * self.lm_head_bytes_per_param,
                "embedding": self.embedding_params * self.lm_head_bytes_per_param}


@dataclass(frozen=True)
class KVTerm:
    """One KV kind's bytes in the engine's memory layout (agentjax/kv/layout.py), its page padding
    included: per token of context (kinds that grow) and per sequence (windows, states); `tp_shards`:
    TP ranks it splits across (1: replicated)."""

    role: str
    bytes_per_token: float
    bytes_per_sequence: float
    tp_shards: int


def engine_kv_terms(cfg, block_size: int = 16, memory_bytes: int = 100 << 30) -> tuple[KVTerm, ...]:
    """The KV terms of a `ModelConfig` by the engine's "pool" layout of `memory_bytes`."""
    from agentjax.kv.layout_build import build_layout

    layout = build_layout(cfg, block_size, memory_bytes=memory_bytes)
    heads = {"kv": cfg.num_kv_heads, "state": cfg.kda.num_heads if cfg.kda is not None else 1}
    terms = []
    for group in layout.groups:
        padding = layout.slab_words / (group.pages_per_slab * group.page_words)  # the slab's unused words
        if group.hit_rule == "checkpoint":
            pages = 1
        elif group.hit_rule == "window":
            pages = -(-group.hit_spec.window // group.tokens_per_page) + 1
        else:
            pages = 0
        for index in group.kinds:
            kind = layout.kinds[index]
            page = kind.slots * kind.cell_words * layout.word_bytes * padding
            per_token = page / group.tokens_per_page if group.hit_rule == "prefix" else 0.0
            terms.append(KVTerm(kind.role, per_token, page * pages, heads.get(kind.role, 1)))
    return tuple(terms)


def gqa(heads: int, kv_heads: int, head_dim: int, kv_bytes: float, window: int | None = None) -> Mixer:
    """Grouped-query attention: QK and PV are 2 FLOPs each per query head and key channel."""
    stream = KeyStream(4.0 * heads * head_dim, 2.0 * kv_heads * head_dim * kv_bytes, window=window, tp_shards=kv_heads)
    return Mixer("sliding_attention" if window else "full_attention", (stream,))


# ------------------------------------------------------------------ full-size shapes (ARCHITECTURES.md)

def _deepseek_v4_pro(kv_dtype: str = "fp8") -> ModelShape:
    """Sections 0, 4, 6: 30 CSA + 31 HCA layers, all with a 128-token SWA; 128 heads x 512 (MQA, K = V);
    fp8_ds_mla entries of 584 B, FP8 indexer keys of 132 B (64 heads x 128); with `kv_dtype`
    "bfloat16", the rows (1,024 B) and keys (256 B) the engine stores today."""
    per_key = 4.0 * 128 * 512
    row, key = (584.0, 132.0) if kv_dtype == "fp8" else (1024.0, 256.0)
    swa = KeyStream(per_key, row, window=128)
    csa = Mixer("dsv4_csa", (swa, KeyStream(per_key, row, ratio=4, topk=1024),
                             KeyStream(2.0 * 64 * 128, key, ratio=4)),
                state_bytes=8 * 8192 + 8 * 2048, state_traffic_bytes=2 * (8192 + 2048))
    hca = Mixer("dsv4_hca", (swa, KeyStream(per_key, row, ratio=128)),
                state_bytes=128 * 4096, state_traffic_bytes=2 * 4096)
    return ModelShape(
        name="deepseek-v4-pro", hidden=7168, vocab=129_280, mixers=((csa, 30), (hca, 31)),
        dense_params=23.5e9, dense_bytes_per_param=1.0,  # attention + shared experts in FP8
        lm_head_params=129_280 * 7168, lm_head_bytes_per_param=2.0, embedding_params=129_280 * 7168,
        moe=MoEShape(layers=61, experts=384, top_k=6, params_per_expert=3 * 7168 * 3072,
                     bytes_per_param=DTYPE_BYTES["mxfp4"]),
        page_tokens=256, max_context=1 << 20, kv_dtype=kv_dtype,
        source="ARCHITECTURES.md s.6: N_act 49.8B, W = 12.85 GB routed MXFP4 + 23.5 GB FP8 + 1.85 GB bf16 "
               "lm_head; mHC's 4 residual streams and MTP are not counted")


def _kimi_k3(kv_dtype: str = "fp8") -> ModelShape:
    """Sections 0, 4, 6: 24 gated NoPE MLA layers (96 heads, latent 512 + 64, fp8 KV, or `kv_dtype`) and
    69 KDA layers (96 heads x 128, fp32 state); latent MoE 7168 -> 3584, 896 experts, top-16."""
    mla_stream = KeyStream(2.0 * 96 * (576 + 512), 576.0 * DTYPE_BYTES.get(kv_dtype, 1.0),
                           expand_flops_per_entry=2.0 * 512 * 96 * (128 + 128),
                           expanded_flops_per_entry=2.0 * 96 * (192 + 128))
    mla = Mixer("mla", (mla_stream,))
    kda_state = 96 * 128 * 128 * 4 + 36_864 * 3 * 2
    kda = Mixer("kda", state_bytes=kda_state, state_traffic_bytes=2 * kda_state, state_tp_shards=96,
                state_flops_per_token=8.0 * 128 * 128 * 96)
    return ModelShape(
        name="kimi-k3", hidden=7168, vocab=163_840, mixers=((kda, 69), (mla, 24)),
        dense_params=54.4e9, dense_bytes_per_param=2.0,  # the 137 GB reading: only routed experts MXFP4
        lm_head_params=163_840 * 7168, lm_head_bytes_per_param=2.0, embedding_params=163_840 * 7168,
        moe=MoEShape(layers=92, experts=896, top_k=16, params_per_expert=3 * 3584 * 3072,
                     bytes_per_param=DTYPE_BYTES["mxfp4"]),
        page_tokens=64, max_context=1 << 20, kv_dtype=kv_dtype,
        source="ARCHITECTURES.md s.6: N_act 105.4B, routed active 48.6B MXFP4, the rest BF16 (W = 137 GB; "
               "76 GB if every Linear is MXFP4); block AttnRes not counted")


def _minimax_m3(kv_dtype: str = "fp8") -> ModelShape:
    """Sections 0, 4, 6: 3 dense GQA + 57 block-sparse GQA (64/4 heads x 128, top-16 blocks of 128,
    indexer 4 x 128 over one shared key); NVFP4 routed experts, FP8 other weights, fp8 KV and index
    (68,736 B per token), or KV and index in `kv_dtype`."""
    width = DTYPE_BYTES.get(kv_dtype, 1.0)
    attention = 6144 * 64 * 128 * 2 + 6144 * 4 * 128 * 2
    indexer = 6144 * 4 * 128 + 6144 * 128
    dense_ffn, expert = 3 * 6144 * 12_288, 3 * 6144 * 3072
    dense_params = 60 * attention + 57 * indexer + 3 * dense_ffn + 57 * expert + 57 * 6144 * 128
    sparse = Mixer("block_sparse_attention", (
        KeyStream(4.0 * 64 * 128, 2.0 * 4 * 128 * width, topk=16 * 128, tp_shards=4),
        KeyStream(2.0 * 4 * 128, 128.0 * width)))
    return ModelShape(
        name="minimax-m3", hidden=6144, vocab=200_064, mixers=((gqa(64, 4, 128, width), 3), (sparse, 57)),
        dense_params=dense_params, dense_bytes_per_param=1.0,
        lm_head_params=200_064 * 6144, lm_head_bytes_per_param=2.0, embedding_params=200_064 * 6144,
        moe=MoEShape(layers=57, experts=128, top_k=4, params_per_expert=expert, bytes_per_param=DTYPE_BYTES["nvfp4"]),
        page_tokens=128, max_context=524_288, kv_dtype=kv_dtype,
        source="ARCHITECTURES.md s.0/4/6 (426.2B total, 26.0B active); the NVFP4 variant's routed experts, "
               "FP8 attention/shared/dense weights, BF16 LM head (BF16 weights, 852 GB, do not fit 2 B300; "
               "MXFP8, 426 GB, leave KV for ~5 sessions of 140K); fp8 KV + fp8 index")


FULL_SIZE_SHAPES = {"deepseek-v4-pro": _deepseek_v4_pro, "kimi-k3": _kimi_k3, "minimax-m3": _minimax_m3}


# ------------------------------------------------------------------ from a runnable ModelConfig

def _attention_params(cfg) -> tuple[float, float]:
    """(per-layer projection params of a GQA layer, of an MLA layer)."""
    gqa_params = cfg.hidden_size * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    mla_params = 0.0
    if cfg.mla is not None:
        m = cfg.mla
        heads = cfg.num_heads
        q = (cfg.hidden_size * m.q_lora_rank + m.q_lora_rank * heads * m.qk_head_dim if m.q_lora_rank
             else cfg.hidden_size * heads * m.qk_head_dim)
        mla_params = (q + cfg.hidden_size * m.latent_width + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
                      + heads * m.v_head_dim * cfg.hidden_size * (2 if m.output_gate else 1))
    return gqa_params, mla_params


def _mixer_for(cfg, kind: str, kv_bytes: float) -> tuple[Mixer, float]:
    """(mixer, projection params) of one layer kind of a ModelConfig."""
    gqa_params, mla_params = _attention_params(cfg)
    if kind in ("full_attention", "sliding_attention"):
        window = cfg.sliding_window if kind == "sliding_attention" else None
        return gqa(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, kv_bytes, window), gqa_params
    if kind == "block_sparse_attention":
        b = cfg.block_sparse
        main = KeyStream(4.0 * cfg.num_heads * cfg.head_dim, 2.0 * cfg.num_kv_heads * cfg.head_dim * kv_bytes,
                         topk=b.topk_blocks * b.block_size, tp_shards=cfg.num_kv_heads)
        index = KeyStream(2.0 * b.index_num_heads * b.index_head_dim, b.index_head_dim * kv_bytes)
        index_params = cfg.hidden_size * b.index_head_dim * (b.index_num_heads + 1)
        return Mixer(kind, (main, index)), gqa_params + index_params
    if kind == "mla":
        m = cfg.mla
        heads = cfg.num_heads
        stream = KeyStream(2.0 * heads * (m.latent_width + m.kv_lora_rank), m.latent_width * kv_bytes,
                           expand_flops_per_entry=2.0 * m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim),
                           expanded_flops_per_entry=2.0 * heads * (m.qk_head_dim + m.v_head_dim))
        return Mixer(kind, (stream,)), mla_params
    if kind == "kda":
        k = cfg.kda
        state = 4.0 * k.state_size
        width = k.num_heads * k.head_dim
        return (Mixer(kind, state_bytes=state, state_traffic_bytes=2 * state, state_tp_shards=k.num_heads,
                      state_flops_per_token=8.0 * k.head_dim * k.head_dim * k.num_heads),
                6.0 * cfg.hidden_size * width)
    raise InvalidRequestError(f"layer kind {kind!r} has no cost-model shape; known: full_attention, "
                              "sliding_attention, block_sparse_attention, mla, kda")


def shape_from_model_config(cfg, page_tokens: int = 16) -> ModelShape:
    """The cost-model shape of a runnable `agentjax.config.ModelConfig` (weights and KV in its dtype)."""
    width = DTYPE_BYTES.get(cfg.dtype)
    if width is None:
        raise InvalidRequestError(f"dtype {cfg.dtype!r} has no byte width; known: {sorted(DTYPE_BYTES)}")
    counts: dict[str, int] = {}
    for kind in cfg.layer_types:
        counts[kind] = counts.get(kind, 0) + 1
    mixers, dense = [], 0.0
    for kind, count in counts.items():
        mixer, params = _mixer_for(cfg, kind, width)
        mixers.append((mixer, count))
        dense += params * count
    moe_shape = None
    gated_mlp = 3.0 * cfg.hidden_size * cfg.intermediate_size
    num_moe = sum(1 for kind in cfg.mlp_layer_types if kind == "moe")
    dense += gated_mlp * (cfg.num_layers - num_moe)
    if num_moe:
        moe = cfg.moe
        expert_width = moe.latent_size or cfg.hidden_size
        shared = moe.shared_intermediate_size or moe.expert_intermediate_size * moe.num_shared_experts
        latent = 2.0 * cfg.hidden_size * moe.latent_size if moe.latent_size else 0.0
        dense += num_moe * (3.0 * cfg.hidden_size * shared + cfg.hidden_size * moe.num_experts + latent)
        moe_shape = MoEShape(num_moe, moe.num_experts, moe.num_experts_per_token,
                             3.0 * expert_width * moe.expert_intermediate_size, width)
    vocab_params = float(cfg.vocab_size * cfg.hidden_size)
    return ModelShape(
        name=cfg.name, hidden=cfg.hidden_size, vocab=cfg.vocab_size, mixers=tuple(mixers),
        dense_params=dense, dense_bytes_per_param=width, lm_head_params=vocab_params,
        lm_head_bytes_per_param=width, embedding_params=0.0 if cfg.tie_word_embeddings else vocab_params,
        moe=moe_shape, page_tokens=page_tokens, max_context=cfg.max_position_embeddings,
        activation_bytes=width, source=f"derived from the ModelConfig of {cfg.name}")


def get_shape(name: str, kv_dtype: str | None = None, kv_cache_dtype: str = "auto") -> ModelShape:
    """A full-size shape by name, or `preset:NAME` / a model spec through its ModelConfig. A full-size
    shape's KV is what the engine stores (the preset's dtype, bfloat16; with the engine's
    `kv_cache_dtype="fp8"`, its attention kinds as FP8 rows with scales: refused for DeepSeek-V4), its
    capacity from the engine's layout (`engine_kv_terms`); `kv_dtype="fp8"`: ARCHITECTURES.md's plans
    (fp8 KV and index keys, fp8_ds_mla), beyond what the engine runs, capacity from the key streams."""
    if name in FULL_SIZE_SHAPES:
        if kv_dtype == "fp8":
            return FULL_SIZE_SHAPES[name]()
        import dataclasses

        from agentjax.models.presets import preset_config

        cfg = preset_config(name, abstract=True)
        if cfg.compressed_attention is not None:
            cfg = cfg.replace(compressed_attention=dataclasses.replace(cfg.compressed_attention,
                                                                       kv_format="model_dtype"))
        if kv_cache_dtype == "fp8":
            # the key streams' read traffic at 1 byte per value (ARCHITECTURES.md's fp8 plan: it counts
            # MiniMax-M3's index keys at 1 byte too); capacity from the engine's FP8 layout
            cfg = cfg.replace(kv_cache_dtype="fp8")
            return dataclasses.replace(FULL_SIZE_SHAPES[name](kv_dtype="fp8"), kv_dtype="fp8 (attention kinds)",
                                       kv_terms=engine_kv_terms(cfg))
        return dataclasses.replace(FULL_SIZE_SHAPES[name](kv_dtype=cfg.dtype), kv_terms=engine_kv_terms(cfg))
    if name.startswith("preset:"):
        from agentjax.models.presets import preset_config

        preset = name.removeprefix("preset:")
        cfg = preset_config(preset, abstract=True)
        if kv_cache_dtype == "fp8":  # capacity from the engine's FP8 layout; key streams at the model's width
            import dataclasses

            cfg = cfg.replace(kv_cache_dtype="fp8")
            return dataclasses.replace(shape_from_model_config(cfg), kv_dtype="fp8 (attention kinds)",
                                       kv_terms=engine_kv_terms(cfg))
        return shape_from_model_config(cfg)
    raise InvalidRequestError(f"unknown model shape {name!r}; known: {', '.join(FULL_SIZE_SHAPES)}, "
                              "or preset:NAME")
