"""The device checks of the serving kernels, run by scripts/device_check.py: the Triton-style ragged paged
attention on decodes beside prefill chunks, decode attention (Triton-style and Mosaic GPU), and the grouped
matmul of the experts (its weight formats and its throughput).

Each `check_*(rec, dry, context)` compares a kernel with its jnp reference and times it, recording figures
into `rec` as it goes; it returns the check's `ok`. Real shapes on a GPU, small shapes in interpret mode with
`dry`. Never imported by the agentjax package.
"""
from __future__ import annotations

from device_check_measure import Recorder, lse_error, relative_error, timed


def _attention_shapes(dry: bool) -> dict:
    if dry:
        return dict(heads=4, kv_heads=2, dim=16, page_size=4, dtype="float32", tolerance=1e-4)
    return dict(heads=32, kv_heads=8, dim=128, page_size=16, dtype="bfloat16", tolerance=2e-2)


def _random_cache(rng, kv_lens, shapes, *, num_layers=1):
    """A KV cache whose rows own shuffled pages covering `kv_lens`, and their page tables."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    page_size = shapes["page_size"]
    pages_per_row = [-(-int(n) // page_size) for n in kv_lens]
    width = max(1, max(pages_per_row))
    pages = rng.permutation(np.arange(1, 1 + sum(pages_per_row)))
    tables = np.zeros((len(kv_lens), width), np.int32)
    start = 0
    for row, count in enumerate(pages_per_row):
        tables[row, :count] = pages[start:start + count]
        start += count
    shape = (num_layers, 1 + sum(pages_per_row), page_size, 2 * shapes["kv_heads"], shapes["dim"])
    kv_pages = jax.random.normal(jax.random.key(int(rng.integers(1 << 30))), shape, jnp.dtype(shapes["dtype"]))
    return kv_pages, jnp.asarray(tables)


def check_ragged_attention_mixed(rec: Recorder, dry: bool, context: dict) -> bool:
    """The Triton-style kernel against the reference on decodes beside 500-token prefill chunks."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from agentjax.ragged_batch import RaggedBatch
    from pallas_kernels import ragged_paged_attention as rpa
    from pallas_kernels import ragged_paged_attention_kernels as rpa_kernels

    shapes = _attention_shapes(dry)
    rng = np.random.default_rng(1)
    if dry:
        rows = [(1, 9), (30, 5), (1, 40), (1, 0)]
    else:
        rows = [(1, int(c)) for c in rng.integers(1, 8192, 60)] + [(500, 0), (500, 3000), (1, 0), (37, 20000)]
    ps = shapes["page_size"]
    kv_pages, tables = _random_cache(rng, [new + cached for new, cached in rows], shapes, num_layers=2)
    batch = RaggedBatch.build([([1] * new, cached, list(np.asarray(tables[i]))) for i, (new, cached) in enumerate(rows)],
                              ps)
    dtype = jnp.dtype(shapes["dtype"])
    q, k, v = (jax.random.normal(jax.random.key(i), (batch.num_tokens, h, shapes["dim"]), dtype)
               for i, h in enumerate((shapes["heads"], shapes["kv_heads"], shapes["kv_heads"])))
    sinks = jnp.asarray(rng.standard_normal(shapes["heads"]), jnp.float32)
    real = int(batch.cu_q_lens[-1])
    variants = {"plain": {}, "window_softcap_sinks": dict(sliding_window=1024 if not dry else 7, soft_cap=30.0,
                                                          sinks=sinks),
                "kv_splits_4": dict(num_kv_splits=4, kernel_only=True)}
    all_ok = True
    for name, options in variants.items():
        if rec.time_left() < 12 and name != "plain":
            rec.record(**{name: dict(skipped="the check's time is nearly spent")})
            continue
        options = dict(options)
        kernel_only = {"num_kv_splits": options.pop("num_kv_splits")} if options.pop("kernel_only", False) else {}
        common = dict(layer=1, token_seq_ids=batch.seq_ids, token_positions=batch.positions,
                      slot_mapping=batch.slot_mapping[0], sm_scale=shapes["dim"] ** -0.5, return_lse=True, **options)
        args = (q, k, v, kv_pages, batch.kv_lens, batch.page_indices[0], batch.cu_q_lens)
        with jax.default_matmul_precision("highest"):
            want = jax.jit(functools.partial(rpa.ragged_paged_attention, **common))(*args)
        got = jax.jit(functools.partial(rpa_kernels.ragged_paged_attention_kernel, interpret=dry, **common, **kernel_only))(*args)
        figures = dict(out_relative_error=relative_error(got[0][:real], want[0][:real]),
                       lse_max_error=lse_error(got[2][:real], want[2][:real]),
                       kv_pages_equal=bool(jnp.array_equal(got[1], want[1])))
        figures["ok"] = (figures["out_relative_error"] < shapes["tolerance"] and figures["lse_max_error"] < 5e-2
                         and figures["kv_pages_equal"])
        all_ok &= figures["ok"]
        rec.record(**{name: figures}, tokens=real, rows=len(rows))
    return all_ok


