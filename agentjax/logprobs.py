"""Token log probabilities as the host hands them out: one `TokenLogprobs` per sampled or prompt token.

The device computes, for each row that asks, the chosen token's value, its rank and the top
`MAX_LOGPROBS` alternatives (`agentjax/runner/sampler.py`); this module keeps a request's share
of them (its own k) and adds them up. Host only: never imports jax. Values are log probabilities
(or logits, under the `raw_logits` / `processed_logits` modes); a token the grammar or a -100 bias
rules out has -inf.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@dataclass(frozen=True)
class TokenLogprobs:
    """One position: the chosen (sampled or prompt) token, its value and rank (1 = most likely), and the
    `k` most likely tokens there, best first."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()

    def as_dict(self) -> dict[int, float]:
        """Token id -> value for the top tokens and the chosen one (vLLM's per-position dict)."""
        values = dict(zip(self.top_token_ids, self.top_logprobs))
        values.setdefault(self.token_id, self.logprob)
        return values


def cumulative_logprob(entries: Sequence[TokenLogprobs]) -> float:
    """The sum of the chosen tokens' values (how best_of ranks samples); -inf if any is -inf."""
    return math.fsum(e.logprob for e in entries)
