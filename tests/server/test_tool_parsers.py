"""Tool-call parsers and tool prompts: calls are read whatever the chunking, bad calls come back as
text, and the constraints each parser builds compile and admit only calls of the named tools."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentjax.server.tool_parsers import (
    HermesToolParser,
    JsonToolParser,
    TextPiece,
    ToolCall,
    ToolCallArguments,
    ToolCallStart,
    call_schema,
)
from checkpoints.tool_prompt import fold_tools, render_tool_call

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]


def parse(parser_class, text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]]]:
    parser = parser_class(TOOLS)
    pieces, start = [], 0
    for cut in sorted(c for c in cuts if 0 < c < len(text)):
        pieces += parser.feed(text[start:cut], False)
        start = cut
    pieces += parser.feed(text[start:], True)
    check_streamed_calls(pieces)
    text_out = "".join(p.text for p in pieces if isinstance(p, TextPiece))
    return text_out, [(p.name, p.arguments) for p in pieces if isinstance(p, ToolCall)]


def check_streamed_calls(pieces) -> None:
    """A started call's fragments join to its final arguments, and it ends before the next starts."""
    started, fragments = None, []
    for piece in pieces:
        if isinstance(piece, ToolCallStart):
            assert started is None
            started, fragments = piece, []
        elif isinstance(piece, ToolCallArguments):
            assert started is not None and piece.text
            fragments.append(piece.text)
        elif isinstance(piece, ToolCall) and started is not None:
            assert (piece.id, piece.name, piece.arguments) == (started.id, started.name, "".join(fragments))
            started = None
        else:
            assert started is None, "text arrived inside a streamed call"
    assert started is None


HERMES_CASES = [
    ("Plain answer, no tools.", "Plain answer, no tools.", []),
    ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Checking.", [("get_weather", '{"city": "Paris"}')]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "A"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "search", "arguments": "{\\"q\\": 1}"}\n</tool_call>',
     "", [("get_weather", '{"city": "A"}'), ("search", '{"q": 1}')]),
    # Unreadable calls come back as text: bad JSON, an unknown tool, arguments that are no object.
    ('<tool_call>{"name": "get_weather" "arguments": {"city": "A"}}</tool_call>',
     '<tool_call>{"name": "get_weather" "arguments": {"city": "A"}}</tool_call>', []),
    # ... but a known function's call streams from its arguments' first brace: if they break off,
    # the call ends with the arguments as written.
    ('<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>', "",
     [("get_weather", '{"city": ')]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', "", [("get_weather", '{"city": "Pa')]),
    ('<tool_call>{"name": "search", "arguments": {"q": "a</tool_call>b"}}</tool_call>', 'b"}}</tool_call>',
     [("search", '{"q": "a')]),
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> done',
     '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> done', []),
    ('<tool_call>{"name": "search", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "search", "arguments": [1]}</tool_call>', []),
    # Cut off before the closing tag: still a call if the JSON is whole, else text.
    ('<tool_call>\n{"name": "search", "arguments": {}}', "", [("search", "{}")]),
    ('<tool_call>\n{"name": "search", "argu', '<tool_call>\n{"name": "search", "argu', []),
    ("a <tool b", "a <tool b", []),
]


@pytest.mark.parametrize("text, expected_text, expected_calls", HERMES_CASES)
def test_hermes_parser_reads_calls_and_returns_the_rest_as_text(text, expected_text, expected_calls):
    assert parse(HermesToolParser, text, []) == (expected_text, expected_calls)


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(HERMES_CASES), cuts=st.lists(st.integers(0, 120), max_size=12))
def test_hermes_parser_gives_the_same_result_whatever_the_chunking(case, cuts):
    text, expected_text, expected_calls = case
    assert parse(HermesToolParser, text, cuts) == (expected_text, expected_calls)


