"""`Speculator`: the draft tokens the scheduler adds to a decode row, and the acceptance counters.

The scheduler asks `propose(request, max_drafts)` for each decode row (its token budget counts the
drafts); a draft that the request's grammar would refuse is cut there, as it could never be accepted.
N-gram drafts are looked up here; the device methods ("mtp", "draft_model") propose in the step
(agentjax/runner/drafters.py) and the engine hands each row's drafts to `offer`, kept for the request
while its tokens stay as they were. After the step, `accept(drafts, sampled)` keeps the drafts while
they equal the target's own token at the position before them, and counts drafts, draft tokens and
accepted tokens per position under vLLM's names. Host only: never imports jax.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from agentjax.spec_decode.config import SpeculativeConfig
from agentjax.spec_decode.ngram import NgramProposer, RequestTokens


@dataclass
class SpecDecodeStats:
    """Counters as vLLM's `spec_decode_*` metrics: drafts (rows that carried draft tokens), draft tokens,
    accepted tokens, and accepted tokens by draft position (0 = the first draft token)."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_position = [0] * self.num_speculative_tokens

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def snapshot(self) -> dict:
        return {"num_speculative_tokens": self.num_speculative_tokens, "num_drafts": self.num_drafts,
                "num_draft_tokens": self.num_draft_tokens, "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_position": list(self.accepted_per_position)}


def accepted_prefix(drafts: list[int], sampled: list[int]) -> int:
    """How many drafts the target confirms: `sampled[i]` is the target's token at the position of
    `drafts[i]` (drawn from the logits after the tokens before it), so draft i stands while every
    draft up to it equals the target's token there."""
    count = 0
    while count < len(drafts) and drafts[count] == sampled[count]:
        count += 1
    return count


class Speculator:
    """Proposes draft tokens for decode rows (n-gram prompt lookup, or the drafts the device proposed)
    and keeps the acceptance counters."""

    def __init__(self, config: SpeculativeConfig, drafts_on_device: bool = False):
        self.config = config
        self.num_speculative_tokens = config.num_speculative_tokens
        self.drafts_on_device = drafts_on_device
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max) if config.method == "ngram" \
            else None
        self.tokens = RequestTokens()
        self.stats = SpecDecodeStats(config.num_speculative_tokens)
        # Device methods: request id -> (the request's token count the drafts follow, the drafts)
        self.pending: dict[str, tuple[int, list[int]]] = {}

    @property
    def chain_tokens(self) -> int:
        """Positions after a row's tokens whose KV a device drafter writes while proposing (its pages are
        reserved as lookahead when free)."""
        return self.num_speculative_tokens if self.drafts_on_device else 0

    def propose(self, request, max_drafts: int) -> list[int]:
        """At most `min(num_speculative_tokens, max_drafts)` draft tokens to follow `request`'s last token."""
        count = min(self.num_speculative_tokens, max_drafts)
        if count <= 0 or not request.allow_drafts:
            return []
        if self.drafts_on_device:
            drafts = self.device_drafts(request)[:count]
        else:
            drafts = self.proposer.propose(self.tokens.of(request), count)
        if drafts and request.matcher is not None:  # the grammar would mask the rest out anyway
            drafts = drafts[: request.matcher.validate_tokens(drafts)]
        return drafts

    def device_drafts(self, request) -> list[int]:
        """The drafts the device proposed after the request's last token ([] if its tokens changed since)."""
        entry = self.pending.get(request.request_id)
        return list(entry[1]) if entry is not None and entry[0] == request.num_tokens else []

    def offer(self, request, drafts: list[int]) -> None:
        """A device drafter's proposal for the request as it is now (the engine calls this after a step)."""
        self.pending[request.request_id] = (request.num_tokens, drafts)

    def offer_from_step(self, scheduled, drafts, groups) -> None:
        """Keep each row's device drafts (`drafts [rows, k]`) for its request when the row's sample was kept:
        as many as the drafter proposed on the row's pages (a chained position past them read the null
        page). A draft model's draft j was read at position C - 1 + j for C computed tokens, an MTP draft
        j > 1 at C + j - 2 (draft 1 from the last computed position)."""
        token_groups = [group for group in groups if group.spec.hit_rule != "checkpoint"]
        shift = 1 if self.config.method == "mtp" else 0
        for row, item in enumerate(scheduled):
            request = item.request
            computed = request.num_computed_tokens
            if not request.allow_drafts or computed != request.num_tokens - 1:
                continue  # a prompt chunk whose sample is dropped, or a request that takes no drafts
            covered = min(len(item.page_tables[g.group_id]) * g.tokens_per_page for g in token_groups)
            count = min(self.num_speculative_tokens, covered - computed + shift)
            self.offer(request, [int(t) for t in drafts[row, :max(0, count)]])

    def forget(self, request_id: str) -> None:
        self.pending.pop(request_id, None)

    def accept(self, drafts: list[int], sampled: list[int]) -> int:
        """The accepted count of one row's drafts (`sampled` holds 1 + len(drafts) tokens); counted."""
        accepted = accepted_prefix(drafts, sampled)
        self.stats.record(len(drafts), accepted)
        return accepted
