"""The one place that picks, per op, a Pallas kernel or its pure-jnp reference.

Models call the ops here by name; `impl` comes from `ModelConfig.attention_impl`: "kernel" (the
Pallas kernel on a GPU, and the same kernel in interpret mode on a CPU, for tests and notebooks),
"reference" (the jnp reference, which is also the XLA path a CPU runs fastest) or "auto" (the
default: the kernel when JAX's default backend is a GPU, the reference on any other backend;
`resolve_attention_impl` makes that choice, and an engine makes it once when it starts, see
`EngineConfig.model_config_for`). Ops without a kernel of their own (DeepSeek-V4's row and entry
writes and its compressor pool) run their XLA version under every impl. FP8 KV pages (`fp8_kv=True`)
are read by the references only: "auto" then picks the reference and "kernel" is refused.
Only this module imports `pallas_kernels`, so models import nothing from a kernel file.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import block_sparse_attention as _bsa
from pallas_kernels import block_sparse_attention_kernels as _bsa_kernels
from pallas_kernels import dsv4_attention as _dsv4
from pallas_kernels import dsv4_attention_kernels as _dsv4_kernels
from pallas_kernels import dsv4_indexer_kernels as _dsv4_indexer
from pallas_kernels import kda as _kda
from pallas_kernels import kda_kernels as _kda_kernels
from pallas_kernels import mla_attention as _mla
from pallas_kernels import moe_grouped_matmul as _gmm
from pallas_kernels import paged_decode_attention_mgpu as _decode
from pallas_kernels import ragged_paged_attention as _rpa
from pallas_kernels import ragged_paged_attention_kernels as _rpa_kernels

# The grouped-matmul kernel's FP8 operand, which `models/quantized.py` builds from a stored weight.
Fp8Experts = _gmm.Fp8Experts

ATTENTION_IMPLS = ("auto", "reference", "kernel")


def resolve_attention_impl(impl: str, *, context_parallel: bool = False, backend: str | None = None,
                           fp8_kv: bool = False) -> str:
    """"kernel" or "reference" for a requested `impl`: "auto" is the kernel on a GPU backend
    (`backend`, default JAX's default backend) and the reference on any other backend, under
    context parallelism (whose ranks run the reference attention only) or with FP8 KV pages (`fp8_kv`,
    which only the references read); an explicit choice is kept ("kernel" with FP8 KV is refused)."""
    if impl not in ATTENTION_IMPLS:
        raise NotImplementedError(f"attention_impl={impl!r} is not available; choose one of {ATTENTION_IMPLS}")
    if fp8_kv and impl == "kernel":
        raise NotImplementedError(_FP8_KERNEL_ERROR.format(op="attention"))
    if impl != "auto":
        return impl
    if context_parallel or fp8_kv:
        return "reference"
    return "kernel" if (backend or jax.default_backend()) == "gpu" else "reference"


_FP8_KERNEL_ERROR = ("{op}: FP8 KV pages (kv_cache_dtype='fp8') are read by the XLA reference only; the Pallas "
                     "kernel path (attention_impl='kernel') has no FP8 KV yet: "
                     "use attention_impl 'auto' or 'reference'")


def _check_impl(op: str, impl: str, available: tuple[str, ...], fp8_kv: bool = False) -> str:
    """The concrete impl `op` runs for `impl` ("auto" resolved by the backend and FP8 KV)."""
    if fp8_kv and impl == "kernel":
        raise NotImplementedError(_FP8_KERNEL_ERROR.format(op=op))
    if impl == "auto":
        impl = resolve_attention_impl(impl, fp8_kv=fp8_kv)
    if impl not in available:
        raise NotImplementedError(f"{op}: attention_impl={impl!r} is not available; choose one of "
                                  f"{('auto',) + available}")
    return impl


def _paged_impl(op: str, impl: str, kwargs: dict) -> str:
    """`_check_impl` for an op over KV pages that may hold FP8 rows (`kwargs["fp8_kv"]`, which the models
    always pass): the kernels read plain pages only and take no `fp8_kv`, so it leaves `kwargs` for them."""
    chosen = _check_impl(op, impl, ("reference", "kernel"), kwargs.get("fp8_kv", False))
    if chosen == "kernel":
        kwargs.pop("fp8_kv", None)  # False here: FP8 pages with "kernel" were refused above
    return chosen


def _dispatch(op: str, impl, args: tuple, kwargs: dict, reference, kernel, *, paged: bool):
    """Run `op`: through a parallel layout's ops when `impl` is one (sharding/attention.py wraps the op),
    else its jnp `reference` or its `kernel` (interpret mode on a CPU); `paged`: an op over KV pages that
    may hold FP8 rows (`_paged_impl`)."""
    if not isinstance(impl, str):
        return getattr(impl, op)(*args, **kwargs)
    chosen = _paged_impl(op, impl, kwargs) if paged else _check_impl(op, impl, ("reference", "kernel"))
    if chosen == "reference":
        return reference(*args, **kwargs)
    return kernel(*args, interpret=not _on_gpu(), **kwargs)


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def ragged_paged_attention(*args, impl: str = "reference", **kwargs):
    """Write this step's K/V into its pages and attend (see pallas_kernels.ragged_paged_attention).

    "kernel" on a GPU: the Triton-style kernel, except that a step whose rows all hold one token
    runs the Mosaic GPU decode kernel (chosen at run time) when its shapes fit (never in
    batch-invariant numerics, so a token's arithmetic never depends on the batch).
    "kernel" on a CPU: the Triton-style kernel in interpret mode.
    """
    if not isinstance(impl, str):  # a parallel layout's ops (sharding/attention.py) wrap the op
        return impl.ragged_paged_attention(*args, **kwargs)
    if _paged_impl("ragged_paged_attention", impl, kwargs) == "reference":
        return _rpa.ragged_paged_attention(*args, **kwargs)
    return attention_kernels(*args, on_gpu=_on_gpu(), **kwargs)


def attention_kernels(*args, on_gpu: bool, **kwargs):
    """The kernel choice of `ragged_paged_attention(impl="kernel")` for a GPU or, interpreted, a CPU."""
    if not on_gpu:
        return _rpa_kernels.ragged_paged_attention_kernel(*args, interpret=True, **kwargs)
    q, kv_pages, kv_lens, cu_q_lens = args[0], args[3], args[4], args[6]
    if kwargs.get("batch_invariant") or _decode.unsupported_shapes(q, kv_pages):
        return _rpa_kernels.ragged_paged_attention_kernel(*args, **kwargs)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    decode_only = jnp.all((q_lens == 1) | (kv_lens == 0))
    return jax.lax.cond(
        decode_only,
        functools.partial(_decode.decode_attention_step, **kwargs),
        functools.partial(_rpa_kernels.ragged_paged_attention_kernel, **kwargs),
        *args,
    )


def grouped_matmul(lhs, rhs, group_sizes, *, impl: str = "reference", **kwargs):
    """MoE experts' grouped matmul over rows sorted by expert, plain, FP8 or MXFP4 weights
    (see pallas_kernels.moe_grouped_matmul). "kernel" runs in interpret mode on a CPU."""
    if _check_impl("grouped_matmul", impl, ("reference", "kernel")) == "reference":
        return _gmm.grouped_matmul_reference(lhs, rhs, group_sizes)
    return _gmm.grouped_matmul(lhs, rhs, group_sizes, interpret=not _on_gpu(), **kwargs)


def mla_paged_attention(*args, impl: str = "reference", **kwargs):
    """Write this step's MLA latent rows into their pages and attend with absorbed queries
    (see pallas_kernels.mla_attention). "kernel": the Triton-style kernel (interpret mode on a CPU),
    which needs the keyword arguments `kv_lens` and `cu_q_lens`."""
    return _dispatch("mla_paged_attention", impl, args, kwargs, _mla.mla_paged_attention,
                     _mla.mla_paged_attention_kernel, paged=True)


def index_select_blocks(*args, impl: str = "reference", **kwargs):
    """Write this step's indexer keys and pick each query's top key blocks per indexer head
    (see pallas_kernels.block_sparse_attention). "kernel": the block-score and top-k kernels
    (pallas_kernels.block_sparse_attention_kernels; interpret mode on a CPU), which need the keyword
    arguments `kv_lens` and `cu_q_lens`."""
    return _dispatch("index_select_blocks", impl, args, kwargs, _bsa.index_select_blocks,
                     _bsa_kernels.index_select_blocks_kernel, paged=False)


def block_sparse_attention(*args, impl: str = "reference", **kwargs):
    """Write this step's K/V and attend over the selected key blocks only
    (see pallas_kernels.block_sparse_attention). "kernel": the Triton-style kernel (interpret mode on a CPU)."""
    return _dispatch("block_sparse_attention", impl, args, kwargs, _bsa.block_sparse_attention,
                     _bsa_kernels.block_sparse_attention_kernel, paged=True)


def kimi_delta_attention(*args, impl: str = "reference", **kwargs):
    """KDA's short conv and gated delta rule over a ragged batch, each row's state in its state page
    (see pallas_kernels.kda). "kernel": the delta rule in the decode-step or chunked-scan kernel
    (pallas_kernels.kda_kernels; interpret mode on a CPU); batch-invariant numerics keep the reference."""
    return _dispatch("kimi_delta_attention", impl, args, kwargs, _kda.kimi_delta_attention,
                     _kda_kernels.kimi_delta_attention_kernel, paged=False)


def _dsv4_xla_op(op: str, impl: str):
    """A DeepSeek-V4 op without a kernel of its own (a scatter or the compressor pool): XLA's on every
    backend, under any impl."""
    impl = impl if isinstance(impl, str) else impl.base  # a parallel layout's ops wrap dsv4_attention only
    _check_impl(f"dsv4 {op}", impl, ("reference", "kernel"))
    return getattr(_dsv4, op)


def dsv4_write_rows(*args, impl: str = "reference", **kwargs):
    """Scatter DeepSeek-V4's per-token rows (window K=V rows, compressor inputs) into their pages
    (see pallas_kernels.dsv4_attention)."""
    return _dsv4_xla_op("write_rows", impl)(*args, **kwargs)


def dsv4_pool_blocks(*args, impl: str = "reference", **kwargs):
    """Softmax-pool the compressor inputs of each block that ends at a given token into its entry."""
    return _dsv4_xla_op("pool_blocks", impl)(*args, **kwargs)


def dsv4_write_entries(*args, impl: str = "reference", **kwargs):
    """Store compressed entries (or indexer keys) in their pages."""
    return _dsv4_xla_op("write_entries", impl)(*args, **kwargs)


def dsv4_indexer_topk(*args, impl: str = "reference", **kwargs):
    """The lightning indexer's top-k compressed entries per query token (-1 padded). "kernel": the
    score and top-k kernels (pallas_kernels.dsv4_indexer_kernels; interpret mode on a CPU)."""
    impl = impl if isinstance(impl, str) else impl.base  # the indexer is replicated over TP ranks
    if _check_impl("dsv4_indexer_topk", impl, ("reference", "kernel")) == "reference":
        return _dsv4.indexer_topk(*args, **kwargs)
    return _dsv4_indexer.indexer_topk_kernel(*args, interpret=not _on_gpu(), **kwargs)


def dsv4_attention(*args, impl: str = "reference", **kwargs):
    """Shared-KV MQA over a token's window rows and its selected (CSA) or all (HCA) compressed entries,
    with attention sinks. "kernel": the Triton-style kernel (interpret mode on a CPU)."""
    return _dispatch("dsv4_attention", impl, args, kwargs, _dsv4.sliding_compressed_attention,
                     _dsv4_kernels.sliding_compressed_attention_kernel, paged=False)