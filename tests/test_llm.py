"""The notebook API on the real embedded model: generate, chat, and bad input."""
from __future__ import annotations

import pytest

from agentjax import SamplingParams
from agentjax.errors import InvalidRequestError, PromptTooLongError


def test_generate_completes_capital_of_france(smollm2_fast):
    out = smollm2_fast.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))[0]
    assert "Paris" in out.text
    assert len(out.token_ids) <= 8 and out.finish_reason in ("stop", "length")


def test_chat_answers_capital_of_france(smollm2_fast):
    out = smollm2_fast.chat(
        [{"role": "user", "content": "What is the capital of France?"}], SamplingParams(max_tokens=16, temperature=0)
    )
    assert "Paris" in out.text


def test_seeded_sampling_is_reproducible_and_seed_dependent(smollm2_fast):
    prompt = ["Write a word:"]
    a = smollm2_fast.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=7))[0].token_ids
    b = smollm2_fast.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=7))[0].token_ids
    c = smollm2_fast.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=8))[0].token_ids
    assert a == b
    assert a != c


def test_stop_string_truncates_text(smollm2_fast):
    out = smollm2_fast.generate(["Count: 1, 2, 3,"], SamplingParams(max_tokens=24, temperature=0, stop=["6"]))[0]
    assert "6" not in out.text and out.finish_reason == "stop"


def test_max_tokens_limits_output_with_ignore_eos(smollm2_fast):
    out = smollm2_fast.generate(["Hi"], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_prompt_longer_than_context_is_rejected_by_name(smollm2_fast):
    too_long = [42] * smollm2_fast.model_config.max_position_embeddings
    with pytest.raises(PromptTooLongError, match="8192"):
        smollm2_fast.generate([too_long], SamplingParams(max_tokens=1))
    # the engine is still usable afterwards
    assert smollm2_fast.generate(["Hi"], SamplingParams(max_tokens=1, temperature=0))[0].token_ids


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-2), "top_k"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, pattern):
    with pytest.raises(InvalidRequestError, match=pattern):
        SamplingParams(**kwargs)


def test_unknown_engine_setting_is_rejected():
    from agentjax import LLM

    with pytest.raises(InvalidRequestError, match="block_sizes"):
        LLM(block_sizes=16)
