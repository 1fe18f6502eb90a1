"""Session turn ends reach the engine's KV policy (agentjax/scheduler/sessions.py): `kv_policy` picks it,
the agent hints (`expected_next_turn_s`, `pin`, `branch_point`, `session_end`) set its session pins
and expectations, and the HTTP server's `agent_hints` get there too."""
from __future__ import annotations

import math

import pytest
from starlette.testclient import TestClient

from agentjax.config import EngineConfig
from agentjax.engine import Engine
from agentjax.errors import InvalidRequestError
from agentjax.kv.policies import HintAwarePolicy, LRUPolicy, MarconiPolicy
from agentjax.models import load_model
from agentjax.sampling_params import SamplingParams
from agentjax.scheduler.request import AgentHints
from agentjax.server.app import create_app

PROMPT = list(range(10, 90))  # 80 tokens: 5 whole pages of 16
GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return load_model("preset:tiny-dense")


def engine_with(model, **settings) -> Engine:
    cfg, params, tokenizer = model
    return Engine(cfg, params, EngineConfig(block_size=16, num_kv_blocks=64, **settings), tokenizer)


@pytest.fixture(scope="module")
def engine(model):
    return engine_with(model)


def run(engine: Engine, prompt: list[int], **kwargs) -> None:
    engine.add_request(prompt, GREEDY, **kwargs)
    list(engine.run_until_done())


def session_state(policy, session_id: str) -> tuple[float, bool]:
    index = policy._session_index[session_id]
    return float(policy.session_next_turn_at[index]), bool(policy.session_ended[index])


def test_the_default_policy_is_hints_and_the_setting_picks_the_others(model, engine):
    assert isinstance(engine.kv.pool.eviction_order.policy, HintAwarePolicy)
    assert isinstance(engine_with(model, kv_policy="lru").kv.pool.eviction_order.policy, LRUPolicy)
    assert isinstance(engine_with(model, kv_policy="marconi").kv.pool.eviction_order.policy, MarconiPolicy)
    with pytest.raises(InvalidRequestError, match="kv_policy"):
        EngineConfig(kv_policy="belady")  # offline: it needs the future


def test_a_turn_end_pins_its_pages_for_a_margin_over_the_expected_gap_and_session_end_releases_them(engine):
    policy = engine.kv.pool.eviction_order.policy
    clock = engine.kv.clock
    before = clock()
    run(engine, PROMPT, hints=AgentHints(session_id="s1", expected_next_turn_s=12.0, branch_point=True))
    expected_at, ended = session_state(policy, "s1")
    assert before + 12.0 <= expected_at <= clock() + 12.0 and not ended
    # 80 prompt tokens + 1 computed reply token: 5 whole pages, pinned for the session and as a fork point
    assert engine.kv.stats()["pinned_blocks"] == 5
    session_pin, branch_pin = policy.pins.get(("session", "s1")), policy.pins.get(("branch", "s1"))
    assert len(session_pin.pages) == len(branch_pin.pages) == 5
    assert before + 1.5 * 12.0 + 1.0 <= session_pin.expires_at <= clock() + 1.5 * 12.0 + 1.0
    assert branch_pin.expires_at == math.inf  # until the session ends
    assert policy.position[session_pin.pages].tolist() == [0, 1, 2, 3, 4]
    run(engine, PROMPT + [5, 6], hints=AgentHints(session_id="s1", session_end=True))
    assert session_state(policy, "s1")[1] and engine.kv.stats()["pinned_blocks"] == 0


def test_pin_none_pins_nothing_and_expects_no_next_turn_and_end_session_releases_a_pin(engine):
    policy = engine.kv.pool.eviction_order.policy
    run(engine, PROMPT, hints=AgentHints(session_id="quiet", pin="none"))
    assert session_state(policy, "quiet")[0] == math.inf and ("session", "quiet") not in policy.pins
    run(engine, PROMPT, session_id="plain")  # no hints: a soft pin for the default gap
    assert ("session", "plain") in policy.pins
    engine.end_session("plain")
    assert ("session", "plain") not in policy.pins and session_state(policy, "plain")[1]


def test_lru_takes_no_session_pins(model):
    engine = engine_with(model, kv_policy="lru")
    run(engine, PROMPT, hints=AgentHints(session_id="s", expected_next_turn_s=60.0))
    assert engine.kv.stats()["pinned_blocks"] == 0


def test_the_servers_agent_hints_reach_the_policy(model):
    engine = engine_with(model)
    policy = engine.kv.pool.eviction_order.policy
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Plan the refactor. " * 8}], "max_tokens": 2,
            "temperature": 0}
    with TestClient(create_app(engine, model[2], model_name="tiny")) as client:
        hints = {"session_id": "agent-7", "expected_next_turn_s": 40.0, "pin": "soft"}
        reply = client.post("/v1/chat/completions", json={**body, "agent_hints": hints})
        assert reply.status_code == 200
        expected_at, _ = session_state(policy, "agent-7")
        assert expected_at == pytest.approx(policy.session_last_turn_end[policy._session_index["agent-7"]] + 40.0)
        assert ("session", "agent-7") in policy.pins
        reply = client.post("/v1/chat/completions",
                            json={**body, "agent_hints": {"session_id": "agent-7", "session_end": True}})
        assert reply.status_code == 200
    assert session_state(policy, "agent-7")[1] and ("session", "agent-7") not in policy.pins
