"""`speculative_config` is checked when the engine settings are built: vLLM's keys and defaults, and a
specific error naming the bad value for anything else."""
from __future__ import annotations

import pytest

from agentjax.config import EngineConfig
from agentjax.errors import SpeculativeConfigError
from agentjax.spec_decode import SpeculativeConfig


def test_ngram_lookup_bounds_default_as_in_vllm():
    both = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3})
    assert (both.prompt_lookup_min, both.prompt_lookup_max) == (5, 5)
    only_max = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    only_min = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2})
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (2, 2)


def test_engine_config_takes_a_dict_or_json_text_and_stores_it_parsed():
    from_text = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 4}')
    from_dict = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert from_text.speculative_config == from_dict.speculative_config
    assert from_dict.speculative_config.num_speculative_tokens == 4
    assert EngineConfig().speculative_config is None


@pytest.mark.parametrize("value, message", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer in [1, 16]"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "got 2.5"),
    ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min=4 is larger than prompt_lookup_max=2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown keys ['lookahead']"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"method": "mtp", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "belong to method 'ngram'"),
    ("{not json", "not valid JSON"),
    ([1, 2], "must be a JSON object"),
])
def test_a_bad_config_is_a_specific_error_at_start_up(value, message):
    with pytest.raises(SpeculativeConfigError) as error:
        EngineConfig(speculative_config=value)
    assert message in str(error.value)
