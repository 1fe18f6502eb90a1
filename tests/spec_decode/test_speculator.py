"""The speculator's acceptance rule and counters, and its draft cuts (budget, grammar, penalties)."""
from __future__ import annotations

from agentjax.sampling_params import SamplingParams
from agentjax.scheduler.request import Request
from agentjax.spec_decode import SpeculativeConfig, Speculator, accepted_prefix


def _speculator(k=3) -> Speculator:
    return Speculator(SpeculativeConfig("ngram", k, prompt_lookup_min=1, prompt_lookup_max=3))


def test_drafts_stand_while_they_equal_the_targets_token_at_their_position():
    assert accepted_prefix([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accepted_prefix([5, 6, 7], [5, 9, 7, 8]) == 1  # draft 7 follows a rejected one
    assert accepted_prefix([5, 6, 7], [4, 6, 7, 8]) == 0


def test_counters_follow_vllms_spec_decode_metrics():
    speculator = _speculator()
    speculator.accept([5, 6, 7], [5, 6, 1, 2])
    speculator.accept([5], [5, 3])
    speculator.accept([1, 2, 3], [9, 9, 9, 9])
    assert speculator.stats.snapshot() == {"num_speculative_tokens": 3, "num_drafts": 3, "num_draft_tokens": 7,
                                           "num_accepted_tokens": 3, "accepted_per_position": [2, 1, 0]}


def test_proposals_respect_the_room_given_and_skip_requests_without_drafts():
    request = Request("r", [1, 2, 3, 4, 1, 2], SamplingParams(max_tokens=8), frozenset())
    speculator = _speculator(k=3)
    assert speculator.propose(request, 8) == [3, 4, 1]
    assert speculator.propose(request, 1) == [3]
    assert speculator.propose(request, 0) == []
    request.allow_drafts = False
    assert speculator.propose(request, 8) == []


class _Matcher:
    """Accepts tokens below 4 only."""

    def validate_tokens(self, tokens):
        return next((i for i, t in enumerate(tokens) if t >= 4), len(tokens))


def test_a_draft_the_grammar_refuses_ends_the_proposal():
    request = Request("r", [1, 2, 3, 4, 1, 2], SamplingParams(max_tokens=8), frozenset())
    request.matcher = _Matcher()
    assert _speculator(k=3).propose(request, 8) == [3]