def _decode_problem(dry: bool, shapes: dict):
    import jax
    import jax.numpy as jnp
    import numpy as np

    batch, context = (4, 64) if dry else (64, 32768)
    rng = np.random.default_rng(2)
    kv_lens = np.full(batch, context, np.int32)
    kv_lens[0] = context - 5 if dry else context - 1000  # one ragged row
    kv_pages, tables = _random_cache(rng, kv_lens, shapes)
    q = jax.random.normal(jax.random.key(3), (batch, shapes["heads"], shapes["dim"]), jnp.dtype(shapes["dtype"]))
    bytes_read = int(kv_lens.sum()) * 2 * shapes["kv_heads"] * shapes["dim"] * jnp.dtype(shapes["dtype"]).itemsize
    return shapes, q, kv_pages, jnp.asarray(kv_lens), tables, bytes_read


def _decode_reference(shapes, q, kv_pages, kv_lens, tables):
    import jax

    from pallas_kernels.ragged_paged_attention import attend_paged

    with jax.default_matmul_precision("highest"):
        return jax.jit(lambda q, kv, t, p: attend_paged(q, kv, 0, t, p, sm_scale=shapes["dim"] ** -0.5))(
            q, kv_pages, tables, kv_lens - 1)


def _decode_check(rec: Recorder, dry: bool, attend, variants, *, shapes: dict, race_check=None) -> bool:
    shapes, q, kv_pages, kv_lens, tables, bytes_read = _decode_problem(dry, shapes)
    want_out, want_lse = _decode_reference(shapes, q, kv_pages, kv_lens, tables)
    rec.record(batch=int(q.shape[0]), context=int(kv_lens.max()), bytes_read=bytes_read)
    best, correct = None, True
    for name, options in variants.items():
        if rec.time_left() < 8 and best is not None:
            rec.record(skipped_variants_for_time=True)
            break
        fn = attend(shapes, options)
        out, lse = fn(q, kv_pages, kv_lens, tables)
        figures = dict(out_relative_error=relative_error(out, want_out), lse_max_error=lse_error(lse, want_lse))
        if race_check is not None:
            figures["races_found"] = race_check()
        figures["ok"] = (figures["out_relative_error"] < shapes["tolerance"] and figures["lse_max_error"] < 5e-2
                         and not figures.get("races_found", False))
        seconds = timed(fn, q, kv_pages, kv_lens, tables, iters=2 if dry else 10)
        figures.update(seconds=seconds, gb_per_s=bytes_read / seconds / 1e9)
        correct &= figures["ok"]
        rec.record(**{name: figures})
        if best is None or figures["gb_per_s"] > rec.figures[best]["gb_per_s"]:
            best = name
        rec.record(best_variant=best, best_gb_per_s=rec.figures[best]["gb_per_s"])
    return correct


