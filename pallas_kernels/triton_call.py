"""What every Triton-style Pallas kernel here shares: the `pallas_call` with Triton CompilerParams and the
interpret flag, tile checks, lanes, the spare row masked stores land on in interpret mode, a work item's
query rows and positions, the gather of a sequence's rows through its page table, and the binding of a
kernel entry's arguments to its reference's signature (one signature per contract).

The kernel bodies call the in-kernel helpers (they load through refs); nothing here decides numerics.
"""
from __future__ import annotations

import inspect
from types import SimpleNamespace

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from agentjax.errors import KernelShapeError
from pallas_kernels.ragged_work import next_power_of_two


def triton_call(kernel, *, out_shape, grid, name: str, num_warps: int, num_stages: int, interpret: bool, **options):
    """`pl.pallas_call` for Pallas' Triton backend: always Triton CompilerParams; `interpret` on a CPU."""
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
        **options,
    )


def spare_rows(interpret: bool) -> int:
    """Extra output rows for masked stores to land on in interpret mode (which writes masked lanes back
    with their old value, so they must never share a used row's address)."""
    return 1 if interpret else 0


def store_index(index, used, spare_index: int, interpret: bool):
    """Where each lane stores: its own index, or in interpret mode the spare row for an unused lane."""
    return jnp.where(used, index, spare_index) if interpret else index


def check_tiles(op: str, tiles: dict[str, int], sizes: dict[str, int] | None = None) -> None:
    """Tiles and dot rows must be powers of two >= 16; `sizes` (block or page sizes) powers of two."""
    for name, value in {**tiles, **(sizes or {})}.items():
        if value != next_power_of_two(value) or (name in tiles and value < 16):
            raise KernelShapeError(f"{op}: {name}={value} must be a power of two (>= 16 for tiles and dot rows)")


def lanes(width: int, minimum: int = 16):
    """`(lane, lane_used)`: `width` lanes padded to a power of two (at least `minimum`)."""
    lane = jnp.arange(max(minimum, next_power_of_two(width)), dtype=jnp.int32)
    return lane, lane < width


def item_rows(rows: int, heads_per_token: int, start, count, first_head=0, num_heads: int | None = None):
    """A work item's dot rows (token-major, `heads_per_token` heads per token from `first_head`):
    `(token, head, used)`; an unused row (past `count` tokens or `num_heads`) reads token 0, head 0."""
    row = jnp.arange(rows, dtype=jnp.int32)
    head = first_head + row % heads_per_token
    used = row // heads_per_token < count
    if num_heads is not None:
        used &= head < num_heads
    return jnp.where(used, start + row // heads_per_token, 0), jnp.where(used, head, 0), used


def query_positions(kv_lens_ref, cu_q_lens_ref, seq, start, token):
    """Positions of flat query tokens `token` of row `seq` and of the item's first token `start`
    (row `seq`'s KV after the step is `kv_lens[seq]`, its new tokens `cu_q_lens[seq]:cu_q_lens[seq+1]`)."""
    seq_start, seq_end = cu_q_lens_ref[seq], cu_q_lens_ref[seq + 1]
    context = kv_lens_ref[seq] - (seq_end - seq_start)
    return context + (token - seq_start), context + (start - seq_start)


def page_rows(table_ref, seq, index, used, slot, pages_per_slot: int, rows_per_page: int):
    """Flat rows (of a `[slots * pages * rows_per_page, ...]` buffer) of row `seq`'s per-sequence rows
    `index` (key positions or entry ids) in layer slot `slot`, through the row's page table."""
    page_slot = jnp.clip(index // rows_per_page, 0, table_ref.shape[1] - 1)
    page = plt.load(table_ref.at[jnp.full_like(page_slot, seq), page_slot], mask=used, other=0)
    return (slot * pages_per_slot + page) * rows_per_page + index % rows_per_page


def default_query_rows(query_rows: int | None, num_tokens: int, kv_lens) -> int:
    """Dot rows per program: the caller's, else 16 for a decode-shaped batch (a token per row) and 64 otherwise."""
    if query_rows is not None:
        return query_rows
    return 16 if num_tokens <= kv_lens.shape[0] else 64


def ragged_operands(slot, items, kv_lens, cu_q_lens, page_indices) -> tuple:
    """The leading operands of a kernel over work items of a ragged batch: the layer slot (`[1]`), the
    items' `(seq, start, count)`, the rows' KV lengths, query offsets and page tables, all int32."""
    return (jnp.asarray(slot, jnp.int32).reshape(1), *items, kv_lens.astype(jnp.int32), cu_q_lens.astype(jnp.int32),
            page_indices.astype(jnp.int32))


def contract_arguments(reference, args: tuple, kwargs: dict, *, tuning: bool = True) -> tuple[SimpleNamespace, dict]:
    """A kernel entry that takes its reference's arguments: `(arguments, options)`, the call bound to
    `reference`'s signature (with its defaults; by attribute), and the keywords it does not name (the
    kernel's tuning; without `tuning`, any such keyword is a TypeError)."""
    signature = inspect.signature(reference)
    options = {name: value for name, value in kwargs.items() if name not in signature.parameters}
    if options and not tuning:
        raise TypeError(f"{reference.__name__} kernel: unexpected keyword arguments {sorted(options)}")
    bound = signature.bind(*args, **{name: value for name, value in kwargs.items() if name not in options})
    bound.apply_defaults()
    return SimpleNamespace(**bound.arguments), options
