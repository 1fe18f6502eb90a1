"""Draft proposers that run on the device, inside the target's jitted step (speculative decoding's
"mtp" and "draft_model" methods).

A step verifies the drafts a decode row carries (the target samples at every draft position) and then
proposes the row's next drafts from the last accepted position, so the next step can verify them:

  * `MTPDrafter`: the model's MTP module reads every token's hidden state (or residual streams) with the
    embedding of the token after it (the known next token, or the one the step sampled), writing its own
    KV (slots of its layer in the model's KV groups); draft 1 comes from the last accepted position, and
    drafts 2..k chain the module on its own output, one token per row, as vLLM does (module `j % n`).
  * `DraftModelDrafter`: a separate small model with its own KV groups (after the target's in the one
    KV manager) runs over the step's tokens, then k more one-token passes from the bonus token. With a
    temperature its drafts are drawn from its distribution q, and the verifying step accepts a draft
    with probability min(1, p/q) or draws from the residual max(0, p - q) (`rejection_sample`). q is
    the draft model's own pass over the drafts in that step (in batch-invariant numerics bit-equal to
    the distribution the draft was drawn from). Greedy rows keep the exact argmax rule.

Chained positions write KV only where the row's page table has a page (else the null page); the host
keeps only drafts whose chain stayed on the row's pages (`Speculator`). Keys are the request's seed
folded with the token's output index and a purpose tag, so seeded requests are reproducible.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from agentjax.config import ModelConfig
from agentjax.kv_buffers import join_part, model_part
from agentjax.models.params import split_model
from agentjax.ragged_batch import RaggedBatch
from agentjax.runner.sampler import SamplingMetadata, _filter_top_k_top_p

@functools.lru_cache(maxsize=16)
def graph_of(cfg: ModelConfig) -> nnx.GraphDef:
    return split_model(cfg)[0]


# Purpose tags folded into a request's per-token key (tag 0, the plain key, draws the target's token).
ACCEPT_TAG, RESIDUAL_TAG, DRAFT_TAG = 1, 2, 3


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SpecInputs:
    """What a drafting step needs beyond the batch (host-built, padded like it)."""

    next_token_ids: np.ndarray  # [T] the token after each token when the host knows it, else -1 (sampled)
    draft_ids: np.ndarray  # [S] the draft that follows each sampled position (-1: the row's last sample)
    row_first_sample: np.ndarray  # [B] index of each row's first sample; S for padding rows

    @staticmethod
    def build(batch: RaggedBatch, rows, next_tokens) -> "SpecInputs":
        """From the batch and its rows; `next_tokens[row]` is the known token after the row's last one, or
        -1 (the row's last token is sampled and kept: a decode row, or a prompt's last chunk)."""
        next_ids = np.full(batch.num_tokens, -1, np.int32)
        first = np.full(batch.num_seqs, batch.num_samples, np.int32)
        offsets = batch.sample_offsets
        starts = np.flatnonzero(offsets == 0)
        first[: len(starts)] = starts
        counts = np.diff(np.append(starts, np.sum(offsets >= 0)))
        for row, ((tokens, _, _), known) in enumerate(zip(rows, next_tokens)):
            if counts[row] > 1:  # a drafting row: every position reads the token sampled there
                continue
            start, count = int(batch.cu_q_lens[row]), len(tokens)
            next_ids[start : start + count - 1] = tokens[1:]
            next_ids[start + count - 1] = known
        draft_ids = np.full(batch.num_samples, -1, np.int32)
        following = np.flatnonzero(offsets[1:] > 0)  # sample s+1 continues sample s's row
        draft_ids[following] = batch.token_ids[batch.logits_indices[following + 1]]
        return SpecInputs(next_ids, draft_ids, first)


def target_part(batch: RaggedBatch, num_groups: int, draft: bool = False) -> RaggedBatch:
    """The batch with the target's first `num_groups` page tables (or the rest: a draft's)."""
    part = slice(num_groups, None) if draft else slice(0, num_groups)
    return batch.replace(page_indices=batch.page_indices[part], slot_mapping=batch.slot_mapping[part])


def accepted_counts(batch: RaggedBatch, spec: SpecInputs, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(accepted drafts [B], index of the sample at the last accepted position [B])`: a row's drafts
    stand while each equals the token sampled at the position before it (the host applies the same rule)."""
    num_rows, num_samples = batch.num_seqs, batch.num_samples
    offsets = batch.sample_offsets
    rows = jnp.where(offsets >= 0, batch.seq_ids[batch.logits_indices], num_rows)
    stop = (spec.draft_ids != tokens) | (spec.draft_ids < 0)
    first_stop = jax.ops.segment_min(jnp.where(stop & (offsets >= 0), offsets, num_samples), rows,
                                     num_segments=num_rows + 1)[:num_rows]
    accepted = jnp.where(spec.row_first_sample < num_samples, first_stop, 0)
    return accepted, jnp.minimum(spec.row_first_sample + accepted, num_samples - 1)


