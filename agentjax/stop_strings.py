"""Stop strings found once and incrementally, as a reply is generated.

`StopStringMatcher` is fed the reply's text delta by delta and reports a stop string only when it
ends inside the newest delta; each delta is searched together with just the `longest - 1`
characters before it, so a reply of n characters costs O(n) in all, never a re-decode of the
whole output per token. `reply_hit_stop_string` drives one matcher per engine request from its
token ids. `ReplyText` turns the ids the engine sends into the reply's text, cut once where the
stop string that ended it begins (the server streams it; `LLM.generate` joins it). Host only:
never imports jax.
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


class StopTextBuffer:
    """Streams text deltas, never emitting what a stop string would later cut off.

    The engine ends a reply at the token that completes a stop string, so the text is searched
    once, when the reply finishes, and only for a stop string that ends in its last delta; until
    then the last `longest stop - 1` characters are held back, since they may begin one.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def push(self, delta: str, finished: bool) -> str:
        """The text that is now safe to send."""
        if self.stopped:
            return ""
        boundary = len(self.text)
        self.text += delta
        if finished:
            self.stopped = True
            match = first_stop_ending_after(self.text, boundary, self.stops) if self.stops else None
            if match is not None:
                self.text, self.matched = self.text[:match.start], match.stop
        end = len(self.text) if finished else max(self.sent, len(self.text) - self.hold)
        out = self.text[self.sent:end]
        self.sent = end
        return out


class ReplyText:
    """One reply's text as its token ids arrive: decoded incrementally, then held back and cut by a
    `StopTextBuffer`, so the pieces `push` returns join to the final text."""

    def __init__(self, tokenizer: Any, stops: Sequence[str]):
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.buffer = StopTextBuffer(stops)

    def push(self, token_ids: Sequence[int], finished: bool) -> str:
        """The text that is now safe to send, given the reply's next ids (and whether they end it)."""
        delta = self.detokenizer.add_tokens(token_ids)
        if finished:
            delta += self.detokenizer.flush()
        return self.buffer.push(delta, finished)

    @property
    def matched(self) -> str | None:
        """The stop string that ended the reply, once it has."""
        return self.buffer.matched

    @property
    def text(self) -> str:
        """All the text so far (the final text, cut, once the reply has finished)."""
        return self.buffer.text
