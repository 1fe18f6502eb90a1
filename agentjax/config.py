"""Frozen configuration dataclasses: the model's shape and the engine's settings.

`ModelConfig` describes one decoder (read from a GGUF file, an HF directory or a preset) and makes
its KV pages. `EngineConfig` holds the serving settings under their CLI names in snake case.
Host only at import time: jax is imported lazily inside `ModelConfig.new_kv_pages`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from agentjax.errors import InvalidRequestError
from agentjax.layer_configs import (BlockSparseConfig, CompressedAttentionConfig, HyperConnectionConfig,  # noqa: F401
                                    KDAConfig, MLAConfig, MoEConfig, RopeScaling)

# Token mixers: GQA over all earlier tokens or a window, MiniMax-M3's block-sparse GQA with its
# indexer, MLA over a latent cache, Kimi's KDA (linear attention with a recurrent state), and
# DeepSeek-V4's shared-KV MQA over a sliding window alone ("swa_mqa"), plus 4:1 compressed entries
# chosen by a lightning indexer ("csa") or plus 128:1 compressed entries attended densely ("hca").
LayerType = Literal["full_attention", "sliding_attention", "block_sparse_attention", "mla", "kda",
                    "swa_mqa", "csa", "hca"]
COMPRESSED_LAYER_TYPES = ("swa_mqa", "csa", "hca")
# "hash_moe": a MoE layer whose experts come from a token-id table (DeepSeek-V4's first layers).
MlpType = Literal["dense", "moe", "hash_moe"]
Numerics = Literal["fast", "batch_invariant"]




@dataclass(frozen=True)
class ModelConfig:
    """The shape of one decoder-only transformer: llama, gemma3, kimi_linear or minimax_m3.

    `layer_types` picks each layer's token mixer and `mlp_layer_types` its feed-forward block; the
    sub-configs (`mla`, `kda`, `block_sparse`, `moe`) hold what those kinds need.
    """

    architecture: Literal["llama", "gemma3", "kimi_linear", "minimax_m3", "deepseek_v4"]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling | None = None
    # Gemma-3 local layers use their own base frequency and no scaling.
    local_rope_theta: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[LayerType, ...] = ()
    mlp_layer_types: tuple[MlpType, ...] = ()
    tie_word_embeddings: bool = True
    # Gated activation of dense MLPs: SwiGLU, tanh-GELU, MiniMax's clamped SwiGLU ("swigluoai") or
    # Kimi-K3's SiTU-GLU ("situ", agentjax.models.activations).
    hidden_activation: Literal["silu", "gelu_tanh", "swigluoai", "situ"] = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    situ_beta: float = 4.0
    situ_linear_beta: float | None = 25.0
    # Kimi-K3's block attention residuals: a new residual block starts at every layer i with
    # i % attn_res_block_size == 0 and each block input is a learned softmax mix of the finished
    # block sums (agentjax/models/residual.py). None: the plain pre-norm residual.
    attn_res_block_size: int | None = None
    # DeepSeek-V4's mHC: several residual streams per token (agentjax/models/residual.py). None: one stream.
    hyper_connections: HyperConnectionConfig | None = None
    # RoPE rotates only the first `rotary_dim` channels of a head (None: all of them).
    rotary_dim: int | None = None
    mla: MLAConfig | None = None
    kda: KDAConfig | None = None
    block_sparse: BlockSparseConfig | None = None
    compressed_attention: CompressedAttentionConfig | None = None
    moe: MoEConfig | None = None  # for "moe" layers
    # Multi-token-prediction modules (MiniMax-M3's, DeepSeek-V4's; agentjax/models/mtp.py): loaded with
    # the model; run only by speculative decoding's "mtp" method, which sets `mtp_kv_cache` so that
    # their layers get KV tensors after the main layers' (agentjax/kv/cache_layout.py).
    num_mtp_modules: int = 0
    mtp_kv_cache: bool = False
    embedding_multiplier: float = 1.0
    attention_scale: float | None = None  # None: head_dim ** -0.5
    use_qk_norm: bool = False
    use_sandwich_norms: bool = False  # Gemma: norms after attention and after the MLP too
    final_logit_softcap: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"
    # Which implementation the paged, sparse and MoE ops run (agentjax/kernels.py): "kernel" (the
    # Pallas kernels; interpret mode on a CPU), "reference" (the jnp references, the XLA path a CPU
    # runs fastest) or "auto": the kernels when JAX's default backend is a GPU, else the references.
    attention_impl: Literal["auto", "reference", "kernel"] = "auto"
    # "fp8": the attention kinds' KV (GQA/MHA K/V, MLA latents) as float8_e4m3fn rows with a float32 scale
    # per row (agentjax/kv/cache_layout.py); "auto": the model's dtype.
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    name: str = "model"

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
        if not self.mlp_layer_types:
            object.__setattr__(self, "mlp_layer_types", ("dense",) * self.num_layers)
        for name in ("layer_types", "mlp_layer_types"):
            if len(getattr(self, name)) != self.num_layers:
                raise InvalidRequestError(
                    f"{name} has {len(getattr(self, name))} entries, expected num_layers={self.num_layers}"
                )
        needs = {"mla": "mla", "kda": "kda", "block_sparse_attention": "block_sparse"}
        for layer_type, field_name in needs.items():
            if layer_type in self.layer_types and getattr(self, field_name) is None:
                raise InvalidRequestError(f"{layer_type} layers need the {field_name} config")
        if {"moe", "hash_moe"} & set(self.mlp_layer_types) and self.moe is None:
            raise InvalidRequestError("moe and hash_moe layers need the moe config")
        if self.hyper_connections is not None and self.attn_res_block_size is not None:
            raise InvalidRequestError("hyper_connections and attn_res_block_size are two residual topologies; "
                                      "give at most one")
        if self.num_heads % self.num_kv_heads:
            raise InvalidRequestError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise InvalidRequestError("sliding_attention layers need sliding_window > 0")
        if self.block_sparse is not None:
            self._check_block_sparse()
        if set(COMPRESSED_LAYER_TYPES) & set(self.layer_types):
            self._check_compressed_attention()
        if self.num_mtp_modules < 0:
            raise InvalidRequestError(f"num_mtp_modules must be >= 0, got {self.num_mtp_modules}")
        if self.mtp_kv_cache and not self.num_mtp_modules:
            raise InvalidRequestError(f"mtp_kv_cache needs MTP modules; model {self.name!r} has num_mtp_modules=0")
        if self.attn_res_block_size is not None and self.attn_res_block_size < 1:
            raise InvalidRequestError(f"attn_res_block_size must be >= 1 or None, got {self.attn_res_block_size}")
        from agentjax.kv.cache_layout import check_kv_cache_dtype

        check_kv_cache_dtype(self)

    def _check_block_sparse(self) -> None:
        sparse = self.block_sparse
        if self.num_heads % sparse.index_num_heads:
            raise InvalidRequestError(
                f"block_sparse index_num_heads={sparse.index_num_heads} must divide num_heads={self.num_heads}"
            )
        if sparse.index_num_heads % self.num_kv_heads and self.num_kv_heads % sparse.index_num_heads:
            raise InvalidRequestError(
                f"block_sparse index_num_heads={sparse.index_num_heads} must be a multiple or a divisor of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.rope_dim > sparse.index_head_dim:
            raise InvalidRequestError(
                f"the indexer rotates rotary_dim={self.rope_dim} channels; index_head_dim must be at least that, "
                f"got {sparse.index_head_dim}"
            )

    def _check_compressed_attention(self) -> None:
        attention = self.compressed_attention
        if attention is None:
            raise InvalidRequestError("swa_mqa, csa and hca layers need the compressed_attention config")
        if self.num_kv_heads != 1:
            raise InvalidRequestError(f"swa_mqa, csa and hca layers have one K=V head; got num_kv_heads={self.num_kv_heads}")
        if self.num_heads % attention.o_groups:
            raise InvalidRequestError(
                f"compressed_attention o_groups={attention.o_groups} must divide num_heads={self.num_heads}")
        if not self.sliding_window:
            raise InvalidRequestError("swa_mqa, csa and hca layers need sliding_window > 0")
        if self.rope_dim > self.head_dim or self.rope_dim % 2:
            raise InvalidRequestError(f"rotary_dim must be even and at most head_dim={self.head_dim}, got {self.rope_dim}")

    @property
    def query_scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of a layer in tokens, or None for full attention."""
        windowed = ("sliding_attention",) + COMPRESSED_LAYER_TYPES
        return self.sliding_window if self.layer_types[layer] in windowed else None

    def layer_rope_theta(self, layer: int) -> float:
        if self.layer_types[layer] in ("csa", "hca"):
            return self.compressed_attention.compress_rope_theta
        if self.layer_types[layer] == "sliding_attention" and self.local_rope_theta is not None:
            return self.local_rope_theta
        return self.rope_theta

    def layer_rope_scaling(self, layer: int) -> RopeScaling | None:
        if self.layer_types[layer] in ("csa", "hca"):
            return self.compressed_attention.compress_rope_scaling
        if self.layer_types[layer] == "swa_mqa":
            return None
        if self.layer_types[layer] == "sliding_attention" and self.local_rope_theta is not None:
            return None
        return self.rope_scaling

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    def kv_bytes_per_page(self, page_size: int) -> int:
        """Device bytes behind one page id: every KV group's buffer has a slice for each page."""
        from agentjax.kv.cache_layout import kv_buffer_specs

        return sum(spec.bytes_per_page for spec in kv_buffer_specs(self, page_size))

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able fields (nested configs as dicts); `from_dict` inverts it."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> "ModelConfig":
        fields = dict(fields)
        nested = {"rope_scaling": RopeScaling, "mla": MLAConfig, "kda": KDAConfig, "block_sparse": BlockSparseConfig,
                  "hyper_connections": HyperConnectionConfig, "moe": MoEConfig}
        attention = fields.get("compressed_attention")
        if isinstance(attention, dict):
            scaling = attention.get("compress_rope_scaling")
            scaling = _from_plain(RopeScaling, scaling) if isinstance(scaling, dict) else scaling
            fields["compressed_attention"] = _from_plain(CompressedAttentionConfig,
                                                         {**attention, "compress_rope_scaling": scaling})
        for name, kind in nested.items():
            if isinstance(fields.get(name), dict):
                fields[name] = _from_plain(kind, fields[name])
        return _from_plain(cls, fields)

    def new_kv_pages(self, num_pages: int, page_size: int) -> tuple:
        """Zeroed KV buffers, one per KV group, each `[group_layers, num_pages, *page_shape]`.

        Attention groups hold `[page_size, 2 * kv_heads, head_dim]` per page (K heads then V heads),
        MLA `[page_size, latent_width]`, indexer keys `[page_size, index_head_dim]`, and recurrent
        state groups one float32 state per page. Page ids are shared by all groups. Page 0 is the
        null page: padding rows of a batch write there and nothing reads it.
        """
        import jax.numpy as jnp

        from agentjax.kv.cache_layout import kv_buffer_specs

        if num_pages < 2 or page_size < 1:
            raise InvalidRequestError(
                f"need num_pages >= 2 (page 0 is reserved) and page_size >= 1, "
                f"got num_pages={num_pages}, page_size={page_size}"
            )
        return tuple(jnp.zeros((spec.num_slots, num_pages, *spec.page_shape), dtype=spec.dtype)
                     for spec in kv_buffer_specs(self, page_size))


