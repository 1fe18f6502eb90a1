"""Text helpers of the server: chat messages for the template, and stop strings over a stream.

`StopTextBuffer` holds back the few characters that might begin a stop string and cuts the text
once, where the stop string that ended the reply begins, so streamed text joins to exactly the
non-streamed text. Never imports jax.
"""
from __future__ import annotations

from collections.abc import Sequence

from agentjax.server.errors import APIError
from agentjax.stop_strings import first_stop_ending_after
from agentjax.server.protocol import ChatMessage


def chat_messages(messages: Sequence[ChatMessage]) -> list[dict]:
    """Plain dicts for the chat template; content parts are joined, only text parts are allowed."""
    plain = []
    for index, message in enumerate(messages):
        item = message.model_dump(exclude_none=True)
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(f"messages[{index}].content has a {part.type!r} part; only text parts "
                                   f"are supported", param=f"messages[{index}].content")
                texts.append(part.text)
            item["content"] = "".join(texts)
        elif content is None:
            item["content"] = ""
        plain.append(item)
    return plain


def find_stop(text: str, stops: Sequence[str]) -> tuple[int, str | None]:
    """(index, stop string) of the earliest stop string in `text`, or (-1, None)."""
    found = [(i, s) for s in stops if s for i in (text.find(s),) if i >= 0]
    return min(found) if found else (-1, None)


def apply_stop(text: str, stops: Sequence[str]) -> str:
    """`text` cut before the earliest stop string it contains."""
    cut, _ = find_stop(text, stops)
    return text if cut < 0 else text[:cut]


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
