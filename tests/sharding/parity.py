"""Shared by the layout tests: greedy tokens and every position's top-20 raw values of a preset, run
through `LLM` on one device or under a layout, so a test can demand bit-equal results."""
from __future__ import annotations

import functools

import jax
import pytest

# A prompt crossing a 16-token page and a short one; generating crosses the long one's next page.
PROMPTS = ([1, 5, 9, 200, 31, 77, 1000, 4, 8, 15, 16, 23, 42, 108, 4815, 1623, 42, 9, 99, 3, 12],
           [7, 7, 7, 300, 12, 64, 901, 33, 5])
MAX_TOKENS = 6


def need_devices(count: int = 8) -> None:
    if len(jax.devices()) < count:
        pytest.skip(f"needs {count} devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")


@functools.lru_cache(maxsize=None)
def greedy_run(preset: str, numerics: str, page_tokens: int = 16, **layout) -> tuple:
    """`(token ids per prompt, (logprob entries per generated token), (prompt logprob entries))`, the
    entries as tuples of floats: raw logits for generated tokens, raw log probabilities for prompts.
    `page_tokens` is the KV manager's page; with DCP each rank's block is page_tokens / dcp."""
    from agentjax import LLM, SamplingParams

    dcp = layout.get("decode_context_parallel_size", 1)
    llm = LLM(f"preset:{preset}", numerics=numerics, block_size=page_tokens // dcp, num_kv_blocks=64,
              logprobs_mode="raw_logits", **layout)
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=20,
                              prompt_logprobs=20)
    outs = llm.generate([list(p) for p in PROMPTS], sampling)

    def entries(items):
        return tuple(None if e is None else (e.token_id, e.logprob, e.rank, e.top_token_ids, e.top_logprobs)
                     for e in items)

    return (tuple(tuple(o.token_ids) for o in outs), tuple(entries(o.logprobs) for o in outs),
            tuple(entries(o.prompt_logprobs) for o in outs))


def assert_same_run(single: tuple, parallel: tuple, *, exact: bool, tolerance: float = 2e-3) -> None:
    """Tokens equal; the values bit-equal (`exact`) or within `tolerance` (fast numerics)."""
    assert parallel[0] == single[0]
    for want_seq, got_seq in zip(single[1] + single[2], parallel[1] + parallel[2]):
        for want, got in zip(want_seq, got_seq):
            if want is None:
                assert got is None
                continue
            if exact:
                assert got == want
            else:
                assert got[0] == want[0]
                assert abs(got[1] - want[1]) <= tolerance * max(1.0, abs(want[1]))
