"""The KV policy protocol's base (agentjax/kv/policy.py): turn ends from agent hints, branch-point
pins and argument checks. Manager-driven behaviour: test_policy_order.py."""
import math

import numpy as np
import pytest

from agentjax.errors import InvalidRequestError
from agentjax.kv.policies import LRUPolicy
from agentjax.kv.policy import TurnEnd
from agentjax.scheduler.request import AgentHints


class Clock:
    def __init__(self, now=100.0):
        self.now = now

    def __call__(self):
        return self.now


def test_turn_end_from_agent_hints_copies_the_hint_fields():
    hints = AgentHints(session_id="s", parent_session_id="p", expected_next_turn_s=7.5, branch_point=True,
                       session_end=True)
    turn = TurnEnd.from_hints("s", [3, 4], 10.0, hints)
    assert (turn.expected_next_turn_s, turn.branch_point, turn.session_end, turn.parent_session_id) == (
        7.5, True, True, "p")
    assert TurnEnd.from_hints("s", [3], 1.0).expected_next_turn_s is None

def test_branch_pin_modes_pin_a_branch_points_prompt():
    clock = Clock(0.0)
    policy = LRUPolicy(clock, branch_pin="next_turn")
    policy.bind(10)
    policy.on_turn_end(TurnEnd("s", np.array([1, 2]), 0.0, expected_next_turn_s=5.0, branch_point=True))
    assert policy.num_pinned() == 2
    clock.now = 6.0
    assert policy.num_pinned() == 0
    policy = LRUPolicy(clock, branch_pin="session")
    policy.bind(10)
    policy.on_turn_end(TurnEnd("s", np.array([1, 2]), 6.0, expected_next_turn_s=5.0, branch_point=True))
    clock.now = 1e6
    assert policy.num_pinned() == 2
    policy.on_turn_end(TurnEnd("s", np.array([1, 2, 3]), 1e6, session_end=True))
    assert policy.num_pinned() == 0
    with pytest.raises(InvalidRequestError, match="branch_pin"):
        LRUPolicy(clock, branch_pin="always")

def test_pin_rejects_nan_expiry_and_pages_outside_the_pool():
    policy = LRUPolicy(Clock())
    policy.bind(8)
    with pytest.raises(InvalidRequestError, match="NaN"):
        policy.pin("k", [1], math.nan)
    with pytest.raises(InvalidRequestError, match=r"\[1, 8\)"):
        policy.pin("k", [9])
    with pytest.raises(InvalidRequestError, match=r"\[0, 8\)"):
        policy.on_turn_end(TurnEnd("s", np.array([8]), 0.0))
