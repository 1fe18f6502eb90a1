"""Saved recurrent states are bounded (issue 37 acceptance 4): in random multi-turn traffic with shared
prefixes, random chunk sizes and turn ends, a request never holds more state pages than
`max_state_pages` allows, and the states left cached never exceed one per checkpoint interval of the
tokens that ran plus one per turn end and one per branch point."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from agentjax.kv import FullAttentionSpec, KVCacheManager, RecurrentStateSpec
from agentjax.kv.state_saves import max_state_pages

INTERVAL = 8
FULL = FullAttentionSpec(num_kv_heads=1, head_dim=8, dtype_bytes=2)
STATE = RecurrentStateSpec(bytes_per_state=128, checkpoint_interval=INTERVAL)

# 48 pages of 4 tokens shared by both groups: a request of at most this many tokens (38 attention pages)
# leaves room for its state pages, so decoding never runs out of pages (cached pages of other sessions
# are evictable).
MAX_SESSION_TOKENS = 150

turns = st.lists(st.tuples(st.integers(0, 3), st.integers(1, 40), st.integers(1, 6), st.integers(1, 30)),
                 min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(turns)
def test_state_pages_per_request_and_in_the_cache_stay_within_the_policy_bound(plan):
    m = KVCacheManager.from_specs([FULL, STATE], 48, block_size=4, cache_on_allocate=False)
    state_group = m.groups[1]
    histories = {s: [] for s in range(4)}
    allowed_cached = 0
    for turn, (session, new_tokens, outputs, chunk) in enumerate(plan):
        if len(histories[session]) + new_tokens + outputs > MAX_SESSION_TOKENS:
            histories[session] = []  # a new session: this one would outgrow the pool
        prompt = histories[session] + [1000 * session + turn * 50 + i for i in range(new_tokens)]
        req = f"r{turn}"
        if not m.allocate(req, prompt):
            continue
        done = m.num_cached_tokens(req)
        while done < len(prompt):
            end = min(len(prompt), done + chunk)
            if done < m.branch_point(req) < end:  # the scheduler ends a chunk at the branch point
                end = m.branch_point(req)
            m.reserve_state_saves(req, done, end)
            held = sum(1 for page in m.block_ids(req)[1] if page)
            assert held <= max_state_pages(end - done, INTERVAL)
            m.cache_blocks(req, end)
            m.take_pending_copies()
            assert len(m.block_ids(req)[1]) == 1  # between steps: the running page only
            done = end
        reply = [7] * outputs
        for token in reply[:-1]:  # decode: the last sampled token is never fed back
            assert m.append(req, [token])
            done += 1
            m.cache_blocks(req, done)
            m.take_pending_copies()
        allowed_cached += done // INTERVAL + 2  # and one turn end, one branch state
        m.end_turn(req, done)
        m.free(req)
        histories[session] = prompt + reply[:-1]
        assert len(state_group.index) <= allowed_cached
        m.check_invariants()
