"""Constrained decoding on the real model: outputs match their schema or regex, unconstrained rows in
the same batch are untouched, constraining compiles nothing new, and bad constraints fail cleanly."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from agentjax import SamplingParams
from agentjax.errors import InvalidRequestError
from agentjax.structured import StructuredOutput

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"], "additionalProperties": False}
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"


def chat_prompt(llm, text: str) -> list[int]:
    return llm.tokenizer.encode_chat([{"role": "user", "content": text}])


@pytest.mark.slow
def test_constrained_rows_match_and_free_rows_are_untouched(smollm2_invariant):
    llm = smollm2_invariant
    prompts = [chat_prompt(llm, "Describe a person as JSON."), chat_prompt(llm, "Name three colours."),
               chat_prompt(llm, "When did the moon landing happen?")]
    free = SamplingParams(max_tokens=16, temperature=0.0)
    plan = [SamplingParams(max_tokens=32, temperature=0.0, structured=StructuredOutput.json_schema(PERSON)),
            free,
            SamplingParams(max_tokens=16, temperature=0.0, structured=StructuredOutput.regex(DATE))]
    alone = llm.generate([prompts[1]], free)[0]
    # The same batch unconstrained, each row running its full budget, twice: the second run finds the
    # prompts cached as the constrained run will, so its steps have every shape the constrained run can.
    unconstrained = [SamplingParams(max_tokens=p.max_tokens, temperature=0.0, ignore_eos=True) for p in plan]
    for _ in range(2):
        llm.generate(prompts, unconstrained)
    shapes_unconstrained = set(llm.engine.runner.compiled_shapes)
    batched = llm.generate(prompts, plan)

    person, colours, date = batched
    assert person.finish_reason == "stop"
    jsonschema.validate(json.loads(person.text), PERSON)
    assert date.finish_reason == "stop" and re.fullmatch(DATE, date.text), date.text
    # The mask is an input array: a free row's tokens are those of a run without constrained neighbours.
    assert colours.token_ids == alone.token_ids
    # Constraining compiles nothing: the same batch shapes as the unconstrained run.
    assert set(llm.engine.runner.compiled_shapes) == shapes_unconstrained


@pytest.mark.parametrize("constraint", [
    StructuredOutput.json_schema({"type": "nonsense"}),
    StructuredOutput.lark("start: ???"),
    StructuredOutput.regex("(unclosed"),
])
def test_a_bad_constraint_is_an_invalid_request_and_leaves_nothing_behind(smollm2_invariant, constraint):
    engine = smollm2_invariant.engine
    with pytest.raises(InvalidRequestError, match="constraint is not usable"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, structured=constraint))
    assert not engine.has_unfinished() and not engine.requests


def test_structured_output_kinds_are_validated():
    with pytest.raises(InvalidRequestError):
        StructuredOutput("yaml", "x")
    with pytest.raises(InvalidRequestError):
        StructuredOutput.json_schema("[1, 2")
    with pytest.raises(InvalidRequestError):
        SamplingParams(structured={"type": "json_object"})
