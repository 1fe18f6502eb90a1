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


def test_the_session_is_metadata_user_id_or_the_session_id_inside_it():
    from agentjax.server.anthropic_serving import anthropic_session_id

    claude_code = '{"device_id":"51f1","account_uuid":"","session_id":"ae9c1402-77b1"}'
    assert anthropic_session_id(claude_code) == "ae9c1402-77b1"
    assert anthropic_session_id("agent-7") == "agent-7"
    assert anthropic_session_id('{"device_id": "x"}') == '{"device_id": "x"}'
    assert anthropic_session_id("{not json") == "{not json"
    assert anthropic_session_id(None) is None


def test_a_call_whose_arguments_broke_off_becomes_an_empty_input():
    from agentjax.server.anthropic_serving import tool_use_block

    assert tool_use_block(ToolCall("call_1", "search", '{"q": "un'))["input"] == {}
