"""Stop strings found once and incrementally, as a reply is generated.

`StopStringMatcher` is fed the reply's text delta by delta and reports a stop string only when it
ends inside the newest delta; each delta is searched together with just the `longest - 1`
characters before it, so a reply of n characters costs O(n) in all, never a re-decode of the
whole output per token. `reply_hit_stop_string` drives one matcher per engine request from its
token ids. Host only: never imports jax, never cuts text (the server does that, once).
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from checkpoints.tokenizer import IncrementalDetokenizer


@dataclass(frozen=True)
class StopMatch:
    start: int  # index of the stop string's first character in the whole text
    stop: str


def first_stop_ending_after(text: str, boundary: int, stops: Sequence[str]) -> StopMatch | None:
    """The earliest-starting stop string in `text` that ends after index `boundary` (a stop string
    that lies wholly before it was reported when that text arrived)."""
    best: StopMatch | None = None
    for stop in stops:
        if not stop:
            continue
        index = text.find(stop, max(0, boundary - len(stop) + 1))
        if index >= 0 and (best is None or index < best.start):
            best = StopMatch(index, stop)
    return best


class StopStringMatcher:
    """Finds stop strings in text that arrives in pieces, keeping only a short tail."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self.window = max((len(s) for s in self.stops), default=1) - 1
        self.tail = ""  # the last `window` characters seen
        self.tail_start = 0  # index of tail[0] in the whole text

    def push(self, delta: str) -> StopMatch | None:
        """The earliest stop string that ends inside `delta` (positions in the whole text), if any."""
        if not delta or not self.stops:
            return None
        text = self.tail + delta
        match = first_stop_ending_after(text, len(self.tail), self.stops)
        if match is not None:
            match = StopMatch(self.tail_start + match.start, match.stop)
        keep = min(self.window, len(text))
        self.tail_start += len(text) - keep
        self.tail = text[len(text) - keep:] if keep else ""
        return match


class _ReplyWatch:
    """A request's detokenizer and matcher, and how many of its output ids they have read."""

    def __init__(self, tokenizer: Any, stops: Sequence[str]):
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.matcher = StopStringMatcher(stops)
        self.read = 0


_watches: weakref.WeakKeyDictionary[Any, _ReplyWatch] = weakref.WeakKeyDictionary()


def reply_hit_stop_string(request: Any, tokenizer: Any) -> bool:
    """Whether the tokens `request` generated since the last call complete one of its stop strings
    (`request.sampling.stop`). Reads only the new ids; the watch lives as long as the request."""
    watch = _watches.get(request)
    if watch is None:
        watch = _watches[request] = _ReplyWatch(tokenizer, request.sampling.stop)
    new_ids = request.output_token_ids[watch.read:]
    watch.read = len(request.output_token_ids)
    if not new_ids:
        return False
    return watch.matcher.push(watch.detokenizer.add_tokens(new_ids)) is not None