def chain_batch(batch: RaggedBatch, positions: jax.Array, token_ids: jax.Array, active: jax.Array,
                page_sizes) -> RaggedBatch:
    """One token per row at `positions`, over the rows' page tables (`page_sizes`: tokens per page of
    each table, or one for all); a position past a row's pages (or an inactive row) writes into the null
    page."""
    rows = jnp.arange(batch.num_seqs, dtype=jnp.int32)
    positions = jnp.where(active, positions, 0).astype(jnp.int32)
    slots = []
    sizes = (page_sizes,) * len(batch.page_indices) if isinstance(page_sizes, int) else tuple(page_sizes)
    for table, page_size in zip(batch.page_indices, sizes):
        index = positions // page_size
        page = jnp.take_along_axis(table, jnp.clip(index, 0, table.shape[1] - 1)[:, None], axis=1)[:, 0]
        page = jnp.where(active & (index < table.shape[1]), page, 0)
        slots.append(page * page_size + positions % page_size)
    return RaggedBatch(token_ids=token_ids.astype(jnp.int32), positions=positions, seq_ids=rows,
                       slot_mapping=tuple(slots), cu_q_lens=jnp.arange(batch.num_seqs + 1, dtype=jnp.int32),
                       kv_lens=positions + 1, page_indices=batch.page_indices, logits_indices=rows,
                       sample_offsets=jnp.zeros_like(rows))


def chain_drafts(chained, start: int, stop: int, carry, first: jax.Array | None = None):
    """`(drafts [B, k], carry)`: `chained(step, carry) -> (carry, draft)` for steps `start..stop-1` in one
    device loop (`first`, when given, is draft 1). The loop body is compiled once whatever k is: chaining
    the drafter in Python unrolled it k times into the step, and step shapes of k = 5 took 15-30 s each
    to compile on a CPU."""
    num_rows = (first if first is not None else carry[0]).shape[0]
    offset = 0 if first is None else 1
    drafts = jnp.zeros((num_rows, offset + stop - start), jnp.int32)
    if first is not None:
        drafts = drafts.at[:, 0].set(first)

    def body(step, state):
        carry, drafts = state
        carry, draft = chained(step, carry)
        return carry, drafts.at[:, step - start + offset].set(draft)

    carry, drafts = jax.lax.fori_loop(start, stop, body, (carry, drafts))
    return drafts, carry


def _keys(meta: SamplingMetadata, counts: jax.Array, tag: int) -> jax.Array:
    return jax.vmap(lambda seed, count: jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), count), tag)
                    )(meta.seeds, counts)


def _processed(logits: jax.Array, meta: SamplingMetadata) -> jax.Array:
    """Logits scaled by each row's temperature and cut by its top-k/top-p (as the target's sampler does)."""
    return jax.vmap(lambda row, t, k, p: _filter_top_k_top_p(row / jnp.maximum(t, 1e-6), k, p)
                    )(logits.astype(jnp.float32), meta.temperature, meta.top_k, meta.top_p)