def check_decode_attention_triton(rec: Recorder, dry: bool, context: dict) -> bool:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.ragged_paged_attention_kernels import paged_attention_kernel

    def attend(shapes, options):
        def run(q, kv_pages, kv_lens, tables):
            cu_q_lens = jnp.arange(q.shape[0] + 1, dtype=jnp.int32)
            return paged_attention_kernel(q, kv_pages, kv_lens, tables, cu_q_lens, layer=0,
                                          sm_scale=shapes["dim"] ** -0.5, interpret=dry, query_rows=16, **options)
        return jax.jit(run)

    variants = {
        "block64_split1": dict(kv_block=64, num_kv_splits=1, num_warps=4, num_stages=2),
        "block128_split1_stages3": dict(kv_block=128, num_kv_splits=1, num_warps=4, num_stages=3),
        "block64_split2": dict(kv_block=64, num_kv_splits=2, num_warps=4, num_stages=3),
        "block128_split4_warps8": dict(kv_block=128, num_kv_splits=4, num_warps=8, num_stages=3),
    }
    if dry:
        variants = {"block16_split1": dict(kv_block=16), "block16_split2": dict(kv_block=16, num_kv_splits=2)}
    return _decode_check(rec, dry, attend, variants, shapes=_attention_shapes(dry))


def check_decode_attention_mosaic(rec: Recorder, dry: bool, context: dict) -> bool:
    import jax

    from pallas_kernels.paged_decode_attention_mgpu import paged_decode_attention

    interpret, race_check = None, None
    if dry:
        from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as gpu_interpreter
        from jax.experimental.pallas import mosaic_gpu as plgpu

        interpret = plgpu.InterpretGPUParams(detect_races=True)

        def race_check():
            return bool(gpu_interpreter.get_races().races_found)

    def attend(shapes, options):
        return jax.jit(lambda q, kv, lens, tables: paged_decode_attention(
            q, kv, lens, tables, layer=0, sm_scale=shapes["dim"] ** -0.5, interpret=interpret, **options))

    variants = {
        "block64_stages2": dict(block_kv=64, max_concurrent_steps=2),
        "block64_stages4": dict(block_kv=64, max_concurrent_steps=4),
        "block128_stages2": dict(block_kv=128, max_concurrent_steps=2),
        "block64_stages3_split2": dict(block_kv=64, max_concurrent_steps=3, num_kv_splits=2),
    }
    shapes = _attention_shapes(dry)
    if dry:  # the kernel needs bfloat16, a head dim of 64 or more and pages of >= 8
        variants = {"block64_stages2_split2": dict(block_kv=64, max_concurrent_steps=2, num_kv_splits=2)}
        shapes = dict(shapes, dim=64, page_size=8, dtype="bfloat16", tolerance=2e-2)
    return _decode_check(rec, dry, attend, variants, shapes=shapes, race_check=race_check)


def _grouped_problem(rng, rows, groups, k, n, sizes=None):
    import jax
    import jax.numpy as jnp
    import numpy as np

    if sizes is None:
        sizes = rng.multinomial(rows, np.ones(groups) / groups)
    lhs = jax.random.normal(jax.random.key(int(rng.integers(1 << 30))), (rows, k), jnp.bfloat16)
    weights = jax.random.normal(jax.random.key(int(rng.integers(1 << 30))), (groups, k, n), jnp.bfloat16) * 0.05
    return lhs, weights, jnp.asarray(sizes, jnp.int32)


