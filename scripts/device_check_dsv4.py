"""The device check of DeepSeek-V4's kernels (the lightning indexer's score and top-k kernels, the
window + compressed attention kernel), run by scripts/device_check.py.

`check_dsv4_indexer_attention(rec, dry, context)` compares the kernels with their jnp references
(pallas_kernels/dsv4_attention.py) and times them, recording figures into `rec` as it goes (a
timeout keeps what was recorded); it returns the check's `ok`. On a GPU: DeepSeek-V4-Pro's shapes
(ARCHITECTURES.md sections 4-6: 128 query heads x 512 on one shared K=V row, a 128-token window,
64 indexer heads x 128 with top-1024 over the 4:1 entries, 128:1 HCA entries, 256-token pages, so
64 CSA entries and 2 HCA entries per page; bfloat16) on a mixed batch (decodes beside 500-token
prefill chunks) for correctness, then decode at batch 64 x 32K for speed. Small shapes in interpret
mode with `dry`. The speed figures are reported against the measured copy bandwidth
(`context["ceilings"]`), not enforced: issue 15 sets targets only for decode attention and the
grouped matmul. Never imported by the agentjax package.
"""
from __future__ import annotations

import functools

from device_check_measure import relative_error, timed


def _shapes(dry: bool) -> dict:
    if dry:
        return dict(heads=4, dim=16, index_heads=2, index_dim=8, topk=5, csa_rate=4, hca_rate=16, page_size=16,
                    window=8, dtype="float32", tolerance=1e-4)
    return dict(heads=128, dim=512, index_heads=64, index_dim=128, topk=1024, csa_rate=4, hca_rate=128,
                page_size=256, window=128, dtype="bfloat16", tolerance=2e-2)


def _problem(rows, shapes: dict, rng):
    """Token metadata for `rows` = [(new, cached)] and random pages behind shuffled tables: the window
    group holds only the pages its rows' windows reach (the rest of a table is the null page 0, as
    the KV manager leaves it), the compressed groups every page of their rows."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    page_size, window = shapes["page_size"], shapes["window"]
    lengths = [new + cached for new, cached in rows]
    width = max(-(-n // page_size) for n in lengths)
    needed = [-(-n // page_size) for n in lengths]
    entry_pages = rng.permutation(np.arange(1, 1 + sum(needed)))
    entry_tables = np.zeros((len(rows), width), np.int32)
    window_tables = np.zeros((len(rows), width), np.int32)
    at, next_window_page = 0, 1
    for row, (count, (new, cached)) in enumerate(zip(needed, rows)):
        entry_tables[row, :count] = entry_pages[at:at + count]
        at += count
        first = max(0, cached - window + 1) // page_size  # the earliest page the row's first new token sees
        for page in range(first, count):
            window_tables[row, page] = next_window_page
            next_window_page += 1
    seq_ids = np.concatenate([np.full(new, row, np.int32) for row, (new, _) in enumerate(rows)])
    positions = np.concatenate([np.arange(cached, cached + new, dtype=np.int32) for new, cached in rows])
    dtype = jnp.dtype(shapes["dtype"])
    key = jax.random.key(int(rng.integers(1 << 30)))
    normal = lambda i, shape: jax.random.normal(jax.random.fold_in(key, i), shape, dtype)  # noqa: E731
    tokens, pages = len(seq_ids), 1 + sum(needed)
    csa_per_page, hca_per_page = page_size // shapes["csa_rate"], page_size // shapes["hca_rate"]
    return dict(
        seq_ids=jnp.asarray(seq_ids), positions=jnp.asarray(positions), window_tables=jnp.asarray(window_tables),
        entry_tables=jnp.asarray(entry_tables), kv_lens=np.asarray(lengths),
        q=normal(0, (tokens, shapes["heads"], shapes["dim"])),
        index_q=normal(1, (tokens, shapes["index_heads"], shapes["index_dim"])),
        index_weights=jax.random.normal(jax.random.fold_in(key, 2), (tokens, shapes["index_heads"]), jnp.float32)
        * shapes["index_heads"] ** -0.5,
        sinks=jax.random.normal(jax.random.fold_in(key, 3), (shapes["heads"],), jnp.float32),
        window_pages=normal(4, (1, next_window_page, page_size, shapes["dim"])),
        index_keys=normal(5, (1, pages, csa_per_page, shapes["index_dim"])),
        csa_entries=normal(6, (1, pages, csa_per_page, shapes["dim"])),
        hca_entries=normal(7, (1, pages, hca_per_page, shapes["dim"])),
    )


def _select_fn(impl, problem, shapes, dry, **options):
    import jax

    from pallas_kernels import dsv4_attention as reference
    from pallas_kernels import dsv4_indexer_kernels as indexer

    common = dict(token_seq_ids=problem["seq_ids"], token_positions=problem["positions"], ratio=shapes["csa_rate"],
                  topk=shapes["topk"], sm_scale=shapes["index_dim"] ** -0.5)
    if impl == "reference":
        fn = functools.partial(reference.indexer_topk, **common)
    else:
        fn = functools.partial(indexer.indexer_topk_kernel, interpret=dry, **common, **options)
    return jax.jit(lambda q, w, keys, tables: fn(q, w, keys, 0, tables))


def _attend_fn(impl, mode, problem, shapes, dry, **options):
    import jax

    from pallas_kernels import dsv4_attention as reference
    from pallas_kernels import dsv4_attention_kernels as attention

    common = dict(token_seq_ids=problem["seq_ids"], token_positions=problem["positions"], window=shapes["window"],
                  sm_scale=shapes["dim"] ** -0.5)
    fn = reference.sliding_compressed_attention if impl == "reference" else functools.partial(
        attention.sliding_compressed_attention_kernel, interpret=dry, **options)
    ratio = shapes["csa_rate"] if mode == "csa" else shapes["hca_rate"]

    def attend(q, window_pages, window_tables, sinks, entries, entry_tables, selected):
        extra = {} if mode == "swa_mqa" else dict(entry_pages=entries, entry_slot=0, entry_page_indices=entry_tables,
                                                  ratio=ratio, selected=selected if mode == "csa" else None)
        return fn(q, window_pages, 0, window_tables, sinks, **common, **extra)

    return jax.jit(attend)


def _attend_args(problem, mode, selected):
    entries = problem["hca_entries"] if mode == "hca" else problem["csa_entries"]
    return (problem["q"], problem["window_pages"], problem["window_tables"], problem["sinks"], entries,
            problem["entry_tables"], selected)


def _set_agreement(got, want) -> float:
    """The share of the reference's picks the kernel also picked (order aside)."""
    import numpy as np

    got, want = np.asarray(got), np.asarray(want)
    hits = total = 0
    for g, w in zip(got, want):
        picked = set(w[w >= 0].tolist())
        hits += len(picked & set(g[g >= 0].tolist()))
        total += len(picked)
    return hits / total if total else 1.0


