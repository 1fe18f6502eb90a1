"""Every GPU kernel lowers for cuda on this CPU machine: the real Triton and Mosaic GPU lowerings
run (shape, block and backend mistakes surface here), only the final compile needs a GPU. Covers
ragged paged attention, the Mosaic GPU decode, the grouped matmul, MLA on the latent, KDA's decode
step and chunked scan, MiniMax-M3's block indexer and block-sparse attention, and DeepSeek-V4's
lightning indexer (scores, top-k) and window + compressed attention."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from agentjax import kernels
from pallas_kernels import block_sparse_attention_kernels as bsa
from pallas_kernels import dsv4_attention_kernels as dsv4_attention
from pallas_kernels import dsv4_indexer_kernels as dsv4_indexer
from pallas_kernels import kda_kernels
from pallas_kernels import mla_attention as mla
from pallas_kernels import moe_grouped_matmul as gmm
from pallas_kernels import paged_decode_attention_mgpu as decode
from pallas_kernels import ragged_paged_attention_kernels as rpa

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

# The Triton lowering reads the GPU's compute capability: lower against an abstract H200.
_H200 = jax.sharding.AbstractMesh(
    (1,), ("x",), abstract_device=jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu"))

TOKENS, SEQS, MAX_PAGES, PAGE_SIZE, HEADS, KV_HEADS, DIM = 256, 64, 128, 16, 32, 8, 128


def _lower_for_cuda(fn, *shapes) -> str:
    with jax.sharding.use_abstract_mesh(_H200):
        return jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()


def _spec(shape, dtype=jnp.int32):
    return jax.ShapeDtypeStruct(shape, dtype)


def _attention_shapes(dtype, tokens=TOKENS):
    return (_spec((tokens, HEADS, DIM), dtype), _spec((tokens, KV_HEADS, DIM), dtype),
            _spec((tokens, KV_HEADS, DIM), dtype), _spec((2, 1024, PAGE_SIZE, 2 * KV_HEADS, DIM), dtype),
            _spec((SEQS,)), _spec((SEQS, MAX_PAGES)), _spec((SEQS + 1,)), _spec((tokens,)), _spec(()),
            _spec((HEADS,), jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("options", [
    dict(),
    dict(sliding_window=512, soft_cap=30.0, use_sinks=True, num_kv_splits=4, query_rows=16, kv_block=128),
], ids=["plain", "window_cap_sinks_splits"])
def test_ragged_paged_attention_kernel_lowers_through_triton(dtype, options):
    options = dict(options)
    use_sinks = options.pop("use_sinks", False)

    def attend(q, k, v, kv_pages, kv_lens, tables, cu_q_lens, slots, layer, sinks):
        return rpa.ragged_paged_attention_kernel(
            q, k, v, kv_pages, kv_lens, tables, cu_q_lens, layer=layer, slot_mapping=slots, sm_scale=0.088,
            sinks=sinks if use_sinks else None, return_lse=True, **options)

    assert "__gpu$xla.gpu.triton" in _lower_for_cuda(attend, *_attention_shapes(dtype))


@pytest.mark.parametrize("options", [dict(), dict(sliding_window=4096, soft_cap=50.0, num_kv_splits=4,
                                                  max_concurrent_steps=2, block_kv=128)], ids=["plain", "all"])
def test_paged_decode_kernel_lowers_through_mosaic_gpu(options):
    def attend(q, kv_pages, kv_lens, tables, sinks):
        return decode.paged_decode_attention(q, kv_pages, kv_lens, tables, layer=1, sm_scale=0.088, sinks=sinks,
                                             **options)

    shapes = (_spec((SEQS, HEADS, DIM), jnp.bfloat16), _spec((2, 1024, PAGE_SIZE, 2 * KV_HEADS, DIM), jnp.bfloat16),
              _spec((SEQS,)), _spec((SEQS, MAX_PAGES)), _spec((HEADS,), jnp.float32))
    assert "mosaic_gpu" in _lower_for_cuda(attend, *shapes)


@pytest.mark.parametrize("tokens", [16, SEQS, 1024])
def test_gpu_dispatch_lowers_both_attention_kernels_under_one_cond(tokens):
    def attend(q, k, v, kv_pages, kv_lens, tables, cu_q_lens, slots, layer, sinks):
        return kernels.attention_kernels(q, k, v, kv_pages, kv_lens, tables, cu_q_lens, on_gpu=True, layer=layer,
                                         slot_mapping=slots, sm_scale=0.088, sinks=sinks, return_lse=True)

    text = _lower_for_cuda(attend, *_attention_shapes(jnp.bfloat16, tokens=tokens))
    assert "__gpu$xla.gpu.triton" in text and "mosaic_gpu" in text


@pytest.mark.parametrize("weights", ["bfloat16", "float32", "fp8", "mxfp4"])
def test_grouped_matmul_kernel_lowers_through_triton(weights):
    m, k, n, groups = 2048, 1024, 512, 16
    lhs_dtype = jnp.float32 if weights == "float32" else jnp.bfloat16
    rhs = {
        "bfloat16": _spec((groups, k, n), jnp.bfloat16),
        "float32": _spec((groups, k, n), jnp.float32),
        "fp8": gmm.Fp8Experts(_spec((groups, k, n), jnp.float8_e4m3fn), _spec((groups, k // 128, n // 128), jnp.float32)),
        "mxfp4": gmm.Mxfp4Experts(_spec((groups, k // 2, n), jnp.uint8), _spec((groups, k // 32, n), jnp.uint8)),
    }[weights]
    matmul = functools.partial(gmm.grouped_matmul, block_m=128, block_n=128, block_k=64, num_warps=8)
    assert "__gpu$xla.gpu.triton" in _lower_for_cuda(matmul, _spec((m, k), lhs_dtype), rhs, _spec((groups,)))


@pytest.mark.parametrize("options", [dict(), dict(head_block=32, num_kv_splits=4, kv_block=64)], ids=["plain", "tiled"])
def test_mla_kernel_lowers_through_triton(options):
    # Kimi-K3's latent: 512 + 64 wide, 96 heads.
    def attend(q, latent, pages, tables, slots, kv_lens, cu_q_lens, layer):
        return mla.mla_paged_attention_kernel(q, latent, pages, tables, layer=layer, slot_mapping=slots,
                                              kv_lens=kv_lens, cu_q_lens=cu_q_lens, value_dim=512, sm_scale=0.07,
                                              **options)

    shapes = (_spec((TOKENS, 96, 576), jnp.bfloat16), _spec((TOKENS, 576), jnp.bfloat16),
              _spec((2, 1024, PAGE_SIZE, 576), jnp.bfloat16), _spec((SEQS, MAX_PAGES)), _spec((TOKENS,)),
              _spec((SEQS,)), _spec((SEQS + 1,)), _spec(()))
    assert "__gpu$xla.gpu.triton" in _lower_for_cuda(attend, *shapes)


def test_kda_decode_and_chunk_kernels_lower_through_triton_under_one_cond():
    heads, dim, kernel = 8, 128, 4
    size = heads * dim * dim + 3 * heads * dim * (kernel - 1)

    def mix(mixed, g, beta, weight, pages, cu_q_lens, kv_lens, page_ids, seq_ids, slot):
        return kda_kernels.kimi_delta_attention_kernel(mixed, g, beta, weight, pages, cu_q_lens, kv_lens, page_ids,
                                                       slot=slot, token_seq_ids=seq_ids, num_heads=heads, head_dim=dim)

    shapes = (_spec((TOKENS, 3 * heads * dim), jnp.bfloat16), _spec((TOKENS, heads, dim), jnp.float32),
              _spec((TOKENS, heads), jnp.float32), _spec((3 * heads * dim, kernel), jnp.float32),
              _spec((2, 96, size), jnp.float32), _spec((SEQS + 1,)), _spec((SEQS,)), _spec((SEQS,)),
              _spec((TOKENS,)), _spec(()))
    text = _lower_for_cuda(mix, *shapes)
    assert text.count("__gpu$xla.gpu.triton") == 2


@pytest.mark.parametrize("block_size,index_heads,heads,kv_heads", [(128, 4, 64, 4), (4, 2, 4, 2)],
                         ids=["minimax_m3", "tiny_blocks"])
def test_block_indexer_and_sparse_attention_lower_through_triton(block_size, index_heads, heads, kv_heads):
    page_size, dim = 128, 128

    def select(q, k, pages, tables, positions, slots, kv_lens, cu_q_lens):
        return bsa.index_select_blocks_kernel(q, k, pages, tables, slot=1, token_positions=positions,
                                              slot_mapping=slots, kv_lens=kv_lens, cu_q_lens=cu_q_lens,
                                              block_size=block_size, topk_blocks=16, local_blocks=1)

    def attend(q, k, v, pages, tables, selected, seq_ids, positions, slots):
        return bsa.block_sparse_attention_kernel(q, k, v, pages, tables, selected, slot=1, token_seq_ids=seq_ids,
                                                 token_positions=positions, slot_mapping=slots, sm_scale=0.088,
                                                 block_size=block_size)

    text = _lower_for_cuda(select, _spec((TOKENS, index_heads, dim), jnp.bfloat16), _spec((TOKENS, dim), jnp.bfloat16),
                           _spec((2, 256, page_size, dim), jnp.bfloat16), _spec((SEQS, 64)), _spec((TOKENS,)),
                           _spec((TOKENS,)), _spec((SEQS,)), _spec((SEQS + 1,)))
    assert text.count("__gpu$xla.gpu.triton") == 2
    text = _lower_for_cuda(attend, _spec((TOKENS, heads, dim), jnp.bfloat16),
                           _spec((TOKENS, kv_heads, dim), jnp.bfloat16), _spec((TOKENS, kv_heads, dim), jnp.bfloat16),
                           _spec((2, 256, page_size, 2 * kv_heads, dim), jnp.bfloat16), _spec((SEQS, 64)),
                           _spec((TOKENS, index_heads, 16)), _spec((TOKENS,)), _spec((TOKENS,)), _spec((TOKENS,)))
    assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("index_heads,index_dim,topk,per_page", [(64, 128, 1024, 64), (4, 16, 8, 4)],
                         ids=["deepseek_v4_pro", "tiny_dsv4"])
def test_lightning_indexer_score_and_top_k_kernels_lower_through_triton(index_heads, index_dim, topk, per_page):
    # DeepSeek-V4-Pro: 64 indexer heads x 128, top-1024 of the 4:1 entries, 256-token pages (64 entries each).
    def select(q, weights, key_pages, tables, seq_ids, positions):
        return dsv4_indexer.indexer_topk_kernel(q, weights, key_pages, 1, tables, token_seq_ids=seq_ids,
                                        token_positions=positions, ratio=4, topk=topk, sm_scale=index_dim ** -0.5)

    text = _lower_for_cuda(select, _spec((TOKENS, index_heads, index_dim), jnp.bfloat16),
                           _spec((TOKENS, index_heads), jnp.float32), _spec((2, 512, per_page, index_dim), jnp.bfloat16),
                           _spec((SEQS, 128)), _spec((TOKENS,)), _spec((TOKENS,)))
    assert text.count("__gpu$xla.gpu.triton") == 3  # scores, top-k select, top-k order


@pytest.mark.parametrize("mode", ["window", "selected", "dense"], ids=["swa_mqa", "csa", "hca"])
def test_sliding_compressed_attention_kernel_lowers_through_triton(mode):
    # DeepSeek-V4-Pro: 128 query heads x 512 on one shared K=V row, window 128, top-1024 (CSA) or every
    # 128:1 entry (HCA); 64-token window pages.
    def attend(q, window_pages, window_tables, sinks, entry_pages, entry_tables, selected, seq_ids, positions):
        extra = {} if mode == "window" else dict(entry_pages=entry_pages, entry_slot=0,
                                                 entry_page_indices=entry_tables, ratio=4 if mode == "selected" else 128,
                                                 selected=selected if mode == "selected" else None)
        return dsv4_attention.sliding_compressed_attention_kernel(
            q, window_pages, 1, window_tables, sinks, token_seq_ids=seq_ids, token_positions=positions, window=128,
            sm_scale=512 ** -0.5, **extra)

    text = _lower_for_cuda(attend, _spec((TOKENS, 128, 512), jnp.bfloat16), _spec((2, 256, 64, 512), jnp.bfloat16),
                           _spec((SEQS, 4)), _spec((128,), jnp.float32), _spec((2, 512, 64, 512), jnp.bfloat16),
                           _spec((SEQS, 128)), _spec((TOKENS, 1024)), _spec((TOKENS,)), _spec((TOKENS,)))
    assert text.count("__gpu$xla.gpu.triton") == 1
