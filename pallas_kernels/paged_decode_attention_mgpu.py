"""Paged decode attention as a Mosaic GPU Pallas kernel (Hopper: TMA page copies and wgmma).

The decode-only case of `ragged_paged_attention` (each row one new token): one CUDA block per
(row, KV head, KV split) streams the row's pages through shared memory, `max_concurrent_steps`
blocks of `block_kv` keys in flight, and runs the GQA group's query heads (zero-padded to the
64 rows a wgmma needs) against them with an online softmax. Splits are merged by LSE, with the
sinks, outside the kernel. On a CPU it runs only in the Mosaic GPU interpreter (tests, with race
detection); the CPU runner never uses it. It reads pages only: the K/V write is the caller's.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float, Int

from agentjax.errors import KernelShapeError
from pallas_kernels.online_softmax import NEG_LARGE, online_softmax_result, online_softmax_step
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, soft_capped
from pallas_kernels.ragged_work import merge_attention_partials, with_sink_partial

WGMMA_ROWS = 64  # a warpgroup matmul's row count: the padded query rows of one GQA group


def _decode_kernel(
    layer_ref, kv_lens_ref, table_ref, q_ref, kv_ref, out_ref, lse_ref, q_smem, k_smem, v_smem, p_smem, q_barrier,
    k_barriers, v_barriers, *, block_kv, page_size, num_kv_heads, num_splits, max_steps, sm_scale, sliding_window,
    soft_cap,
):
    seq, kv_head, split = jax.lax.axis_index("seq"), jax.lax.axis_index("kv_head"), jax.lax.axis_index("split")
    layer = layer_ref[0]
    kv_len = kv_lens_ref[seq]
    max_pages = table_ref.shape[1]
    rows_per_copy = min(page_size, block_kv)
    copies_per_block = block_kv // rows_per_copy

    kv_begin = jnp.maximum(kv_len - sliding_window, 0) if sliding_window is not None else jnp.int32(0)
    block_lo = kv_begin // block_kv
    block_hi = (kv_len + block_kv - 1) // block_kv
    per_split = (block_hi - block_lo + num_splits - 1) // num_splits
    split_lo = jnp.minimum(block_lo + split * per_split, block_hi)
    num_steps = jnp.minimum(split_lo + per_split, block_hi) - split_lo

    plgpu.copy_gmem_to_smem(q_ref.at[seq, kv_head], q_smem, q_barrier)

    def issue(step, slot):
        for copy in range(copies_per_block):
            key = (split_lo + step) * block_kv + copy * rows_per_copy
            page = table_ref[seq, jnp.minimum(key // page_size, max_pages - 1)]
            rows = pl.ds(key % page_size, rows_per_copy)
            destination = pl.ds(copy * rows_per_copy, rows_per_copy)
            plgpu.copy_gmem_to_smem(kv_ref.at[layer, page, rows, kv_head], k_smem.at[slot, destination],
                                    k_barriers.at[slot])
            plgpu.copy_gmem_to_smem(kv_ref.at[layer, page, rows, num_kv_heads + kv_head],
                                    v_smem.at[slot, destination], v_barriers.at[slot])

    for step in range(max_steps):
        pl.when(step < num_steps)(functools.partial(issue, step, step))
    plgpu.barrier_wait(q_barrier)

    def attend_block(step, carry):
        slot = jax.lax.rem(step, max_steps)
        plgpu.barrier_wait(k_barriers.at[slot])

        def scores_scope(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
            return acc_ref[...]

        scores = pl.run_scoped(scores_scope, plgpu.ACC((WGMMA_ROWS, block_kv), jnp.float32)) * sm_scale
        scores = soft_capped(scores, soft_cap)
        key = (split_lo + step) * block_kv + plgpu.broadcasted_iota(
            jnp.int32, (WGMMA_ROWS, block_kv), 1, layout=plgpu.Layout.WGMMA)
        visible = key < kv_len
        if sliding_window is not None:
            visible &= key >= kv_begin
        scores = jnp.where(visible, scores, -jnp.inf)

        def weigh_values(p):
            # The probabilities go through shared memory (a wgmma operand the GPU interpreter can follow).
            p_smem[...] = p.astype(p_smem.dtype)
            plgpu.commit_smem()
            plgpu.barrier_wait(v_barriers.at[slot])

            def values_scope(acc_ref):
                plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
                return acc_ref[...]

            return pl.run_scoped(values_scope, plgpu.ACC((WGMMA_ROWS, q_smem.shape[-1]), jnp.float32))

        carry = online_softmax_step(carry, scores, weigh_values)
        # The slot's pages are consumed (the wgmmas above completed): refill it.
        pl.when(step + max_steps < num_steps)(lambda: issue(step + max_steps, slot))
        return carry

    init = (
        plgpu.layout_cast(jnp.full((WGMMA_ROWS,), NEG_LARGE, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        plgpu.layout_cast(jnp.zeros((WGMMA_ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        plgpu.layout_cast(jnp.zeros((WGMMA_ROWS, q_smem.shape[-1]), jnp.float32), plgpu.Layout.WGMMA),
    )
    # Straight from registers to global memory: the partials are small next to the pages read.
    out_ref[split, seq, kv_head], lse_ref[split, seq, kv_head] = online_softmax_result(
        jax.lax.fori_loop(0, num_steps, attend_block, init))


def unsupported_shapes(q: Array, kv_pages: Array, block_kv: int = 64) -> list[str]:
    """Why `paged_decode_attention` cannot take these operands (empty when it can)."""
    num_heads, dim = q.shape[-2:]
    _, _, page_size, kv2, kv_dim = kv_pages.shape
    num_kv_heads = kv2 // 2
    problems = []
    if q.dtype not in (jnp.bfloat16, jnp.float16) or kv_pages.dtype != q.dtype:
        problems.append(f"dtypes {q.dtype}/{kv_pages.dtype} (need bfloat16 or float16, equal)")
    if dim != kv_dim or dim % 64 or num_heads % num_kv_heads or num_heads // num_kv_heads > WGMMA_ROWS:
        problems.append(f"q {q.shape} against kv_pages {kv_pages.shape} (head dim a multiple of 64, "
                        f"at most {WGMMA_ROWS} query heads per KV head)")
    if page_size < 8 or block_kv % 64 or block_kv & (block_kv - 1) or (block_kv % page_size and page_size % block_kv):
        problems.append(f"page_size={page_size}, block_kv={block_kv} (page size >= 8; block_kv a power-of-two "
                        f"multiple of 64 that the page size divides or that divides the page size)")
    return problems


def paged_decode_attention(
    q: Float[Array, "seqs heads dim"],
    kv_pages: Float[Array, "layers pages page_size kv2 dim"],
    kv_lens: Int[Array, " seqs"],
    page_indices: Int[Array, "seqs max_pages"],
    *,
    layer: int | Int[Array, ""],
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: Float[Array, " heads"] | None = None,
    block_kv: int = 64,
    num_kv_splits: int = 1,
    max_concurrent_steps: int = 2,
    interpret=None,
) -> tuple[Float[Array, "seqs heads dim"], Float[Array, "seqs heads"]]:
    """Each row's single query token (`q[b]`, at position `kv_lens[b] - 1`) over its pages: `(out, lse)`.

    The semantics of `attend_paged` for one decode token per row (a row with `kv_lens` 0 gets out 0,
    LSE -inf or its sink). Needs bfloat16 or float16, a head dim that is a multiple of 64, a page
    size of at least 8 and `block_kv` a power-of-two multiple of 64 that is a multiple of the page
    size or divides it. `interpret`: None on a GPU, or `plgpu.InterpretGPUParams(...)` on a CPU.
    """
    problems = unsupported_shapes(q, kv_pages, block_kv)
    if problems:
        raise KernelShapeError("paged_decode_attention: unsupported " + "; ".join(problems))
    num_seqs, num_heads, dim = q.shape
    num_layers, num_pages, page_size, kv2, kv_dim = kv_pages.shape
    num_kv_heads = kv2 // 2
    group = num_heads // num_kv_heads

    q_rows = q.reshape(num_seqs, num_kv_heads, group, dim)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, WGMMA_ROWS - group), (0, 0)))
    swizzle = plgpu.SwizzleTransform(128)
    tiling = plgpu.TilingTransform((8, 128 // q.dtype.itemsize))
    max_steps = max(1, max_concurrent_steps)
    kernel = functools.partial(
        _decode_kernel, block_kv=block_kv, page_size=page_size, num_kv_heads=num_kv_heads, num_splits=num_kv_splits,
        max_steps=max_steps, sm_scale=float(sm_scale), sliding_window=sliding_window, soft_cap=soft_cap,
    )
    copies_per_block = block_kv // min(page_size, block_kv)
    outs, lses = plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((num_kv_splits, num_seqs, num_kv_heads, WGMMA_ROWS, dim), jnp.float32),
            jax.ShapeDtypeStruct((num_kv_splits, num_seqs, num_kv_heads, WGMMA_ROWS), jnp.float32),
        ),
        scratch_types=(
            plgpu.SMEM((WGMMA_ROWS, dim), q.dtype, transforms=(tiling, swizzle)),
            plgpu.SMEM((max_steps, block_kv, dim), q.dtype, transforms=(tiling, swizzle)),
            plgpu.SMEM((max_steps, block_kv, dim), q.dtype, transforms=(tiling, swizzle)),
            plgpu.SMEM((WGMMA_ROWS, block_kv), q.dtype, transforms=(tiling, swizzle)),
            plgpu.Barrier(num_arrivals=1),
            plgpu.Barrier(num_arrivals=copies_per_block, num_barriers=max_steps),
            plgpu.Barrier(num_arrivals=copies_per_block, num_barriers=max_steps),
        ),
        grid=(num_seqs, num_kv_heads, num_kv_splits),
        grid_names=("seq", "kv_head", "split"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(jnp.asarray(layer, jnp.int32).reshape(1), kv_lens.astype(jnp.int32), page_indices.astype(jnp.int32), q_rows,
      kv_pages)
    outs = outs[:, :, :, :group].reshape(num_kv_splits, num_seqs, num_heads, dim)
    lses = lses[:, :, :, :group].reshape(num_kv_splits, num_seqs, num_heads)
    out, lse = merge_attention_partials(*with_sink_partial(outs, lses, sinks))
    return out.astype(q.dtype), lse


def decode_attention_step(*args, interpret=None, **kwargs):
    """`ragged_paged_attention`'s contract for a batch whose rows all hold exactly one new token
    (the caller guarantees it): write the K/V, then `paged_decode_attention` (whose tuning keywords it
    takes). Token b is row b's token for b < rows; extra tokens (padding) get out 0 and LSE -inf."""
    return ragged_paged_attention(*args, attend=functools.partial(_attend_decode_rows, interpret=interpret), **kwargs)


def _attend_decode_rows(q, kv_pages, kv_lens, page_indices, cu_q_lens, **options):
    num_tokens, num_seqs = q.shape[0], kv_lens.shape[0]
    rows = min(num_tokens, num_seqs)
    out, lse = paged_decode_attention(q[:rows], kv_pages, kv_lens[:rows], page_indices[:rows], **options)
    real = (jnp.arange(rows) < cu_q_lens[-1])[:, None]
    out = jnp.zeros_like(q).at[:rows].set(jnp.where(real[..., None], out, 0))
    return out, jnp.full(q.shape[:2], -jnp.inf, jnp.float32).at[:rows].set(jnp.where(real, lse, -jnp.inf))
