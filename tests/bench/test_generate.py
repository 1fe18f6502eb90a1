"""The synthetic session generator: its defaults give the mission's workload figures."""
from __future__ import annotations

import numpy as np
import pytest

from agentjax.bench.generate import LogNormal, SessionGeneratorConfig, generate_sessions
from agentjax.bench.trace_stats import describe_sessions
from agentjax.bench.traces import iter_all_sessions, prompt_token_ids
from agentjax.errors import InvalidRequestError


@pytest.fixture(scope="module")
def default_statistics():
    return describe_sessions(generate_sessions(2_000))


# MISSION.md: 43 turns, 142K input, 444 output, 44% of sessions with subagents, median 4 rollouts.
MISSION_FIGURES = [
    ("main_turns_median", 43),
    ("input_tokens_median", 142_000),
    ("output_tokens_median", 444),
    ("subagent_session_share", 0.44),
    ("subagents_per_spawning_session_median", 4),
]


@pytest.mark.parametrize("name,mission_value", MISSION_FIGURES,
                         ids=[name for name, _ in MISSION_FIGURES])
def test_default_sessions_reproduce_the_mission_figures_within_10_percent(
        default_statistics, name, mission_value):
    measured = getattr(default_statistics, name)
    assert abs(measured - mission_value) <= 0.10 * mission_value, (name, measured)


def test_default_sessions_hit_an_infinite_cache_above_90_percent(default_statistics):
    assert default_statistics.infinite_cache_hit_rate > 0.90


def test_every_turn_extends_the_previous_one_by_a_short_prefill():
    for session in iter_all_sessions(generate_sessions(50)):
        for previous, turn in zip(session.turns, session.turns[1:]):
            assert turn.input_tokens >= previous.input_tokens + previous.output_tokens
            assert np.array_equal(turn.hash_ids[:len(previous.hash_ids)], previous.hash_ids)
            assert turn.think_time_s > 0 and turn.offset_s > previous.offset_s


def test_subagent_rollouts_fork_from_their_parent_turn_prefix():
    sessions = generate_sessions(40, SessionGeneratorConfig(subagent_session_share=1.0))
    for parent in sessions:
        assert parent.subagents
        for subagent in parent.subagents:
            fork = parent.turns[subagent.fork_turn]
            first = subagent.turns[0]
            assert subagent.parent_id == parent.session_id
            assert subagent.hash_scope == parent.hash_scope
            assert np.array_equal(first.hash_ids[:len(fork.hash_ids)], fork.hash_ids)
            assert first.input_tokens > fork.input_tokens
    parent, subagent = sessions[0], sessions[0].subagents[0]
    shared_tokens = len(parent.turns[subagent.fork_turn].hash_ids) * parent.block_size
    assert np.array_equal(prompt_token_ids(parent, parent.turns[subagent.fork_turn])[:shared_tokens],
                          prompt_token_ids(subagent, subagent.turns[0])[:shared_tokens])


def test_same_seed_gives_the_same_sessions_and_another_seed_does_not():
    def signature(seed: int) -> list[tuple[int, int, int]]:
        sessions = generate_sessions(20, SessionGeneratorConfig(seed=seed))
        return [(len(s.turns), s.turns[-1].input_tokens, len(s.subagents)) for s in sessions]

    assert signature(3) == signature(3)
    assert signature(3) != signature(4)


def test_every_distribution_is_configurable():
    config = SessionGeneratorConfig(main_turns=LogNormal(5, 0.0), output_tokens=LogNormal(7, 0.0),
                                    tool_result_tokens=LogNormal(100, 0.0),
                                    middle_turn_input_tokens=LogNormal(20_000, 0.0),
                                    think_time_s=LogNormal(2.0, 0.0), subagent_session_share=0.0)
    (session,) = generate_sessions(1, config)
    # 5 turns, each adding the last output (7) and a tool result (100): growth 0, 107, ..., 428;
    # the middle turn (index 2, growth 214) holds 20,000, so the first holds 19,786.
    assert [t.input_tokens for t in session.turns] == [19_786 + 107 * i for i in range(5)]
    assert [t.output_tokens for t in session.turns] == [7] * 5
    assert [t.think_time_s for t in session.turns] == [0.0, 2.0, 2.0, 2.0, 2.0]
    assert session.subagents == []


def test_context_scale_shrinks_generated_sessions():
    full = generate_sessions(3, SessionGeneratorConfig(seed=5))
    small = generate_sessions(3, SessionGeneratorConfig(seed=5, context_scale=1 / 64))
    assert small[0].block_size == 1
    assert small[0].turns[0].input_tokens == pytest.approx(full[0].turns[0].input_tokens / 64, abs=1)


def test_out_of_range_settings_are_refused():
    with pytest.raises(InvalidRequestError, match="subagent_session_share"):
        SessionGeneratorConfig(subagent_session_share=1.5)
    with pytest.raises(InvalidRequestError, match="median"):
        LogNormal(0, 1.0)
