"""Speculative decoding through the engine on the tiny presets: greedy tokens with drafts equal the plain
run's in `numerics="batch_invariant"` (n-gram drafts with k = 1, 3 and 5, and scripted drafts that are
accepted in full, in part and not at all), alone and among 8 interleaved sessions, with prefix caching
and prefill chunks of 16; seeded sampling, log probabilities, grammars, stop strings, penalties and
preemption with drafts on; a model with a recurrent state (KDA) keeps one state per draft position.
"""
from __future__ import annotations

import functools
import re

import numpy as np
import pytest

from agentjax.config import EngineConfig
from agentjax.engine import Engine
from agentjax.sampling_params import SamplingParams

TURN = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
NUM_SESSIONS = 8
# One token bucket and one page-table width for every engine here (`EngineConfig.step_buckets`): a tiny
# preset's step shape costs seconds to compile (tiny-dsv4: 14-35 s) and milliseconds to run, so 8
# chunks of 16 tokens, a lone prompt and a decode of 8 rows with drafts all run as one 128-token shape
# (rows: 8; sampled positions: 8, or 64 with drafts). Shape changes are the batch-invariance tests' job.
STEP_BUCKETS = {"tokens": [128], "rows": [8, 64], "pages": [32]}
PRESETS = ["tiny-dense", "tiny-sliding", "tiny-minimax-m3", "tiny-dsv4"]


@functools.lru_cache(maxsize=None)
def _model(name: str):
    from agentjax.models import load_model

    return load_model(f"preset:{name}")


def _engine(name: str, k: int | None = None, method: str = "ngram", draft_model=None, **settings) -> Engine:
    cfg, params, tokenizer = _model(name)
    base = dict(numerics="batch_invariant", num_kv_blocks=384, max_num_batched_tokens=256, max_num_seqs=8,
                step_buckets=STEP_BUCKETS)
    if k is not None:
        base["speculative_config"] = {"method": method, "num_speculative_tokens": k}
        if method == "ngram":
            base["speculative_config"].update(prompt_lookup_min=1, prompt_lookup_max=3)
        if method == "draft_model":
            base["speculative_config"]["model"] = "preset:tiny-dense"
    return Engine(cfg, params, EngineConfig(**{**base, **settings}), tokenizer, draft_model=draft_model)


def _first_prompt(session: int) -> list[int]:
    """A motif said three times, then a tail: n-gram lookups find it, a random model may or may not follow."""
    rng = np.random.default_rng(100 + session)
    motif = [int(t) for t in rng.integers(300, 3000, 6 + session)]
    return motif * 3 + [int(t) for t in rng.integers(300, 3000, 5 + 2 * session)]


def _run_sessions(engine: Engine, sessions: list[int], sampling: SamplingParams = TURN) -> dict[int, list[list[int]]]:
    """Two turns per session, every session's turn submitted together; the second turn's prompt is the
    first prompt, its reply and the first prompt's motif again. Returns each session's replies."""
    prompts = {s: _first_prompt(s) for s in sessions}
    replies = {s: [] for s in sessions}
    for _ in range(2):
        ids = {engine.add_request(prompts[s], sampling, session_id=f"s{s}"): s for s in sessions}
        got = {rid: [] for rid in ids}
        for out in engine.run_until_done():
            got[out.request_id].extend(out.new_token_ids)
        for rid, s in ids.items():
            replies[s].append(got[rid])
            prompts[s] = prompts[s] + got[rid] + _first_prompt(s)[: 6 + s]
    return replies


_PLAIN: dict[str, dict[int, list[list[int]]]] = {}


def _plain_run(name: str) -> dict[int, list[list[int]]]:
    """Every session alone, no drafts, no prefix caching, no chunks: the reference tokens."""
    if name not in _PLAIN:
        reference = {}
        for s in range(NUM_SESSIONS):
            reference.update(_run_sessions(_engine(name, enable_prefix_caching=False), [s]))
        _PLAIN[name] = reference
    return _PLAIN[name]


