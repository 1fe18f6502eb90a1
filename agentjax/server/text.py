"""Text helpers of the server: chat messages for the template, and a whole-text stop-string cut.

The streamed cut (`StopTextBuffer`, `ReplyText`) lives in `agentjax/stop_strings.py` beside the
engine's matcher; `apply_stop` is the plain whole-text search it must agree with. Never imports jax.
"""
from __future__ import annotations

from collections.abc import Sequence

from agentjax.server.errors import APIError
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
