"""N-gram prompt lookup: the continuation of the longest (then latest) earlier match of the suffix."""
from __future__ import annotations

import numpy as np

from agentjax.sampling_params import SamplingParams
from agentjax.scheduler.request import Request
from agentjax.spec_decode.ngram import NgramProposer, RequestTokens


def _propose(tokens, k, low=1, high=4):
    return NgramProposer(low, high).propose(np.asarray(tokens, np.int64), k)


def test_the_tokens_after_an_earlier_occurrence_of_the_suffix_are_proposed():
    assert _propose([1, 2, 3, 4, 5, 9, 2, 3], 3) == [4, 5, 9]


def test_the_longest_match_wins_over_a_later_shorter_one():
    # suffix [7, 2, 3]: matched in full at the start, only [2, 3] later
    assert _propose([7, 2, 3, 10, 11, 8, 2, 3, 20, 7, 2, 3], 2) == [10, 11]


def test_among_equally_long_matches_the_latest_wins():
    assert _propose([2, 3, 10, 5, 2, 3, 20, 6, 2, 3], 1) == [20]


def test_no_proposal_below_the_minimum_match_length_or_without_a_match():
    assert _propose([1, 2, 3, 9, 2, 3], 2, low=3) == []
    assert _propose([1, 2, 3, 4], 2) == []
    assert _propose([5], 2) == []


def test_the_proposal_stops_at_the_end_of_the_sequence_and_at_k():
    assert _propose([4, 5, 4, 5], 8) == [4, 5]
    assert _propose(list(range(10)) + [3], 2, low=1) == [4, 5]


def test_request_tokens_follow_the_output_as_it_grows():
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=8), frozenset())
    tokens = RequestTokens()
    assert tokens.of(request).tolist() == [1, 2, 3]
    request.output_token_ids += [4, 5]
    assert tokens.of(request).tolist() == [1, 2, 3, 4, 5]
    request.output_token_ids += list(range(6, 200))
    assert tokens.of(request).tolist() == [1, 2, 3] + list(range(4, 200))
    del request.output_token_ids[-10:]  # cut back (a stop inside a step's tokens): rebuilt
    assert tokens.of(request).tolist() == [1, 2, 3] + list(range(4, 190))