@pytest.mark.parametrize("text, expected_text, expected_calls", [
    ('{"name": "search", "arguments": {"q": "x"}}', "", [("search", '{"q": "x"}')]),
    ('[{"name": "search", "parameters": {}}, {"name": "get_weather", "arguments": {"city": "B"}}]', "",
     [("search", "{}"), ("get_weather", '{"city": "B"}')]),
    ('{"answer": 42}', '{"answer": 42}', []),
    ('[{"name": "search", "arguments": {}}, {"name": "nope", "arguments": {}}]',
     '[{"name": "search", "arguments": {}}, {"name": "nope", "arguments": {}}]', []),
    ("Just text {", "Just text {", []),
])
@pytest.mark.parametrize("cuts", [[], [1, 5, 9, 30]])
def test_json_parser_reads_a_whole_reply_of_calls_or_returns_text(text, expected_text, expected_calls, cuts):
    assert parse(JsonToolParser, text, cuts) == (expected_text, expected_calls)


def test_hermes_calls_stream_their_arguments_before_the_call_is_complete():
    parser = HermesToolParser(TOOLS)
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "note": "a}b\\"c"}}\n</tool_call>'
    pieces = []
    for char in text:
        pieces.append(parser.feed(char, False))
    pieces.append(parser.feed("", True))
    flat = [p for step in pieces for p in step]
    check_streamed_calls(flat)
    first_fragment = next(i for i, step in enumerate(pieces) if any(isinstance(p, ToolCallArguments) for p in step))
    start = next(i for i, step in enumerate(pieces) if any(isinstance(p, ToolCallStart) for p in step))
    done = next(i for i, step in enumerate(pieces) if any(isinstance(p, ToolCall) for p in step))
    assert start == first_fragment == text.index('"arguments": {') + len('"arguments": ')
    assert done == len(text) - 1  # the call is complete at its closing tag
    assert flat[-1].arguments == '{"city": "Paris", "note": "a}b\\"c"}'
    json.loads(flat[-1].arguments)


def test_fold_tools_writes_tools_calls_and_results_into_plain_messages():
    call = {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"q": "x"}'}}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Find x"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "r1"},
                {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "r2"}]}]
    folded = fold_tools(messages, TOOLS)
    assert [m["role"] for m in folded] == ["system", "user", "assistant", "user"]
    assert folded[0]["content"].startswith("Be brief.\n\n") and '"name": "get_weather"' in folded[0]["content"]
    assert folded[2]["content"] == render_tool_call("search", '{"q": "x"}')
    assert folded[3]["content"] == "<tool_response>\nr1\n</tool_response>\n<tool_response>\nr2\n</tool_response>"
    assert all("tool_calls" not in m and "tool_call_id" not in m for m in folded)
    # A user message after tool results joins their turn: roles keep alternating.
    folded = fold_tools([*messages, {"role": "user", "content": "And y?"}], TOOLS)
    assert [m["role"] for m in folded] == ["system", "user", "assistant", "user"]
    assert folded[3]["content"].endswith("</tool_response>\nAnd y?")


def test_the_gemma_template_renders_a_tool_conversation():
    from checkpoints.chat_template import GEMMA3_CHAT_TEMPLATE, ChatTemplate

    call = {"id": "c1", "type": "function", "function": {"name": "search", "arguments": "{}"}}
    messages = [{"role": "user", "content": "Find x"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "r1"}, {"role": "user", "content": "Thanks"}]
    text = ChatTemplate(GEMMA3_CHAT_TEMPLATE).render(messages, special_tokens={"bos_token": "<bos>"}, tools=TOOLS)
    assert text.count("<start_of_turn>user") == 2 and "<tool_response>\nr1\n</tool_response>\nThanks" in text
    assert '"name": "get_weather"' in text and text.endswith("<start_of_turn>model\n")


def test_a_rendered_call_parses_back_to_the_same_call():
    text = render_tool_call("get_weather", {"city": "Oslo"})
    assert parse(HermesToolParser, text, []) == ("", [("get_weather", '{"city": "Oslo"}')])