def check_dsv4_indexer_attention(rec, dry: bool, context: dict) -> bool:
    """DeepSeek-V4-Pro's indexer selections against the reference (equal in float32; in bfloat16 at
    least 99% of the picks agree, near ties may part), attention over the reference's selection for
    swa_mqa, csa and hca layers, then decode at batch 64 x 32K context for speed."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    shapes = _shapes(dry)
    rng = np.random.default_rng(14)
    rec.record(shapes=shapes)
    cases = {
        "mixed": [(1, 9), (20, 5), (1, 40), (1, 0)] if dry else (
            [(1, int(c)) for c in rng.integers(1, 16000, 30)] + [(500, 0), (500, 3000), (37, 20000)]),
        "decode": [(1, 63)] * 4 if dry else [(1, 32767)] * 64,
    }
    itemsize = jnp.dtype(shapes["dtype"]).itemsize
    all_ok = True
    for name, rows in cases.items():
        if rec.time_left() < 15 and name != "mixed":
            rec.record(**{name: dict(skipped="the check's time is nearly spent")})
            continue
        problem = _problem(rows, shapes, rng)
        select_args = (problem["index_q"], problem["index_weights"], problem["index_keys"], problem["entry_tables"])
        with jax.default_matmul_precision("highest"):
            want_selected = _select_fn("reference", problem, shapes, dry)(*select_args)
        selector = _select_fn("kernel", problem, shapes, dry)
        got_selected = selector(*select_args)
        figures = dict(tokens=len(np.asarray(problem["seq_ids"])),
                       selection_equal=bool(np.array_equal(np.asarray(got_selected), np.asarray(want_selected))),
                       selection_set_agreement=_set_agreement(got_selected, want_selected))
        ok = figures["selection_equal"] if dry else figures["selection_set_agreement"] >= 0.99
        for mode in ("swa_mqa", "csa", "hca"):
            if rec.time_left() < 8:
                figures[f"{mode}_skipped"] = "the check's time is nearly spent"
                ok = ok and name != "mixed"
                continue
            args = _attend_args(problem, mode, want_selected)
            with jax.default_matmul_precision("highest"):
                want = _attend_fn("reference", mode, problem, shapes, dry)(*args)
            kernel = _attend_fn("kernel", mode, problem, shapes, dry)
            error = relative_error(kernel(*args), want)
            figures[f"{mode}_relative_error"] = error
            ok = ok and error < shapes["tolerance"]
            if name == "decode":
                seconds = timed(kernel, *args, iters=2 if dry else 10)
                ended = np.asarray(problem["positions"]) + 1
                keys = {"swa_mqa": 0, "csa": np.minimum(ended // shapes["csa_rate"], shapes["topk"]),
                        "hca": ended // shapes["hca_rate"]}[mode]
                rows_read = int(np.sum(np.minimum(ended, shapes["window"]) + keys))
                gb_per_s = rows_read * shapes["dim"] * itemsize / seconds / 1e9
                figures.update({f"{mode}_seconds": seconds, f"{mode}_gb_per_s": gb_per_s})
            rec.record(**{name: dict(figures, ok=ok)})
        if name == "decode" and rec.time_left() > 8:
            seconds = timed(selector, *select_args, iters=2 if dry else 10)
            key_bytes = int(np.sum((np.asarray(problem["positions"]) + 1) // shapes["csa_rate"])) * (
                shapes["index_dim"] * itemsize)
            figures.update(indexer_seconds=seconds, indexer_gb_per_s=key_bytes / seconds / 1e9)
            copy = context.get("ceilings", {}).get("copy_gb_per_s")
            figures["indexer_fraction_of_copy_bandwidth"] = figures["indexer_gb_per_s"] / copy if copy else None
        figures["ok"] = bool(ok)
        all_ok &= figures["ok"]
        rec.record(**{name: figures})
    return all_ok
