"""The engine's bookkeeping for penalties and log probabilities, request by request.

`ExtrasTracker` keeps, for each request that asks, its output-token counts, its prompt's distinct
tokens (repetition penalty), its logit bias, and the prompt log probabilities found so far. For a
step it says what the rows need (`StepExtras`: only rows whose sampled token is kept get penalties
and sampled log probabilities; prefill rows get the prompt positions not yet covered) and turns the
device's arrays back into `TokenLogprobs`. Requests that ask for none of this cost nothing here.
Host only: never imports jax.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from agentjax.logprobs import TokenLogprobs
from agentjax.runner.extras import RowPenalties, StepExtras
from agentjax.sampling_params import SamplingParams


class RequestExtras:
    """One request's penalty inputs and prompt log probabilities."""

    def __init__(self, prompt: Sequence[int], sampling: SamplingParams, report_prompt: bool):
        self.logprobs = sampling.logprobs
        self.prompt_k = sampling.prompt_logprobs if report_prompt else None
        self.penalized = sampling.has_penalties
        self.presence = sampling.presence_penalty
        self.frequency = sampling.frequency_penalty
        self.repetition = sampling.repetition_penalty
        self.counts_outputs = bool(self.presence or self.frequency or self.repetition != 1.0)
        self.output_counts: dict[int, int] = {}
        self.prompt_tokens = (np.unique(np.asarray(prompt, np.int32)) if self.repetition != 1.0
                              else np.zeros(0, np.int32))
        bias = sampling.logit_bias or {}
        self.bias_ids = np.fromiter(bias.keys(), np.int32, len(bias))
        self.bias_values = np.fromiter(bias.values(), np.float32, len(bias))
        self.prompt_len = len(prompt)
        self.prompt_entries: list[TokenLogprobs | None] | None = (
            [None] * self.prompt_len if self.prompt_k is not None else None)
        self.prompt_covered = 0  # positions [0, covered) have their next token's log probabilities
        self.prompt_delivered = False

    @property
    def needed(self) -> bool:
        return self.logprobs is not None or self.prompt_k is not None or self.penalized

    def row_penalties(self) -> RowPenalties:
        out_ids = np.fromiter(self.output_counts.keys(), np.int32, len(self.output_counts))
        out_counts = np.fromiter(self.output_counts.values(), np.int32, len(self.output_counts))
        prompt, bias = len(self.prompt_tokens), len(self.bias_ids)
        return RowPenalties(
            self.presence, self.frequency, self.repetition,
            token_ids=np.concatenate([self.prompt_tokens, out_ids, self.bias_ids]),
            output_counts=np.concatenate([np.zeros(prompt, np.int32), out_counts, np.zeros(bias, np.int32)]),
            seen=np.concatenate([np.ones(prompt + len(out_ids), np.int32), np.zeros(bias, np.int32)]),
            bias=np.concatenate([np.zeros(prompt + len(out_ids), np.float32), self.bias_values]),
        )

    def prompt_positions(self, prompt: Sequence[int], start: int, count: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Offsets into a row that runs positions `[start, start + count)` whose next prompt token still
        needs its log probability, and those tokens."""
        if self.prompt_entries is None:
            return None
        first, stop = max(start, self.prompt_covered), min(start + count, self.prompt_len - 1)
        if first >= stop:
            return None
        return (np.arange(first - start, stop - start, dtype=np.int32),
                np.asarray(prompt[first + 1:stop + 1], np.int32))

    def record_prompt(self, start: int, offsets: np.ndarray, targets: np.ndarray, arrays: tuple) -> None:
        """Store the entries a row that started at `start` computed (`arrays` as `gather_logprobs`)."""
        chosen, ranks, top_ids, top_values = arrays
        k = self.prompt_k
        for i, offset in enumerate(offsets):
            position = start + int(offset) + 1  # the entry of the token the position predicts
            self.prompt_entries[position] = TokenLogprobs(
                int(targets[i]), float(chosen[i]), int(ranks[i]),
                tuple(int(t) for t in top_ids[i, :k]), tuple(float(v) for v in top_values[i, :k]))
        if len(offsets):
            self.prompt_covered = max(self.prompt_covered, start + int(offsets[-1]) + 1)

    def take_prompt_logprobs(self) -> list[TokenLogprobs | None] | None:
        """The prompt's entries (the first is None), once, when the first token is out."""
        if self.prompt_entries is None or self.prompt_delivered:
            return None
        self.prompt_delivered = True
        return self.prompt_entries

    def on_token(self, token: int) -> None:
        if self.counts_outputs:
            self.output_counts[token] = self.output_counts.get(token, 0) + 1


class ExtrasTracker:
    """`RequestExtras` by request id, and the per-step translation to and from the runner."""

    def __init__(self):
        self.requests: dict[str, RequestExtras] = {}

    def add(self, request_id: str, prompt: Sequence[int], sampling: SamplingParams, report_prompt: bool) -> None:
        extras = RequestExtras(prompt, sampling, report_prompt)
        if extras.needed:
            self.requests[request_id] = extras

    def remove(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def for_step(self, scheduled: Sequence) -> StepExtras:
        """What this step's rows need; `scheduled` items have `.request` and `.num_new_tokens`."""
        step = StepExtras()
        if not self.requests:
            return step
        for row, item in enumerate(scheduled):
            request = item.request
            extras = self.requests.get(request.request_id)
            if extras is None:
                continue
            start = request.num_computed_tokens
            if start < extras.prompt_len:
                positions = extras.prompt_positions(request.prompt_token_ids, start, item.num_new_tokens)
                if positions is not None:
                    step.prompt_positions.append((row, *positions))
            if start + item.num_new_tokens < request.num_tokens:
                continue  # a prefill chunk that is not the last: its sample is dropped
            if extras.logprobs is not None:
                step.logprobs.add(row)
            if extras.penalized:
                step.penalties[row] = extras.row_penalties()
        return step

    def record(self, scheduled: Sequence, step: StepExtras, results: dict) -> None:
        """Store the prompt log probabilities of this step (call before the scheduler advances)."""
        for (row, offsets, targets), (_, arrays) in zip(step.prompt_positions, results.get("prompt", ())):
            item = scheduled[row]
            extras = self.requests.get(item.request.request_id)
            if extras is not None:
                extras.record_prompt(item.request.num_computed_tokens, offsets, targets, arrays)

    def sampled(self, request_id: str, token: int, row: int, results: dict) -> TokenLogprobs | None:
        """The log probabilities of `token`, sampled in `row`, if its request asked for them."""
        extras = self.requests.get(request_id)
        if extras is None or extras.logprobs is None or "sampled" not in results:
            return None
        chosen, ranks, top_ids, top_values = results["sampled"]
        k = extras.logprobs
        return TokenLogprobs(token, float(chosen[row]), int(ranks[row]), tuple(int(t) for t in top_ids[row, :k]),
                             tuple(float(v) for v in top_values[row, :k]))