class ScriptedDrafts:
    """Proposes the plain run's own continuation with one wrong token at a rotating position (or none), so
    drafts are accepted in full, in part and not at all."""

    def __init__(self, name: str):
        self.continuation: dict[tuple, list[int]] = {}
        plain = _plain_run(name)
        for s, replies in plain.items():
            prompt = _first_prompt(s)
            for reply in replies:
                for j in range(len(reply)):
                    self.continuation[tuple(prompt + reply[: j + 1])] = reply[j + 1:]
                prompt = prompt + reply + _first_prompt(s)[: 6 + s]
        self.calls = 0

    def propose(self, tokens: np.ndarray, k: int) -> list[int]:
        drafts = list(self.continuation.get(tuple(tokens.tolist()), ())[:k])
        self.calls += 1
        wrong = self.calls % (k + 2)
        if wrong < len(drafts):
            drafts[wrong] = (drafts[wrong] + 1) % 49152
        return drafts


def _case_marks(name: str, k: int):
    return () if (name, k) == ("tiny-dense", 3) else (pytest.mark.slow,)


@pytest.mark.parametrize("name, k", [pytest.param(n, k, marks=_case_marks(n, k)) for n in PRESETS for k in (1, 3, 5)])
def test_ngram_drafts_give_the_plain_runs_tokens_among_eight_sessions(name, k):
    engine = _engine(name, k, long_prefill_token_threshold=16)
    assert _run_sessions(engine, list(range(NUM_SESSIONS))) == _plain_run(name)
    stats = engine.stats()["spec_decode"]
    assert stats["num_drafts"] > 0 and stats["num_draft_tokens"] >= stats["num_drafts"]
    assert engine.scheduler.step_index > 0 and engine.kv.stats()["running_requests"] == 0


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "tiny-dense" else (pytest.mark.slow,))
                                  for n in PRESETS])
@pytest.mark.slow
def test_drafts_accepted_in_full_in_part_and_not_at_all_keep_tokens_exact(name):
    engine = _engine(name, 5, long_prefill_token_threshold=16)
    engine.speculator.proposer = ScriptedDrafts(name)
    assert _run_sessions(engine, list(range(NUM_SESSIONS))) == _plain_run(name)
    stats = engine.stats()["spec_decode"]
    per_position = stats["accepted_per_position"]
    assert per_position[4] > 0  # some drafts accepted in full
    assert stats["num_accepted_tokens"] < stats["num_draft_tokens"]  # and some rejected
    assert stats["num_accepted_tokens"] > stats["num_drafts"]  # several tokens per step on average
    engine.kv.check_invariants()


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3, 5])
def test_one_session_alone_with_drafts_gives_the_plain_runs_tokens(k):
    engine = _engine("tiny-dense", k)
    engine.speculator.proposer = ScriptedDrafts("tiny-dense")
    assert _run_sessions(engine, [3]) == {3: _plain_run("tiny-dense")[3]}


@pytest.mark.slow
def test_preemption_with_drafts_keeps_tokens_exact():
    engine = _engine("tiny-dense", 5, num_kv_blocks=20, max_num_batched_tokens=64, long_prefill_token_threshold=16)
    engine.speculator.proposer = ScriptedDrafts("tiny-dense")
    assert _run_sessions(engine, list(range(NUM_SESSIONS))) == _plain_run("tiny-dense")
    assert engine.scheduler.num_preemptions > 0
    engine.kv.check_invariants()


@pytest.mark.slow
def test_seeded_sampling_draws_the_same_tokens_with_drafts_on_and_off():
    sampling = SamplingParams(max_tokens=16, temperature=1.0, top_k=5, seed=7, ignore_eos=True)
    plain = _run_sessions(_engine("tiny-dense"), [0, 1, 2], sampling)
    engine = _engine("tiny-dense", 4)
    engine.speculator.proposer = _GreedyScript(plain)
    assert _run_sessions(engine, [0, 1, 2], sampling) == plain
    stats = engine.stats()["spec_decode"]
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]


