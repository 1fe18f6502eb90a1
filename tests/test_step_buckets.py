"""agentjax/buckets.py's `StepBuckets` (`EngineConfig.step_buckets`, `--step-buckets`): an engine pads its
steps to its own buckets only, its warm-up builds exactly those shapes, and its tokens are a default
engine's (batch-invariant); bad settings are refused with the setting named."""
from __future__ import annotations

import argparse

import numpy as np
import pytest

from agentjax.buckets import PAGE_BUCKETS, SEQ_BUCKETS, TOKEN_BUCKETS, StepBuckets
from agentjax.config import EngineConfig
from agentjax.errors import InvalidRequestError
from agentjax.sampling_params import SamplingParams

PINNED = {"tokens": [64], "rows": [8], "pages": [32]}


def test_step_buckets_parse_from_a_dict_its_json_or_nothing():
    assert EngineConfig().step_buckets == StepBuckets(TOKEN_BUCKETS, SEQ_BUCKETS, PAGE_BUCKETS)
    pinned = EngineConfig(step_buckets=PINNED).step_buckets
    assert (pinned.tokens, pinned.rows, pinned.pages) == ((64,), (8,), (32,))
    assert EngineConfig(step_buckets='{"tokens": [64, 256]}').step_buckets == StepBuckets(tokens=(64, 256))


@pytest.mark.parametrize("value, message", [
    ({"tokens": [64, 32]}, "'tokens' must be increasing positive integers"),
    ({"rows": []}, "'rows' must be increasing positive integers"),
    ({"pages": [0, 8]}, "'pages' must be increasing positive integers"),
    ({"tokens": [8.5]}, "'tokens' must be increasing positive integers"),
    ({"seqs": [8]}, 'a dict of "tokens", "rows" and "pages"'),
    ("{tokens: 8}", "not valid JSON"),
])
def test_bad_step_buckets_are_refused_with_the_setting_named(value, message):
    with pytest.raises(InvalidRequestError, match=message):
        EngineConfig(step_buckets=value)


def test_the_command_line_flag_gives_the_engine_setting():
    from agentjax.engine_flags import add_engine_flags, engine_args

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = parser.parse_args(["--step-buckets", '{"tokens": [64], "rows": [8]}'])
    assert EngineConfig(**engine_args(args)).step_buckets == StepBuckets(tokens=(64,), rows=(8,))


def _engine(**settings):
    from agentjax.engine import Engine
    from agentjax.models import load_model

    cfg, params, tokenizer = load_model("preset:tiny-dense")
    base = dict(numerics="batch_invariant", num_kv_blocks=96, max_num_batched_tokens=64, max_num_seqs=8,
                max_model_len=256, long_prefill_token_threshold=16)
    return Engine(cfg, params, EngineConfig(**{**base, **settings}), tokenizer)


def _replies(engine) -> dict[str, list[int]]:
    rng = np.random.default_rng(5)
    sampling = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request([int(t) for t in rng.integers(300, 3000, n)], sampling) for n in (9, 40, 75)]
    got = {rid: [] for rid in ids}
    for out in engine.run_until_done():
        got[out.request_id].extend(out.new_token_ids)
    return [got[rid] for rid in ids]


def test_an_engine_pads_every_step_to_its_own_buckets_and_keeps_the_default_engines_tokens():
    from agentjax.runner.warmup import step_shapes

    default, pinned = _engine(), _engine(step_buckets=PINNED)
    assert _replies(pinned) == _replies(default)
    default_tokens = {key[0] for key in default.runner.compiled_shapes}
    assert len(default_tokens) > 1  # chunks of 16 beside decodes: the default engine pads to several buckets
    assert {key[:3] for key in pinned.runner.compiled_shapes} == {(64, 8, (32,))}
    # its warm-up builds the one shape its steps reach (at the longest context: 16 pages, padded to 32)
    assert [(s.tokens, s.rows) for s in step_shapes(pinned, "steps")] == [(64, 8)]