def rejection_sample(target: jax.Array, draft: jax.Array, draft_ids: jax.Array, tokens: jax.Array,
                     meta: SamplingMetadata) -> jax.Array:
    """Each sampled position's token under rejection sampling: where a draft drawn from q (the draft
    model's processed logits `draft`) follows and the row samples, keep it with probability min(1, p/q)
    (p from the target's processed logits `target`), else draw from max(0, p - q) normalised; elsewhere
    (greedy rows, a row's last sample) the plain `tokens`."""
    p, q = jax.nn.softmax(target, axis=-1), jax.nn.softmax(draft, axis=-1)
    draft_token = jnp.maximum(draft_ids, 0)[:, None]
    p_draft = jnp.take_along_axis(p, draft_token, axis=1)[:, 0]
    q_draft = jnp.take_along_axis(q, draft_token, axis=1)[:, 0]
    uniform = jax.vmap(jax.random.uniform)(_keys(meta, meta.num_generated, ACCEPT_TAG))
    keep = uniform * q_draft < p_draft
    residual = jnp.maximum(p - q, 0.0)
    residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p)
    redrawn = jax.vmap(jax.random.categorical)(_keys(meta, meta.num_generated, RESIDUAL_TAG), jnp.log(residual))
    chosen = jnp.where(keep, draft_ids, redrawn.astype(jnp.int32))
    return jnp.where((draft_ids >= 0) & (meta.temperature > 0), chosen, tokens)


@dataclass(frozen=True)
class MTPDrafter:
    """Drafts from the model's MTP modules (`cfg.mtp_kv_cache` set); see the module docstring."""

    cfg: ModelConfig
    num_speculative_tokens: int
    numerics: str
    page_size: int | tuple[int, ...]  # tokens per page of every page table (or one for all)

    def _model(self, params):
        return nnx.merge(graph_of(self.cfg), params)

    def forward(self, params, kv_pages, batch: RaggedBatch):
        return self._model(params).forward_with_mtp_input(kv_pages, batch, self.numerics)

    def logits(self, params, hidden):
        return self._model(params).logits(hidden, self.numerics)

    def finish(self, params, kv_pages, batch: RaggedBatch, sampling: SamplingMetadata, spec: SpecInputs,
               mtp_input, processed, tokens, greedy_only: bool):
        """`(tokens, drafts [B, k], kv_pages)`: the tokens as sampled, the next drafts from the MTP modules."""
        del processed, greedy_only  # MTP drafts are argmax; verification keeps the plain tokens
        model, numerics = self._model(params), self.numerics
        valid = jnp.where(batch.sample_offsets >= 0, batch.logits_indices, batch.num_tokens)
        sampled = jnp.zeros(batch.num_tokens, jnp.int32).at[valid].set(tokens, mode="drop")
        next_ids = jnp.where(spec.next_token_ids >= 0, spec.next_token_ids, sampled)
        modules = model.mtp
        hidden, normed, kv_pages = modules[0].run(model.embed_tokens(next_ids), mtp_input, kv_pages, batch, numerics)
        _, last = accepted_counts(batch, spec, tokens)
        index = batch.logits_indices[last]
        draft = jnp.argmax(model.logits(normed[index], numerics), axis=-1).astype(jnp.int32)
        hidden, position = hidden[index], batch.positions[index]
        active = spec.row_first_sample < batch.num_samples
        runs = [functools.partial(module.run, numerics=numerics) for module in modules]

        def chained(step, carry):
            hidden, draft, kv_pages = carry
            chain = chain_batch(batch, position + step, draft, active, self.page_size)
            args = (model.embed_tokens(draft), hidden, kv_pages, chain)
            hidden, normed, kv_pages = (runs[0](*args) if len(runs) == 1
                                        else jax.lax.switch(step % len(runs), runs, *args))
            draft = jnp.argmax(model.logits(normed, numerics), axis=-1).astype(jnp.int32)
            return (hidden, draft, kv_pages), draft

        drafts, (_, _, kv_pages) = chain_drafts(chained, 1, self.num_speculative_tokens, (hidden, draft, kv_pages),
                                                first=draft)
        return tokens, drafts, kv_pages


