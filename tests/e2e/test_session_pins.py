"""`expected_next_turn_s` pins a session's pages across a tool-call pause: under a competing load that
evicts every unpinned page of a small KV pool, the pinned session's second turn still hits."""
from __future__ import annotations

import pytest

from tests.e2e.conftest import running_server

MODEL = "smollm2-135m-instruct"
NUM_KV_BLOCKS = 16  # 15 usable pages of 16 tokens


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory, "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-tokens-limit", "16") as proc:
        yield proc


def turn(client, messages, salt: str, hints: dict):
    # Each party gets its own cache salt, so the only pages it can hit are its own.
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                           extra_body={"cache_salt": salt, "agent_hints": hints})
    return reply, reply.usage.prompt_tokens_details.cached_tokens


@pytest.mark.slow
def test_expected_next_turn_s_keeps_a_sessions_pages_cached_across_a_competing_load(server):
    client = server.openai()
    task = "Refactor the parser module. " * 4  # with the template, 58 tokens: 3 whole pages
    pinned = [{"role": "user", "content": "pinned: " + task}]
    unpinned = [{"role": "user", "content": "unpinned: " + task}]
    pinned_hints = {"session_id": "pinned", "turn": 0, "expected_next_turn_s": 120.0, "pin": "soft"}
    unpinned_hints = {"session_id": "unpinned", "turn": 0, "pin": "none"}
    first_pinned, _ = turn(client, pinned, "pinned", pinned_hints)
    first_unpinned, _ = turn(client, unpinned, "unpinned", unpinned_hints)

    # The pause: other tenants' long prompts churn through far more pages than the pool holds.
    for index in range(4):  # 107 tokens each: 7 pages, 28 in all, against 11 unpinned pages
        filler = [{"role": "user", "content": f"tenant {index}: " + "Summarise the build logs. " * 12}]
        turn(client, filler, f"tenant-{index}", {"pin": "none"})

    pinned += [{"role": "assistant", "content": first_pinned.choices[0].message.content},
               {"role": "user", "content": "Now add tests."}]
    unpinned += [{"role": "assistant", "content": first_unpinned.choices[0].message.content},
                 {"role": "user", "content": "Now add tests."}]
    _, pinned_hit = turn(client, pinned, "pinned", {**pinned_hints, "turn": 1, "session_end": True})
    _, unpinned_hit = turn(client, unpinned, "unpinned", {**unpinned_hints, "turn": 1})
    assert unpinned_hit == 0, "the competing load should have evicted the unpinned session's pages"
    assert pinned_hit >= 48, f"the pinned session's turn 2 should hit its turn-1 pages, got {pinned_hit} tokens"
    server.assert_healthy()