def check_grouped_matmul_formats(rec: Recorder, dry: bool, context: dict) -> bool:
    """bf16, FP8 and MXFP4 experts against dequantise-then-ragged_dot, over group-size patterns."""
    import functools

    import jax
    import numpy as np

    from pallas_kernels import moe_grouped_matmul as gmm

    rng = np.random.default_rng(4)
    rows, groups, k, n = (96, 4, 128, 64) if dry else (4096, 16, 1024, 512)
    patterns = {"uneven": None, "one_group": [0] * (groups - 1) + [rows], "empty_and_tail": [0, rows // 3] + [0] * (groups - 2)}
    blocks = dict(block_m=16, block_n=32, block_k=32) if dry else dict(block_m=64, block_n=128, block_k=64, num_warps=4)
    all_ok = True
    for fmt in ("bf16", "fp8", "mxfp4"):
        for pattern, sizes in patterns.items():
            lhs, weights, group_sizes = _grouped_problem(rng, rows, groups, k, n, sizes)
            rhs = {"bf16": weights, "fp8": gmm.quantize_fp8(weights, (128, 128) if not dry else (32, 32)),
                   "mxfp4": gmm.quantize_mxfp4(weights)}[fmt]
            with jax.default_matmul_precision("highest"):
                want = jax.jit(gmm.grouped_matmul_reference)(lhs, rhs, group_sizes)
            got = jax.jit(functools.partial(gmm.grouped_matmul, interpret=dry, **blocks))(lhs, rhs, group_sizes)
            error = relative_error(got, want) if float(abs(np.asarray(want, np.float32)).max()) > 0 else (
                float(abs(np.asarray(got, np.float32)).max()))
            ok = error < 2e-2
            all_ok &= ok
            rec.record(**{f"{fmt}_{pattern}": dict(relative_error=error, ok=ok)})
    return all_ok


def check_grouped_matmul_throughput(rec: Recorder, dry: bool, context: dict) -> bool:
    import functools

    import jax
    import numpy as np

    from pallas_kernels import moe_grouped_matmul as gmm

    rng = np.random.default_rng(5)
    tokens, top_k, groups, k, n = (32, 8, 8, 64, 64) if dry else (8192, 8, 128, 4096, 3072)
    lhs, weights, group_sizes = _grouped_problem(rng, tokens * top_k, groups, k, n)
    flops = 2 * tokens * top_k * k * n
    rec.record(rows=tokens * top_k, experts=groups, k=k, n=n, flops=flops)
    variants = {
        "m128_n128_k64_w4_s3": dict(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=3),
        "m128_n128_k64_w8_s4": dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4),
        "m128_n256_k64_w8_s3": dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3),
        "m64_n128_k64_w4_s4": dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4),
    }
    if dry:
        variants = {"m16_n32_k32": dict(block_m=16, block_n=32, block_k=32)}
    # Correctness on sampled groups (a full float32 reference at this size would not fit the time).
    ends = np.cumsum(np.asarray(group_sizes))
    samples = []
    for g in rng.choice(groups, 4, replace=False):
        start, stop = int(ends[g] - group_sizes[g]), int(ends[g])
        samples.append((start, stop, np.asarray(lhs[start:stop], np.float32) @ np.asarray(weights[g], np.float32)))
    best, correct = None, True
    for name, options in variants.items():
        if rec.time_left() < 8 and best is not None:
            rec.record(skipped_variants_for_time=True)
            break
        fn = jax.jit(functools.partial(gmm.grouped_matmul, interpret=dry, **options))
        out = np.asarray(fn(lhs, weights, group_sizes), np.float32)
        errors = [relative_error(out[start:stop], want) if stop > start else 0.0 for start, stop, want in samples]
        seconds = timed(fn, lhs, weights, group_sizes, iters=2 if dry else 10)
        figures = dict(sampled_relative_error=max(errors), seconds=seconds, tflop_per_s=flops / seconds / 1e12)
        figures["ok"] = figures["sampled_relative_error"] < 2e-2
        correct &= figures["ok"]
        rec.record(**{name: figures})
        if best is None or figures["tflop_per_s"] > rec.figures[best]["tflop_per_s"]:
            best = name
        rec.record(best_variant=best, best_tflop_per_s=rec.figures[best]["tflop_per_s"])
    best_options = variants[best]
    for fmt, rhs in (("fp8", gmm.quantize_fp8(weights, (128, 128) if not dry else (32, 32))),
                     ("mxfp4", gmm.quantize_mxfp4(weights))):
        if rec.time_left() < 8:
            break
        fn = jax.jit(functools.partial(gmm.grouped_matmul, interpret=dry, **best_options))
        seconds = timed(fn, lhs, rhs, group_sizes, iters=2 if dry else 5)
        rec.record(**{f"{fmt}_weights": dict(seconds=seconds, tflop_per_s=flops / seconds / 1e12)})
    return correct
