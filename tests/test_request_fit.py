"""agentjax/request_fit.py: a request the KV pool can never hold is refused with its cause named, and
the output budget it suggests does fit."""
from __future__ import annotations

import pytest

from agentjax.errors import OutOfPagesError
from agentjax.kv.manager import KVCacheManager
from agentjax.request_fit import check_pool_fits, largest_fitting

POOL_PAGES = 20  # of 16 tokens: 320 tokens in all


def pool() -> KVCacheManager:
    return KVCacheManager.full_attention(num_blocks=POOL_PAGES + 1, block_size=16)


def test_a_prompt_longer_than_the_pool_blames_the_prompt():
    with pytest.raises(OutOfPagesError, match="the prompt of 400 tokens needs 26 KV pages but the pool has 20; "
                                              "shorten the prompt") as error:
        check_pool_fits(pool(), prompt_tokens=400, max_tokens=16, max_model_len=8192, chunk_tokens=2048)
    assert error.value.cause == "prompt" and "max_tokens" not in str(error.value)


def test_a_budget_over_the_pool_blames_max_tokens_and_says_what_fits():
    kv = pool()
    with pytest.raises(OutOfPagesError, match="lower max_tokens to at most 120") as error:
        check_pool_fits(kv, prompt_tokens=200, max_tokens=500, max_model_len=8192, chunk_tokens=2048)
    assert error.value.cause == "max_tokens"
    check_pool_fits(kv, prompt_tokens=200, max_tokens=120, max_model_len=8192, chunk_tokens=2048)  # fits
    with pytest.raises(OutOfPagesError):
        check_pool_fits(kv, prompt_tokens=200, max_tokens=121, max_model_len=8192, chunk_tokens=2048)


def test_a_request_that_fits_passes():
    check_pool_fits(pool(), prompt_tokens=100, max_tokens=100, max_model_len=8192, chunk_tokens=2048)


def test_largest_fitting_finds_the_boundary():
    assert largest_fitting(lambda n: n <= 37, 1000) == 37
    assert largest_fitting(lambda n: n <= 1, 2) == 1
