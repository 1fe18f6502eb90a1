"""Request.token_ids_between: a step's row without copying the whole sequence."""
from __future__ import annotations

from agentjax.sampling_params import SamplingParams
from agentjax.scheduler.request import Request


def test_token_ids_between_equals_slicing_the_whole_sequence():
    request = Request("r", list(range(10)), SamplingParams(), frozenset())
    request.output_token_ids = [100, 101, 102]
    whole = request.all_token_ids
    for start in range(0, 13):
        for stop in range(start + 1, 14):
            assert request.token_ids_between(start, stop) == whole[start:stop]
