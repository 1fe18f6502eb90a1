"""A conversation whose KV pages leave the device between turns, for the offload tests: each turn's
prompt is the history so far plus a new user message; after each turn every cached page that no
request holds is evicted from the device pool, so a later turn's prefix can only come back from an
offload tier (or be recomputed)."""
from __future__ import annotations

from agentjax.config import EngineConfig
from agentjax.engine import Engine
from agentjax.sampling_params import SamplingParams

from tests.step_buckets import REAL_MODEL_BUCKETS, pinned_buckets

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
# Every step of a tiny model one shape (prompts of up to 256 tokens); a real model's engine passes its own.
BASE = dict(numerics="batch_invariant", max_num_batched_tokens=512, num_kv_blocks=96,
            step_buckets=pinned_buckets(256))


def make_engine(model_cfg, params, tokenizer, **settings) -> Engine:
    return Engine(model_cfg, params, EngineConfig(**{**BASE, **settings}), tokenizer)


def make_llm_engine(llm, **settings) -> Engine:
    """An engine on a real model's `LLM` (SmolLM2): small decode steps, one prefill bucket."""
    return make_engine(llm.model_config, llm.params, llm.tokenizer, **{"step_buckets": REAL_MODEL_BUCKETS,
                                                                        **settings})


def evict_device_cache(engine: Engine) -> int:
    pool = engine.kv.pool
    evicted = 0
    for page in range(1, pool.num_pages):
        if pool.ref_counts[page] == 0:
            evicted += pool.evict(page)
    return evicted


def run_conversation(engine: Engine, first_prompt: list[int], follow_ups: list[list[int]], evict: bool = True,
                     between_turns=None) -> tuple[list[list[int]], list[int], list[int]]:
    """(reply tokens per turn, cached prompt tokens per turn, tokens the device had computed at each
    turn's end: prompt plus reply less the last sampled token)."""
    prompt, replies, cached, computed = list(first_prompt), [], [], []
    for turn in range(len(follow_ups) + 1):
        request_id = engine.add_request(prompt, GREEDY, session_id="conversation")
        reply, hit = [], 0
        for out in engine.run_until_done():
            if out.request_id == request_id:
                reply += out.new_token_ids
                hit = out.num_cached_tokens
        replies.append(reply)
        cached.append(hit)
        computed.append(len(prompt) + len(reply) - 1)
        if turn < len(follow_ups):
            prompt = prompt + reply + follow_ups[turn]
        if engine.offload_worker is not None:
            engine.offload_worker.flush(engine.runner)  # the tool call's pause: the turn's stores land
        if evict:
            evict_device_cache(engine)
        if between_turns is not None:
            between_turns(turn)
    return replies, cached, computed


def expected_hits(computed: list[int], page: int = 16, checkpoint: int | None = None) -> list[int]:
    """What each turn's prefix hit is when every page of the turns before it is served: the previous
    turn's computed tokens in whole pages (in whole checkpoint intervals for a recurrent state)."""
    unit = checkpoint or page
    return [0] + [tokens // unit * unit for tokens in computed[:-1]]
