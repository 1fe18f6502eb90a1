"""Configs that scripts/fuzz_parity.py found agentjax getting wrong, kept as fixtures and checked against
transformers 5.24.0 without torch.

tests/models/data/fuzz-<family>-<seed> are the fuzzer's own draws (scripts/fuzz_parity_configs.py
FIXTURES; written by scripts/make_model_fixtures.py with its weights and prompt), each with what broke:

- fuzz-deepseek-v4-41: `norm_topk_prob: false`. transformers' DeepSeek-V4 routers renormalise the chosen
  experts' weights whatever the field says; agentjax read it and left them unnormalised (on the first
  config found this way, tokens parted at step 3 and prompt logits were 0.8 apart).
- fuzz-kimi-linear-3: `tie_word_embeddings: true` and `num_shared_experts: 0`. transformers'
  KimiLinearForCausalLM never ties its head (its lm_head.weight is its own tensor); agentjax used the
  embeddings (logits 2-5 apart from the first token). And transformers saves zero-width shared-expert
  tensors, which agentjax's loader refused as unexpected.
- fuzz-minimax-m3-7: YaRN RoPE (factor 4, original context 64), which agentjax's loader refused for
  MiniMax-M3 (the generic RoPE path knew default, linear and llama3 only).
"""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import numpy as np
import pytest

from agentjax import LLM, SamplingParams
from agentjax.kv.cache_layout import page_tokens_multiple, required_page_tokens
from agentjax.models import load_model
from agentjax.ragged_batch import RaggedBatch
from agentjax.runner.step import make_step

from tests.models.fixture_checkpoints import DATA, model as _model, reference as _reference
from tests.step_buckets import STEP_BUCKETS
FIXTURES = ("fuzz-deepseek-v4-41", "fuzz-kimi-linear-3", "fuzz-minimax-m3-7")
MIN_MARGIN = 2e-3
TOLERANCE = 1e-4




def _raw_config(name: str) -> dict:
    return json.loads((DATA / name / "config.json").read_text())


def _page(cfg) -> int:
    return required_page_tokens(cfg) or math.lcm(16, page_tokens_multiple(cfg))


def _teacher_forced(name: str) -> np.ndarray:
    """agentjax's logits over the prompt and transformers' first 23 tokens, one "batch_invariant" prefill."""
    cfg, params, _ = _model(name)
    ref = _reference(name)
    ids = ref["prompt_ids"].tolist() + ref["generated_ids"][:-1].tolist()
    page = _page(cfg)
    step = make_step(cfg, "batch_invariant", all_positions=True)
    kv = cfg.new_kv_pages(2 + len(ids) // page + 1, page)
    logits, _ = step(params, kv, RaggedBatch.from_prompts([ids], page))
    return np.asarray(logits)[: len(ids)]


def test_the_fixtures_carry_the_traits_that_broke():
    dsv4, kimi = _raw_config("fuzz-deepseek-v4-41"), _raw_config("fuzz-kimi-linear-3")
    assert dsv4["norm_topk_prob"] is False and _model("fuzz-deepseek-v4-41")[0].moe.renormalize
    assert kimi["tie_word_embeddings"] is True and kimi["num_shared_experts"] == 0
    cfg, params, _ = _model("fuzz-kimi-linear-3")
    assert not cfg.tie_word_embeddings and not cfg.moe.num_shared_experts and "lm_head" in params
    minimax = _model("fuzz-minimax-m3-7")[0]
    assert minimax.rope_scaling.kind == "yarn" and minimax.rope_scaling.original_max_position_embeddings == 64


@pytest.mark.parametrize("name", FIXTURES)
def test_prompt_and_step_logits_match_transformers(name):
    ref = _reference(name)
    ours = _teacher_forced(name)
    length = len(ref["prompt_ids"])
    assert np.abs(ours[:length] - ref["prompt_logits"]).max() < TOLERANCE
    assert np.abs(ours[length - 1:] - ref["generated_logits"]).max() < TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("name", FIXTURES)
def test_greedy_tokens_equal_transformers_through_llm(name):
    ref = _reference(name)
    comparable = (ref["generated_margins"] >= MIN_MARGIN) & ref["cached_uncached_agree"]
    assert comparable.all()  # the fixtures' prompts leave no near-tie in the 24 steps
    llm = LLM(model=str(DATA / name), num_kv_blocks=64, block_size=_page(_model(name)[0]), numerics="batch_invariant",
              step_buckets=STEP_BUCKETS)  # prompts of 26-46 tokens: one step shape
    out = llm.generate([ref["prompt_ids"].tolist()], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    assert list(out.token_ids) == ref["generated_ids"].tolist()
