"""agentjax/json_setting.py: a setting given as a dict or its JSON text comes back as the dict; anything
else raises the caller's error class with the setting's name."""
from __future__ import annotations

import pytest

from agentjax.errors import InvalidRequestError, SpeculativeConfigError
from agentjax.json_setting import json_setting


def test_a_dict_or_its_json_text_gives_the_dict():
    assert json_setting({"tokens": [8]}, "step_buckets") == {"tokens": [8]}
    assert json_setting('{"tokens": [8]}', "step_buckets") == {"tokens": [8]}


def test_bad_text_and_other_types_raise_the_callers_error_naming_the_setting():
    with pytest.raises(InvalidRequestError, match="step_buckets is not valid JSON"):
        json_setting("{tokens: 8}", "step_buckets")
    with pytest.raises(SpeculativeConfigError, match=r'speculative_config must be a JSON object like \{"method"'):
        json_setting([1, 2], "speculative_config", SpeculativeConfigError, example='{"method": "ngram"}')
    with pytest.raises(InvalidRequestError, match="the JSON schema must be a JSON object; got int"):
        json_setting(3, "the JSON schema")
