"""Client-marked prefixes (Anthropic `cache_control`): the engine pins exactly their whole pages when
the turn ends, for the TTL given, and rejects marks outside the prompt."""
from __future__ import annotations

import pytest

from agentjax.config import EngineConfig
from agentjax.engine import Engine
from agentjax.errors import InvalidRequestError
from agentjax.models import load_model
from agentjax.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine():
    cfg, params, tokenizer = load_model("preset:tiny-dense")
    return Engine(cfg, params, EngineConfig(block_size=16, num_kv_blocks=64), tokenizer)


def run(engine: Engine, prompt: list[int], **kwargs) -> None:
    engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), **kwargs)
    list(engine.run_until_done())


def test_a_marked_prefix_keeps_its_whole_pages_pinned_after_the_turn(engine):
    prompt = list(range(10, 90))  # 80 tokens: 5 whole pages
    assert engine.kv.stats()["pinned_blocks"] == 0
    run(engine, prompt, pin_prefixes=[(40, 300.0)])
    assert engine.kv.stats()["pinned_blocks"] == 2  # 40 tokens = 2 whole pages of 16; the part page is not cached
    run(engine, prompt + [5, 6], pin_prefixes=[(64, 300.0)])
    assert engine.kv.stats()["pinned_blocks"] == 4  # the 64-token mark covers the 40-token mark's pages
    engine.kv.unpin(("prefix", None, 40, hash(tuple(prompt[:40]))))
    engine.kv.unpin(("prefix", None, 64, hash(tuple(prompt[:64]))))
    assert engine.kv.stats()["pinned_blocks"] == 0


@pytest.mark.parametrize("mark", [(0, 300.0), (81, 300.0), (10, 0.0)])
def test_a_mark_outside_the_prompt_or_without_ttl_is_rejected(engine, mark):
    with pytest.raises(InvalidRequestError, match="pinned prefix"):
        engine.add_request(list(range(10, 90)), SamplingParams(max_tokens=2), pin_prefixes=[mark])
    assert not engine.requests