class _GreedyScript(ScriptedDrafts):
    def __init__(self, runs: dict[int, list[list[int]]]):
        self.continuation, self.calls = {}, 0
        for s, replies in runs.items():
            prompt = _first_prompt(s)
            for reply in replies:
                for j in range(len(reply)):
                    self.continuation[tuple(prompt + reply[: j + 1])] = reply[j + 1:]
                prompt = prompt + reply + _first_prompt(s)[: 6 + s]


def test_log_probabilities_of_accepted_tokens_equal_the_plain_runs():
    prompt = _first_prompt(2)
    sampling = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)

    def run(engine):
        request_id = engine.add_request(prompt, sampling)
        tokens, logprobs = [], []
        for out in engine.run_until_done():
            assert out.request_id == request_id
            tokens += out.new_token_ids
            logprobs += out.logprobs
        return tokens, logprobs

    plain_tokens, plain_logprobs = run(_engine("tiny-dense"))
    engine = _engine("tiny-dense", 4)
    engine.speculator.proposer = _GreedyScript({2: [plain_tokens]})
    tokens, logprobs = run(engine)
    assert tokens == plain_tokens and logprobs == plain_logprobs
    assert engine.stats()["spec_decode"]["num_accepted_tokens"] > 0


def test_a_stop_string_inside_a_steps_accepted_tokens_ends_the_reply_there():
    cfg, params, tokenizer = _model("tiny-dense")
    prompt = _first_prompt(4)
    plain_engine = _engine("tiny-dense")
    plain = _run_sessions(plain_engine, [4])[4][0]
    text = tokenizer.decode(plain)
    stop = text[len(text) // 2: len(text) // 2 + 3]
    sampling = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=(stop,))

    def run(engine):
        request_id = engine.add_request(prompt, sampling)
        return [t for out in engine.run_until_done() for t in out.new_token_ids if out.request_id == request_id]

    expected = run(_engine("tiny-dense"))
    engine = _engine("tiny-dense", 5)
    engine.speculator.proposer = _GreedyScript({4: [plain]})
    assert run(engine) == expected and len(expected) < len(plain)


def test_grammar_masks_apply_at_draft_positions():
    from agentjax.structured import StructuredOutput

    pattern = "(ab|cd)(,(ab|cd)){9}"
    sampling = SamplingParams(max_tokens=48, temperature=0.0, structured=StructuredOutput.regex(pattern))
    prompt = _first_prompt(1)

    def run(engine):
        request_id = engine.add_request(prompt, sampling)
        return [t for out in engine.run_until_done() for t in out.new_token_ids if out.request_id == request_id]

    expected = run(_engine("tiny-dense"))
    engine = _engine("tiny-dense", 4)
    assert run(engine) == expected
    assert engine.stats()["spec_decode"]["num_accepted_tokens"] > 0  # the grammar's repeats are drafted
    assert re.fullmatch(pattern, _model("tiny-dense")[2].decode(expected))


def test_penalised_requests_decode_without_drafts_and_keep_their_tokens():
    sampling = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)
    prompt = _first_prompt(5)

    def run(engine):
        engine.add_request(prompt, sampling)
        return [t for out in engine.run_until_done() for t in out.new_token_ids]

    expected = run(_engine("tiny-dense"))
    engine = _engine("tiny-dense", 3)
    assert run(engine) == expected
    assert engine.stats()["spec_decode"]["num_drafts"] == 0


@pytest.mark.slow
def test_a_recurrent_state_model_keeps_the_plain_runs_tokens_with_drafts():
    """tiny-kimi-k3 (KDA): a drafting row saves the state after each of its tokens in its own page and
    rollback keeps the one after the last accepted draft; drafts accepted in full, in part and not at all,
    8 sessions, prefix caching (state checkpoints) and prefill chunks of 16."""
    engine = _engine("tiny-kimi-k3", 5, long_prefill_token_threshold=16)
    engine.speculator.proposer = ScriptedDrafts("tiny-kimi-k3")
    assert _run_sessions(engine, list(range(NUM_SESSIONS))) == _plain_run("tiny-kimi-k3")
    stats = engine.stats()["spec_decode"]
    assert stats["accepted_per_position"][4] > 0 and stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    assert engine.kv.stats()["hits"] > 0
    engine.kv.check_invariants()
