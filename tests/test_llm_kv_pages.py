"""`LLM(model=<HF dir>)` with the default settings on DeepSeek-V4 checkpoints whose heavily compressed rate
is 32 or 128 (tests/models/data/deepseek-v4-rates-*, made by scripts/make_model_fixtures.py): the entry
page group takes 32 or 128 tokens per page by itself, the windows keep 16, and the prompt's last logits
and greedy tokens follow transformers' (the fixture's reference)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from agentjax import LLM, SamplingParams

DATA = Path(__file__).parent / "models" / "data"
FIXTURES = {"deepseek-v4-rates-4-32": 32, "deepseek-v4-rates-4-128": 128}
MIN_MARGIN = 2e-3  # transformers' top-1 margin below which a greedy token may flip on rounding


@pytest.mark.slow
@pytest.mark.parametrize("name, rate", FIXTURES.items())
def test_a_deepseek_v4_checkpoint_loads_and_generates_with_the_default_settings(name, rate):
    reference = dict(np.load(DATA / name / "reference.npz"))
    llm = LLM(model=str(DATA / name))  # no block_size: the layout takes pages of whole entries
    layout = llm.engine.kv.layout
    names = layout.group_names()
    pages = {names[g.group]: g.tokens_per_page for g in layout.groups}
    assert layout.mode == "pool" and pages.pop("entries+index_entries") == rate
    assert set(pages.values()) == {16}  # the window rows and the compressors' inputs
    out = llm.generate([reference["prompt_ids"].tolist()],
                       SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    clear = (reference["generated_margins"][:8] >= MIN_MARGIN) & reference["cached_uncached_agree"][:8] \
        & ~reference["cached_indexer_boundary_tie"][:8]
    assert clear[0] and len(out.token_ids) == 8
    first_unclear = int(np.argmin(clear)) if not clear.all() else 8
    np.testing.assert_array_equal(out.token_ids[:first_unclear], reference["generated_ids"][:first_unclear])
