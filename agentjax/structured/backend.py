"""`GrammarBackend`: llguidance matchers and token bitmasks for constrained requests.

One backend per tokenizer. It compiles a `StructuredOutput` into a grammar once (cached), gives
each request its own matcher, and fills the per-row bitmask the sampler applies: one bit per
vocabulary entry, packed 32 to an int32, all ones for unconstrained rows.
"""
from __future__ import annotations

import functools
import json
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from agentjax.errors import InvalidRequestError
from agentjax.structured.spec import COMPACT_JSON, StructuredOutput, compact_schema

GRAMMAR_CACHE_SIZE = 256
MAX_ERROR_CHARS = 300


def first_line(message: str, limit: int = MAX_ERROR_CHARS) -> str:
    """The error itself from llguidance's message, without the grammar lines it quotes after it (a
    tool grammar's line holds every tool's whole schema)."""
    line = message.strip().splitlines()[0] if message.strip() else "unknown error"
    return line if len(line) <= limit else line[:limit] + "..."


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def all_allowed(num_rows: int, vocab_size: int) -> np.ndarray:
    """The bitmask of rows that sample freely."""
    return np.full((num_rows, bitmask_words(vocab_size)), -1, dtype=np.int32)


class GrammarBackend:
    """Compiles constraints for one tokenizer and computes token masks (thread-safe to build)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer = None
        self._executor = None
        self._lock = threading.Lock()
        self._grammar = functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)(self._compile)

    def _llguidance(self):
        import llguidance

        with self._lock:
            if self._ll_tokenizer is None:
                # The tokenizer's own JSON: llguidance tokenizes exactly as the model does.
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self.tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
                self._executor = llguidance.LLExecutor()
        return llguidance

    def _compile(self, spec: StructuredOutput) -> str:
        llguidance = self._llguidance()
        if spec.kind == "json_schema":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(compact_schema(json.loads(spec.value)))
        elif spec.kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object", "x-guidance": COMPACT_JSON})
        elif spec.kind == "lark":
            grammar = llguidance.LLMatcher.grammar_from_lark(spec.value)
        else:
            grammar = llguidance.LLMatcher.grammar_from_regex(spec.value)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._ll_tokenizer)
        if is_error:
            raise InvalidRequestError(f"the {spec.kind.replace('_', ' ')} constraint is not usable: "
                                      f"{first_line(messages[0])}")
        return grammar

    def check(self, spec: StructuredOutput) -> None:
        """Raises `InvalidRequestError` for a schema or grammar that cannot be used (compiled once, cached)."""
        self._grammar(spec)

    def new_matcher(self, spec: StructuredOutput):
        """A fresh matcher for one request; a bad schema or grammar is an `InvalidRequestError`."""
        grammar = self._grammar(spec)
        llguidance = self._llguidance()
        matcher = llguidance.LLMatcher(self._ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"the {spec.kind.replace('_', ' ')} constraint is not usable: "
                                      f"{first_line(matcher.get_error())}")
        return matcher

    def fill_bitmask(self, bitmask: np.ndarray, rows: Sequence[tuple[Any, int]]) -> None:
        """Writes the next-token mask of each `(matcher, row)` into `bitmask[row]`."""
        if not rows:
            return
        from llguidance.numpy import fill_next_token_bitmask_par

        self._llguidance()
        fill_next_token_bitmask_par(self._executor, list(rows), bitmask)

    def fill_bitmask_with_drafts(self, bitmask: np.ndarray, rows: Sequence[tuple[Any, int, Sequence[int]]]) -> None:
        """For each `(matcher, first_row, draft_tokens)`: the next-token mask into `bitmask[first_row]`, and
        into `bitmask[first_row + i]` the mask after the first `i` drafts (speculative decoding: each draft
        position is constrained as if the drafts before it were taken). The matchers end where they began.
        A draft the grammar refuses leaves the rows after it all ones (nothing sampled there is kept)."""
        plain = [(matcher, row) for matcher, row, drafts in rows if not drafts]
        if plain:
            self.fill_bitmask(bitmask, plain)
        drafted = [entry for entry in rows if entry[2]]
        if not drafted:
            return
        from llguidance.numpy import fill_next_token_bitmask

        self._llguidance()
        for matcher, row, drafts in drafted:
            consumed = 0
            fill_next_token_bitmask(matcher, bitmask, row)
            valid = matcher.validate_tokens([int(t) for t in drafts])  # consuming a refused token is an error
            for token in drafts[:valid]:
                if not matcher.consume_token(int(token)):
                    break
                consumed += 1
                fill_next_token_bitmask(matcher, bitmask, row + consumed)
            if consumed:
                matcher.rollback(consumed)