@pytest.fixture(scope="module")
def grammar():
    from agentjax.structured.backend import GrammarBackend
    from checkpoints.embedded import smollm2_path
    from checkpoints.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(smollm2_path())
    return GrammarBackend(tokenizer, tokenizer.vocab_size, tokenizer.stop_token_ids), tokenizer


@pytest.mark.parametrize("parser_class", [HermesToolParser, JsonToolParser])
@pytest.mark.parametrize("parallel", [False, True])
def test_constraints_accept_a_call_of_the_named_tool_and_reject_others(grammar, parser_class, parallel):
    backend, tokenizer = grammar
    functions = [TOOLS[0]["function"]]
    good = {"name": "get_weather", "arguments": {"city": "Rome"}}
    wrong_tool = {"name": "search", "arguments": {"city": "Rome"}}
    bad_args = {"name": "get_weather", "arguments": {"town": "Rome"}}

    def written(call: dict) -> str:
        if parser_class is HermesToolParser:
            return render_tool_call(call["name"], call["arguments"])
        return json.dumps([call] if parallel else call)

    constraint = parser_class.constraint(functions, 3 if parallel else 1)
    for call, allowed in ((good, True), (wrong_tool, False), (bad_args, False)):
        matcher = backend.new_matcher(constraint)
        tokens = tokenizer.encode(written(call), add_special_tokens=False)
        consumed = matcher.try_consume_tokens(tokens)
        assert (consumed == len(tokens) and matcher.is_accepting()) == allowed, (call, consumed, len(tokens))
        text, calls = parse(parser_class, written(call), [])
        if allowed:
            assert calls == [("get_weather", '{"city": "Rome"}')] and text == ""


@pytest.mark.parametrize("parser_class", [HermesToolParser, JsonToolParser])
def test_a_parallel_constraint_admits_up_to_its_number_of_calls_and_can_end_after_any(grammar, parser_class):
    backend, tokenizer = grammar
    call = {"name": "get_weather", "arguments": {"city": "Rome"}}

    def written(count: int) -> str:
        if parser_class is HermesToolParser:
            return "\n".join(render_tool_call(call["name"], call["arguments"]) for _ in range(count))
        return json.dumps([call] * count)

    constraint = parser_class.constraint([TOOLS[0]["function"]], 3)
    for count in (1, 2, 3, 4):
        matcher = backend.new_matcher(constraint)
        tokens = tokenizer.encode(written(count), add_special_tokens=False)
        consumed = matcher.try_consume_tokens(tokens)
        assert (consumed == len(tokens) and matcher.is_accepting()) == (count <= 3), count


def test_a_forced_calls_arguments_follow_json_schema_so_extra_keys_need_additional_properties_false():
    """docs/serving.md: a named tool choice constrains the arguments to the function's schema as JSON
    Schema reads it; a schema without `additionalProperties: false` lets the model add keys."""
    import json

    from agentjax.structured import StructuredOutput
    from agentjax.structured.backend import GrammarBackend
    from checkpoints.embedded import smollm2_path
    from checkpoints.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(smollm2_path())
    backend = GrammarBackend(tokenizer, 49152, [2])

    def allowed(parameters: dict, arguments: dict) -> bool:
        matcher = backend.new_matcher(StructuredOutput.json_schema(call_schema({"name": "read_file",
                                                                                "parameters": parameters})))
        text = json.dumps({"name": "read_file", "arguments": arguments}, separators=(", ", ": "))
        ids = tokenizer.encode(text, add_special_tokens=False)
        return matcher.validate_tokens(ids) == len(ids)

    open_schema = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
    closed_schema = {**open_schema, "additionalProperties": False}
    assert allowed(open_schema, {"path": "setup.py", "mode": "r"})
    assert not allowed(closed_schema, {"path": "setup.py", "mode": "r"})
    assert allowed(closed_schema, {"path": "setup.py"})
    assert not allowed(closed_schema, {})  # `required` holds either way