def _from_plain(kind, fields: dict[str, Any]):
    """A frozen dataclass from JSON fields: lists become tuples (the dataclasses hold tuples)."""
    return kind(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


@dataclass(frozen=True)
class EngineConfig:
    """Serving settings. Field names are the CLI flags in snake case."""

    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0
    # How KV memory is laid out (agentjax/kv/layout.py, docs/design/kv_memory.md): "pool" (one pool of
    # slabs, each page group's pages sized to what it stores), "shared" (one page id spans a page of every
    # KV kind) or "auto": "pool" wherever this engine's paths run on it. With "pool", num_kv_blocks counts
    # the bytes of that many "shared" pages.
    kv_layout: Literal["auto", "pool", "shared"] = "auto"
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the model's context
    long_prefill_token_threshold: int = 0  # 0: no cap
    prefill_schedule_interval: int = 1
    # Shorten a step's last prefill chunks when its tokens overflow a shape bucket (512, 1024, ...) by
    # less than the padding up to the next one (agentjax.scheduler.Scheduler._trim_to_bucket).
    trim_prefill_to_buckets: bool = True
    enable_prefix_caching: bool = True
    numerics: Numerics = "fast"
    seed: int = 0
    # What log probabilities report, by vLLM's names: raw_logprobs (the model's, before penalties and
    # sampling settings), raw_logits, processed_logprobs or processed_logits (after them).
    logprobs_mode: str = "raw_logprobs"
    # KV offload tiers (agentjax.kv.offload): pages of finished turns are stored there and loaded back
    # instead of recomputed. 0 / None: the tier is off. A tier asked for that cannot start is an error.
    host_cache_gb: float = 0.0  # host-memory page pool
    disk_cache_dir: str | None = None  # page files with checksums, kept across restarts
    disk_cache_gb: float = 16.0  # size cap of the disk tier
    mooncake_master: str | None = None  # HOST:PORT of a Mooncake Store master
    mooncake_segment_gb: float = 1.0  # memory this engine lends to the Mooncake pool
    kv_offload_retention: str = "interval"  # which blocks a turn stores: interval or marconi
    # Tokens between saved recurrent states (Kimi's KDA), a multiple of block_size; a prefix hit resumes
    # from the last one at or before the shared prefix. None: the model's cost-aware choice
    # (agentjax.kv.cache_layout.checkpoint_tokens).
    state_checkpoint_tokens: int | None = None
    # How long a load may wait on the disk or Mooncake tier without an answer (a page read, written or
    # failed) before it is given up: those tokens are recomputed and the tier is out of use for 30 s (a
    # dead peer costs a request at most this; a slow tier that keeps answering finishes its loads).
    kv_load_timeout_s: float = 1.0
    # The KV policy (agentjax.kv.policies.engine_policy) that orders evictions and hears every session
    # turn's end with its agent hints: "hints" (session pins, next use expected farthest first), "lru", "marconi".
    kv_policy: str = "hints"
    # Parallel layout by vLLM's names (sharding/mesh.py): TP, DP (DEP with expert parallelism), DCP inside
    # the TP group, PCP. `block_size` is a rank's page; with DCP the KV manager counts block_size x DCP.
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    # Several processes (hosts) through jax.distributed: the coordinator's HOST:PORT, how many
    # processes, and this one's id (0 runs the engine; the others follow its steps).
    coordinator_address: str | None = None
    num_processes: int = 1
    process_id: int = 0
    # Speculative decoding, as vLLM's `speculative_config`: {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_min": n, "prompt_lookup_max": m} (a dict, its JSON text, or a SpeculativeConfig; stored
    # parsed). None: off.
    speculative_config: Any = None
    # Which implementation the model's paged, sparse and MoE ops run: "kernel" (the Pallas kernels),
    # "reference" (the jnp references: the XLA path) or "auto" (default: the model config's choice,
    # whose own default picks the kernels on a GPU and the references on a CPU or under context
    # parallelism). See `model_config_for`.
    attention_impl: Literal["auto", "reference", "kernel"] = "auto"
    # The quantisation an HF checkpoint must declare, by vLLM's `--quantization` names ("fp8",
    # "deepseek_v4_fp8", "mxfp8", "modelopt_mxfp8", "modelopt_fp4", "compressed-tensors"); None: whatever
    # its quantization_config says (checkpoints/quant_config.py). Quantised weights stay quantised.
    quantization: str | None = None
    # KV storage by vLLM's names: "fp8" (float8_e4m3fn rows, a float32 scale per token and head) for the
    # attention kinds, on the XLA attention path; "auto": the model config's choice (its dtype by default).
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    # The sizes a step pads to (one compile each): agentjax.buckets.StepBuckets, a dict or its JSON; stored parsed.
    step_buckets: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.numerics not in ("fast", "batch_invariant"):
            raise InvalidRequestError(
                f"numerics must be 'fast' or 'batch_invariant', got {self.numerics!r}"
            )
        modes = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
        if self.logprobs_mode not in modes:
            raise InvalidRequestError(f"logprobs_mode must be one of {', '.join(modes)}; got {self.logprobs_mode!r}")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "prefill_schedule_interval"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("host_cache_gb", "disk_cache_gb", "mooncake_segment_gb"):
            if not getattr(self, name) >= 0:
                raise InvalidRequestError(f"{name} must be >= 0 GB, got {getattr(self, name)}")
        if self.attention_impl not in ("auto", "reference", "kernel"):
            raise InvalidRequestError(
                f"attention_impl must be 'auto', 'reference' or 'kernel', got {self.attention_impl!r}")
        if not self.kv_load_timeout_s > 0:
            raise InvalidRequestError(f"kv_load_timeout_s must be > 0 seconds, got {self.kv_load_timeout_s}")
        if self.kv_offload_retention not in ("interval", "marconi"):
            raise InvalidRequestError(
                f"kv_offload_retention must be 'interval' or 'marconi', got {self.kv_offload_retention!r}")
        if self.state_checkpoint_tokens is not None and (
                self.state_checkpoint_tokens < 1 or self.state_checkpoint_tokens % self.block_size):
            raise InvalidRequestError(f"state_checkpoint_tokens must be a positive multiple of block_size="
                                      f"{self.block_size}, got {self.state_checkpoint_tokens}")
        if self.kv_layout not in ("auto", "pool", "shared"):
            raise InvalidRequestError(f"kv_layout must be 'auto', 'pool' or 'shared', got {self.kv_layout!r}")
        if self.kv_policy not in ("lru", "hints", "marconi"):
            raise InvalidRequestError(f"kv_policy must be 'lru', 'hints' or 'marconi', got {self.kv_policy!r}")
        _ = self.parallel  # raises ParallelLayoutError on sizes < 1 or a DCP that does not divide TP
        from agentjax.kv_cache_dtype import check_kv_cache_dtype

        check_kv_cache_dtype(self)
        if self.num_processes < 1 or not 0 <= self.process_id < self.num_processes:
            raise InvalidRequestError(f"process_id must be in [0, num_processes={self.num_processes}), "
                                      f"got {self.process_id}")
        if self.num_processes > 1 and not self.coordinator_address:
            raise InvalidRequestError("num_processes > 1 needs coordinator_address (HOST:PORT of process 0)")
        from agentjax.spec_decode.config import SpeculativeConfig

        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        from agentjax.buckets import StepBuckets
        object.__setattr__(self, "step_buckets", StepBuckets.parse(self.step_buckets))

    def model_config_for(self, model_cfg: ModelConfig) -> ModelConfig:
        """`model_cfg` with this engine's KV cache dtype and the concrete attention implementation it runs:
        this setting unless "auto", else the model config's; "auto" there becomes "kernel" on a GPU and
        "reference" on a CPU, under decode/prefill context parallelism or with FP8 KV
        (`agentjax.kernels.resolve_attention_impl`, which looks at JAX's default backend)."""
        from agentjax.kv_cache_dtype import with_kv_cache_dtype
        from agentjax.kernels import resolve_attention_impl

        model_cfg = with_kv_cache_dtype(model_cfg, self)
        requested = model_cfg.attention_impl if self.attention_impl == "auto" else self.attention_impl
        parallel = self.parallel
        context_parallel = parallel.decode_context_parallel_size > 1 or parallel.prefill_context_parallel_size > 1
        impl = resolve_attention_impl(requested, context_parallel=context_parallel,
                                      fp8_kv=model_cfg.kv_cache_dtype == "fp8")
        return model_cfg if impl == model_cfg.attention_impl else model_cfg.replace(attention_impl=impl)

    @property
    def parallel(self):
        """The parallel layout (`sharding.mesh.ParallelConfig`)."""
        from sharding.mesh import ParallelConfig

        return ParallelConfig.from_settings(self)

    @property
    def kv_offload_enabled(self) -> bool:
        return bool(self.host_cache_gb > 0 or self.disk_cache_dir or self.mooncake_master)
