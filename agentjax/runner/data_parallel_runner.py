"""The lockstep step of data-parallel ranks whose rows ask for more than plain tokens: structured output
(a token bitmask), log probabilities of sampled and prompt tokens, and penalties.

`DataParallelRunner.execute_ranks_extended` pads every rank's rows to common buckets as
`ShardedModelRunner.execute_ranks` does, gives every rank the same step variant (a rank whose rows ask
for nothing gets neutral inputs: an all-allowed bitmask, an empty penalty table, padding prompt
positions) with tables padded to the widest rank's, runs the sharded step once, and hands each rank
its tokens and, where it asked, the same dict `ModelRunner.execute_extended` returns. Host-side glue:
the step itself is agentjax/runner/sharded_step.py's, which runs the single-device sampler on each rank's rows.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from agentjax.buckets import lockstep_buckets
from agentjax.ragged_batch import RaggedBatch
from agentjax.runner.extras import PromptLogprobInputs, StepExtras, penalty_inputs, prompt_logprob_inputs
from agentjax.runner.sharded_runner import ShardedModelRunner, _common_page_tables, _sampling_metadata, _stacked

IDLE_SAMPLING = (0.0, 0, 1.0, 0, 0)


class DataParallelRunner(ShardedModelRunner):
    """The sharded runner of a data-parallel engine, with the lockstep step of the extras."""

    def execute_ranks_extended(self, rank_rows: Sequence[Sequence | None], rank_sampling: Sequence[Sequence | None],
                               rank_bitmasks: Sequence[np.ndarray | None], rank_extras: Sequence[StepExtras | None]
                               ) -> list:
        """One lockstep step (see `execute_ranks`) where some rank's rows carry a token bitmask
        (`[rows, words]`) or `StepExtras`. Returns per rank None (idle), its tokens, or for a rank that
        passed extras `(tokens, {"sampled": ..., "prompt": [...]})` as `ModelRunner.execute_extended`."""
        groups = len(self.kv_pages)
        idle_row = ([0], 0, [[0] for _ in range(groups)])
        rows = [list(r) if r else [idle_row] for r in rank_rows]
        sampling = [list(s) if r else [IDLE_SAMPLING] for r, s in zip(rank_rows, rank_sampling)]
        tokens_bucket, seqs_bucket = lockstep_buckets([sum(len(row[0]) for row in r) for r in rows],
                                                      [len(r) for r in rows], self.step_buckets)
        batches = _common_page_tables([
            RaggedBatch.build(r, self.page_size, state_groups=self.state_groups, token_buckets=(tokens_bucket,),
                              seq_buckets=(seqs_bucket,), page_buckets=self.step_buckets.pages) for r in rows])
        greedy_only = all(s[0] == 0.0 for per_rank in sampling for s in per_rank)
        metas = [_sampling_metadata(s, seqs_bucket, self.cfg.vocab_size, greedy_only) for s in sampling]
        for meta, mask in zip(metas, rank_bitmasks):
            if mask is not None:
                meta.token_bitmask[: len(mask)] = mask
        extras = [e if e else StepExtras() for e in rank_extras]
        penalties = _common_penalties(extras, seqs_bucket)
        prompts, slices = _common_prompt_inputs(extras, batches)
        mode = self.logprobs_mode if any(e.logprobs for e in extras) else None
        step = self.sharded.sampling_step(greedy_only, penalties=penalties is not None, logprobs_mode=mode,
                                          prompt_logprobs=prompts is not None)
        extended = penalties is not None or mode is not None or prompts is not None
        inputs = [(b, m, *((penalties[r] if penalties else None, prompts[r] if prompts else None) if extended else ()))
                  for r, (b, m) in enumerate(zip(batches, metas))]
        key = (*batches[0].shape_key(), greedy_only, "ranks", penalties is not None and penalties[0].token_ids.shape[1],
               mode, prompts is not None and prompts[0].indices.shape[0])
        started = time.perf_counter()
        with self._compiling(key):
            *results, self.kv_pages = step(self.params, self.kv_pages, self._global(_stacked(inputs), "data"),
                                           self._global(self._pcp_tokens(batches), "pcp"))
            results = self._fetch(tuple(results))
        self.last_device_s = time.perf_counter() - started
        tokens, aux = results[0], (results[1] if extended else {})
        out = []
        for rank, rank_row_list in enumerate(rank_rows):
            if not rank_row_list:
                out.append(None)
                continue
            rank_tokens = tokens[rank, : len(rank_row_list)]
            if rank_extras[rank] is None:
                out.append(rank_tokens)
                continue
            found: dict = {}
            if "sampled" in aux and extras[rank].logprobs:
                found["sampled"] = tuple(a[rank, : len(rank_row_list)] for a in aux["sampled"])
            if "prompt" in aux and slices[rank]:
                found["prompt"] = [(row, tuple(a[rank, start:stop] for a in aux["prompt"]))
                                   for row, start, stop in slices[rank]]
            out.append((rank_tokens, found))
        return out


def _common_penalties(extras: list[StepExtras], rows: int) -> list | None:
    """Each rank's penalty table, padded to the widest rank's (zero entries change nothing); None when no
    rank's rows have penalties."""
    if not any(e.penalties for e in extras):
        return None
    tables = [penalty_inputs(rows, e.penalties) for e in extras]
    width = max(t.token_ids.shape[1] for t in tables)

    def widen(table):
        pad = ((0, 0), (0, width - table.token_ids.shape[1]))
        return table.__class__(table.presence, table.frequency, table.repetition,
                               *(np.pad(getattr(table, name), pad) for name in ("token_ids", "output_counts", "seen",
                                                                               "bias")))

    return [widen(t) for t in tables]


def _common_prompt_inputs(extras: list[StepExtras], batches: list[RaggedBatch]):
    """Each rank's prompt-position inputs padded to the longest rank's, and its output slices; (None, [])
    when no rank asks for prompt log probabilities."""
    if not any(e.prompt_positions for e in extras):
        return None, [[] for _ in extras]
    built = [prompt_logprob_inputs(b, e.prompt_positions) for b, e in zip(batches, extras)]
    size = max(inputs.indices.shape[0] for inputs, _ in built)
    padded = [PromptLogprobInputs(np.pad(inputs.indices, (0, size - inputs.indices.shape[0])),
                                  np.pad(inputs.targets, (0, size - inputs.targets.shape[0]))) for inputs, _ in built]
    return padded, [slices for _, slices in built]
