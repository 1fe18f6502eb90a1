"""The non-streamed Anthropic reply lists its blocks in the order the stream sends them."""
from __future__ import annotations

from agentjax.server.anthropic_serving import content_blocks
from agentjax.server.chat_path import TextDelta, ToolCallDelta
from agentjax.server.tool_parsers import ToolCall


def test_blocks_keep_the_order_of_text_and_calls():
    call = ToolCall("call_abc", "search", '{"q": "x"}')
    parts = [TextDelta("  "), TextDelta("Looking"), TextDelta(" it up."), ToolCallDelta(0, call),
             TextDelta("\n"), TextDelta("Done."), TextDelta(" ")]
    assert content_blocks(parts) == [
        {"type": "text", "text": "  Looking it up."},
        {"type": "tool_use", "id": "toolu_abc", "name": "search", "input": {"q": "x"}},
        {"type": "text", "text": "\nDone. "},
    ]


def test_whitespace_alone_opens_no_block():
    call = ToolCall("call_1", "search", "{}")
    assert content_blocks([TextDelta("\n"), ToolCallDelta(0, call), TextDelta(" \n")]) == [
        {"type": "tool_use", "id": "toolu_1", "name": "search", "input": {}}]
