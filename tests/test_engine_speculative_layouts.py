"""Speculative decoding under a parallel layout (8 virtual CPU devices): n-gram drafts are verified by the
laid-out step as by one device's, so greedy tokens under TP2, TP2 x DCP2 and PCP2 x TP2 equal the plain single-device
run's in numerics="batch_invariant" (scripted drafts accepted in full, in part and not at all; real n-gram
drafts), and the combinations that do not run yet (a device drafter under a layout, drafts with data
parallelism) are refused in one line."""
from __future__ import annotations

import pytest

from agentjax.config import EngineConfig
from agentjax.errors import SpeculativeConfigError
from agentjax.spec_decode.setup import plan_speculation
from tests.sharding.parity import need_devices
from tests.test_engine_speculative import NUM_SESSIONS, ScriptedDrafts, _engine, _plain_run, _run_sessions


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2),
                                    dict(tensor_parallel_size=2, decode_context_parallel_size=2),
                                    dict(prefill_context_parallel_size=2, tensor_parallel_size=2)],
                         ids=["tp2", "tp2-dcp2", "pcp2-tp2"])
def test_scripted_drafts_under_a_layout_keep_the_plain_runs_tokens(layout):
    need_devices()
    engine = _engine("tiny-dense", 3, long_prefill_token_threshold=16, **layout)
    assert type(engine.runner).__name__ == "ShardedModelRunner"
    engine.speculator.proposer = ScriptedDrafts("tiny-dense")
    assert _run_sessions(engine, list(range(NUM_SESSIONS))) == _plain_run("tiny-dense")
    stats = engine.stats()["spec_decode"]
    assert stats["accepted_per_position"][2] > 0  # some drafts accepted in full
    assert stats["num_drafts"] < stats["num_accepted_tokens"] < stats["num_draft_tokens"]  # and some rejected
    engine.kv.check_invariants()


@pytest.mark.slow
def test_ngram_drafts_under_tp2_keep_the_plain_runs_tokens():
    need_devices()
    engine = _engine("tiny-dense", 3, long_prefill_token_threshold=16, tensor_parallel_size=2)
    assert _run_sessions(engine, list(range(NUM_SESSIONS))) == _plain_run("tiny-dense")
    assert engine.stats()["spec_decode"]["num_drafts"] > 0


def test_a_device_drafter_under_a_layout_and_drafts_under_dp_are_refused_in_one_line():
    from agentjax.models.presets import PRESETS

    mtp = EngineConfig(tensor_parallel_size=2, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    with pytest.raises(SpeculativeConfigError, match="method 'mtp' runs on one device for now .* runs method 'ngram'"):
        plan_speculation(PRESETS["tiny-minimax-m3"], mtp)
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    for layout in (dict(data_parallel_size=2), dict(num_processes=2, coordinator_address="127.0.0.1:1")):
        with pytest.raises(SpeculativeConfigError, match="does not run with data parallelism or several processes"):
            plan_speculation(PRESETS["tiny-dense"], EngineConfig(speculative_config=ngram, **layout))