@dataclass(frozen=True)
class DraftModelDrafter:
    """Drafts from a separate model whose KV groups follow the target's; params are `(target, draft)`."""

    cfg: ModelConfig
    draft_cfg: ModelConfig
    num_target_groups: int  # the target's KV kinds (buffers), before the draft model's
    num_speculative_tokens: int
    numerics: str
    page_size: int | tuple[int, ...]  # tokens per page of every page table (or one for all)
    num_target_tables: int | None = None  # the target's page tables (None: one per kind)

    def _models(self, params):
        return nnx.merge(graph_of(self.cfg), params[0]), nnx.merge(graph_of(self.draft_cfg), params[1])

    @property
    def _tables(self) -> int:
        return self.num_target_groups if self.num_target_tables is None else self.num_target_tables

    def _draft_page_sizes(self):
        return self.page_size if isinstance(self.page_size, int) else self.page_size[self._tables:]

    def forward(self, params, kv_pages, batch: RaggedBatch):
        """The target's hidden states, and the draft model's logits at the sampled positions (its q there),
        each writing its own groups' KV."""
        target, draft = self._models(params)
        kinds, tables = self.num_target_groups, self._tables
        hidden, target_kv = target(model_part(kv_pages, kinds, tables, False), target_part(batch, tables), self.numerics)
        kv_pages = join_part(kv_pages, target_kv, kinds, False)
        draft_hidden, draft_kv = draft(model_part(kv_pages, kinds, tables, True),
                                       target_part(batch, tables, draft=True), self.numerics)
        draft_logits = draft.logits(jnp.take(draft_hidden, batch.logits_indices, axis=0), self.numerics)
        return hidden, draft_logits, join_part(kv_pages, draft_kv, kinds, True)

    def logits(self, params, hidden):
        return self._models(params)[0].logits(hidden, self.numerics)

    def finish(self, params, kv_pages, batch: RaggedBatch, sampling: SamplingMetadata, spec: SpecInputs,
               draft_logits, processed, tokens, greedy_only: bool):
        """`(tokens, drafts [B, k], kv_pages)`: rejection sampling where rows draw, then k draft-model steps."""
        if not greedy_only:
            tokens = rejection_sample(processed, _processed(draft_logits, sampling), spec.draft_ids, tokens, sampling)
        _, draft = self._models(params)
        kinds, tables, numerics = self.num_target_groups, self._tables, self.numerics
        draft_batch = target_part(batch, tables, draft=True)
        _, last = accepted_counts(batch, spec, tokens)
        position, token = batch.positions[batch.logits_indices[last]], tokens[last]
        active = spec.row_first_sample < batch.num_samples
        row_meta = jax.tree.map(lambda x: x[last], sampling)
        page_sizes = self._draft_page_sizes()

        def chained(step, carry):
            token, draft_kv = carry
            hidden, draft_kv = draft(draft_kv, chain_batch(draft_batch, position + step, token, active, page_sizes),
                                     numerics)
            logits = draft.logits(hidden, numerics)
            token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            if not greedy_only:  # drawn from q, keyed by the output index the draft would take
                keys = _keys(row_meta, row_meta.num_generated + step, DRAFT_TAG)
                drawn = jax.vmap(jax.random.categorical)(keys, _processed(logits, row_meta)).astype(jnp.int32)
                token = jnp.where(row_meta.temperature > 0, drawn, token)
            return (token, draft_kv), token

        drafts, (_, draft_kv) = chain_drafts(chained, 1, self.num_speculative_tokens + 1,
                                             (token, model_part(kv_pages, kinds, tables, True)))
        return tokens, drafts, join_part(kv_pages, draft_kv, kinds, True)
