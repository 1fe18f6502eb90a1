"""Subagents, retries and compactions added to a trace stream: where each shares its prefix, seeded."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from agentjax.bench.agentx import AgentxConfig, AgentxRun
from agentjax.bench.generate import LogNormal
from agentjax.bench.trace_augment import TraceAugmentConfig, augment_session, augment_sessions
from agentjax.bench.traces import Session, Turn, prompt_token_ids, scale_session
from agentjax.errors import InvalidRequestError
from tests.bench.recording_client import RecordingClient

BLOCK = 64
HEAD_BLOCKS = 3
SUMMARY = LogNormal(128, 0.0)  # two blocks: these sessions are shorter than the default summary
COMPACT = TraceAugmentConfig(compaction=True, summary_tokens=SUMMARY)


def _session(name: str = "trace_a", turns: int = 12) -> Session:
    """A growing conversation: turn t holds the head (3 blocks) and 4 + 2t more blocks, plus a partial block."""
    made = []
    for t in range(turns):
        ids = np.arange(1, HEAD_BLOCKS + 4 + 2 * t + 1, dtype=np.int64)
        made.append(Turn(t, ids, len(ids) * BLOCK + 10, 50, 1.0 if t else 0.0, float(t)))
    return Session(name, made, BLOCK, f"weka:{name}", head_tokens=HEAD_BLOCKS * BLOCK + 20)


def _shared(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _stream(session: Session) -> list[tuple]:
    rows = [(t.index, t.hash_ids.tolist(), t.input_tokens, t.retries, t.compacted) for t in session.turns]
    for sub in session.subagents:
        rows += [(sub.session_id, sub.fork_turn)] + _stream(sub)
    return rows


def test_subagents_branch_off_the_parents_system_prompt_and_tools():
    session = augment_session(_session(), TraceAugmentConfig(subagent_share=1.0))
    assert len(session.subagents) >= 1
    parent = session.turns
    for sub in session.subagents:
        assert sub.parent_id == "trace_a" and 0 <= sub.fork_turn < len(parent)
        assert len(sub.turns) >= 1
        first = sub.turns[0]
        fork = parent[sub.fork_turn]
        assert _shared(first.hash_ids, fork.hash_ids) == HEAD_BLOCKS  # the head, then its own task
        own_prompt = prompt_token_ids(sub, first, "salt")
        parent_prompt = prompt_token_ids(session, fork, "salt")
        assert _shared(own_prompt, parent_prompt) == HEAD_BLOCKS * BLOCK
        for before, after in zip(sub.turns, sub.turns[1:]):  # a rollout grows on its own context
            assert _shared(after.hash_ids, before.hash_ids) == len(before.hash_ids)
    others = [set(sub.turns[-1].hash_ids[HEAD_BLOCKS:].tolist()) for sub in session.subagents]
    parent_ids = set(parent[-1].hash_ids.tolist())
    for index, ids in enumerate(others):
        assert not ids & parent_ids
        assert all(not ids & other for other in others[index + 1:])


def test_no_subagents_at_share_zero_and_some_at_the_reference_share():
    sessions = [_session(f"trace_{i}") for i in range(200)]
    assert not any(s.subagents for s in augment_sessions(sessions, TraceAugmentConfig(retry_rate=0.5)))
    spawning = sum(1 for s in augment_sessions([_session(f"trace_{i}") for i in range(200)],
                                               TraceAugmentConfig(subagent_share=0.44)) if s.subagents)
    assert 60 <= spawning <= 116  # 88 expected; binomial sd 7


def test_retries_mark_turns_and_the_replay_resends_them_identically():
    session = augment_session(_session(turns=40), TraceAugmentConfig(retry_rate=0.25))
    marked = [t.index for t in session.turns if t.retries]
    assert 3 <= len(marked) <= 20 and all(t.retries in (0, 1) for t in session.turns)
    sent = _replay([session], sessions_per_lane=1, lanes=1)
    start = sent[0][0].turn_index
    assert len(sent) == len(session.turns) - start + sum(1 for t in session.turns[start:] if t.retries)
    retried = 0
    for (previous, _), (request, kind) in zip(sent, sent[1:]):
        if kind == "retry":
            retried += 1
            assert request.prompt == previous.prompt and request.turn_index == previous.turn_index
            assert session.turns[request.turn_index].retries == 1
    assert retried == sum(1 for t in session.turns[start:] if t.retries) > 0


def test_one_compaction_keeps_only_the_head_and_later_turns_grow_on_the_summary():
    original = _session(turns=12)
    before = [t.hash_ids.copy() for t in original.turns]
    session = augment_session(_session(turns=12), COMPACT)
    compacted = [t.index for t in session.turns if t.compacted]
    assert len(compacted) == 1
    c = compacted[0]
    assert 12 // 2 < c <= 11
    first = session.turns[c]
    assert _shared(first.hash_ids, before[c - 1]) == HEAD_BLOCKS  # only the head survives
    assert first.input_tokens < original.turns[c].input_tokens
    summary_blocks = len(first.hash_ids) - HEAD_BLOCKS - (len(before[c]) - len(before[c - 1]))
    assert summary_blocks >= 1
    for t in range(c + 1, 12):  # each later turn extends the compacted context
        assert _shared(session.turns[t].hash_ids, session.turns[t - 1].hash_ids) == len(session.turns[t - 1].hash_ids)
        assert session.turns[t].input_tokens - session.turns[t - 1].input_tokens == \
            original.turns[t].input_tokens - original.turns[t - 1].input_tokens
    for t in range(c):
        assert np.array_equal(session.turns[t].hash_ids, before[t])
    assert not any(t.compacted for t in augment_session(_session(turns=2), COMPACT).turns)
    default_summary = augment_session(_session(turns=12), TraceAugmentConfig(compaction=True))
    assert not any(t.compacted for t in default_summary.turns)  # no context past the head outgrows 2K tokens


def test_augmentation_is_seeded_and_each_feature_draws_on_its_own():
    def stream(**kwargs) -> list:
        return _stream(augment_session(_session(turns=30), TraceAugmentConfig(**kwargs)))

    everything = dict(subagent_share=1.0, retry_rate=0.2, compaction=True, summary_tokens=SUMMARY)
    assert stream(**everything) == stream(**everything)
    assert stream(**everything) != stream(seed=1, **everything)
    with_retries = augment_session(_session(turns=30), TraceAugmentConfig(subagent_share=1.0, retry_rate=0.2))
    without = augment_session(_session(turns=30), TraceAugmentConfig(subagent_share=1.0))
    assert [(s.fork_turn, [t.hash_ids.tolist() for t in s.turns]) for s in with_retries.subagents] == \
        [(s.fork_turn, [t.hash_ids.tolist() for t in s.turns]) for s in without.subagents]


def test_scaling_an_augmented_session_keeps_the_shared_head():
    session = scale_session(augment_session(_session(), TraceAugmentConfig(subagent_share=1.0, compaction=True, summary_tokens=SUMMARY)),
                            BLOCK, 0.25)
    assert session.block_size == 16 and session.head_tokens == HEAD_BLOCKS * 16
    sub = session.subagents[0]
    shared = _shared(prompt_token_ids(sub, sub.turns[0], 1), prompt_token_ids(session, session.turns[sub.fork_turn], 1))
    assert shared == HEAD_BLOCKS * 16


def test_bad_shares_are_refused():
    with pytest.raises(InvalidRequestError):
        TraceAugmentConfig(subagent_share=1.5)
    with pytest.raises(InvalidRequestError):
        TraceAugmentConfig(retry_rate=-0.1)
    with pytest.raises(InvalidRequestError):
        AgentxConfig(sessions_per_lane=0)


def _replay(sessions, **config_args) -> list:
    """(request, its record's kind) for each request an AgentX replay sends, in order."""
    client = RecordingClient()
    config = AgentxConfig(duration_s=3600.0, warmup_requests_per_lane=0, **config_args)
    run = AgentxRun(config, sessions, client)
    asyncio.run(run.run())
    assert len(run.records) == len(client.sent)
    return [(request, record.kind) for request, (record, _) in zip(client.sent, run.records)]


def test_sessions_per_lane_fixes_the_stream_and_labels_each_request():
    sessions = [augment_session(_session(f"trace_{i}", turns=10),
                                TraceAugmentConfig(subagent_share=1.0, retry_rate=0.2, compaction=True, summary_tokens=SUMMARY))
                for i in range(4)]
    first = _replay(sessions, lanes=2, sessions_per_lane=2)
    again = _replay(sessions, lanes=2, sessions_per_lane=2)
    assert sorted((r.session_id, r.turn_index, tuple(r.prompt), kind) for r, kind in first) == \
        sorted((r.session_id, r.turn_index, tuple(r.prompt), kind) for r, kind in again)
    assert {"first", "turn", "branch", "retry"} <= {kind for _, kind in first}
    for request, kind in first:
        if kind == "branch":
            assert request.turn_index == 0 and "parent_session_id" in request.hints
    assert {r.session_id.split(":")[2] for r, _ in first} == {"0", "1"}  # replays 0 and 1 of each lane
