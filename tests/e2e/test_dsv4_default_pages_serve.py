"""`agentjax serve --model <HF dir>` with the default settings serves DeepSeek-V4 checkpoints whose heavily
compressed rate is 32 or 128 (tests/models/data/deepseek-v4-rates-*): the official openai client gets a
completion of a token-id prompt and one of a text prompt (the fixtures ship a 512-token byte-level
tokenizer), and a re-sent prompt reads whole entry pages from the cache."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import running_server

DATA = Path(__file__).parents[1] / "models" / "data"
TEXT = "The agent reads the file, runs the tests and fixes what breaks. " * 7  # 322 tokens


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepseek-v4-rates-4-32", "deepseek-v4-rates-4-128"])
def test_serve_loads_the_checkpoint_with_the_default_settings_and_completes(name, tmp_path_factory):
    prompt = [(17 * i) % 500 + 3 for i in range(300)]
    with running_server(tmp_path_factory, "--model", str(DATA / name)) as server:
        client = server.openai().with_options(timeout=900)  # the first request compiles the model's steps
        model = client.models.list().data[0].id
        first = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert first.choices[0].finish_reason == "length" and first.usage.completion_tokens == 4
        again = client.completions.create(model=model, prompt=prompt + [9], max_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert again.usage.prompt_tokens_details.cached_tokens >= 256  # whole 128-token entry pages
        text = client.completions.create(model=model, prompt=TEXT, max_tokens=4, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert text.usage.prompt_tokens >= 300 and text.usage.completion_tokens == 4
        assert isinstance(text.choices[0].text, str) and text.choices[0].text
        resent = client.completions.create(model=model, prompt=TEXT, max_tokens=4, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert resent.usage.prompt_tokens_details.cached_tokens >= 256 and resent.usage.completion_tokens == 4
        server.assert_healthy()
