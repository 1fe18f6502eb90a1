"""Request parsing at the edge: a body that is not UTF-8 JSON text, or a string (or key) in it holding
NUL or a lone surrogate, is a 400 naming the field on every route; nothing else changes a body."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from agentjax.server.app import create_app
from agentjax.server.edge import InvalidTextError, parse_json_body
from tests.server.fakes import FakeEngine, FakeTokenizer

BODIES = {
    "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "X"}]},
    "/v1/completions": {"model": "m", "prompt": "X"},
    "/v1/responses": {"model": "m", "input": "X"},
    "/v1/messages": {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "X"}]},
    "/v1/messages/count_tokens": {"model": "m", "messages": [{"role": "user", "content": "X"}]},
    "/tokenize": {"prompt": "X"},
    "/detokenize": {"model": "X", "tokens": [70]},
    "/kv/prompt_hashes": {"path": "/v1/completions", "body": {"prompt": "X"}},
    "/kv/prefill": {"path": "/v1/completions", "body": {"prompt": "X"}},
}


@pytest.mark.parametrize("raw, code, needle", [
    (rb'{"a": "x\ud800"}', "invalid_text", "a holds a lone surrogate (U+D800)"),
    (rb'{"a": [{"b": "\udfff"}]}', "invalid_text", "a[0].b holds a lone surrogate (U+DFFF)"),
    (rb'{"a": "nul\u0000"}', "invalid_text", "a holds a NUL character"),
    (rb'{"\ud800": 1}', "invalid_text", "a key in the body"),
    (b'{"a": "\xc0\x80"}', "invalid_utf8", "not valid UTF-8: byte 7"),
    (b'{"a": "\xed\xa0\x80"}', "invalid_utf8", "not valid UTF-8"),
    (b'{"a": "\xff"}', "invalid_utf8", "not valid UTF-8"),
    (b'{"a": [1, 2', "invalid_json", "not valid JSON"),
    (b"[" * 100_000, "invalid_json", "recursion"),
    (b'{"a": ' + b"9" * 5000 + b"}", "invalid_json", "4300 digits"),
])
def test_bodies_that_are_not_json_text_are_refused_with_the_reason(raw, code, needle):
    with pytest.raises(InvalidTextError) as caught:
        parse_json_body(raw)
    assert caught.value.code == code and needle in caught.value.message


def test_escaped_backslashes_and_surrogate_pairs_are_plain_text():
    assert parse_json_body(rb'{"a": "\\ud800 and \\u0000"}') == {"a": "\\ud800 and \\u0000"}
    assert parse_json_body(rb'{"a": "\ud83d\ude00"}') == {"a": "\U0001f600"}


TEXT = st.text(alphabet=st.characters(codec=None, categories=None), max_size=8)  # surrogates and NUL included
JSON = st.recursive(st.none() | st.booleans() | st.integers() | TEXT,
                    lambda children: st.lists(children, max_size=3) | st.dictionaries(TEXT, children, max_size=3),
                    max_leaves=12)


def holds_bad_text(value) -> bool:
    if isinstance(value, str):
        return "\x00" in value or any(0xD800 <= ord(c) <= 0xDFFF for c in value)
    if isinstance(value, dict):
        return any(holds_bad_text(k) or holds_bad_text(v) for k, v in value.items())
    return isinstance(value, list) and any(holds_bad_text(v) for v in value)


@settings(max_examples=300, deadline=None)
@given(value=JSON, ensure_ascii=st.booleans())
def test_a_body_is_refused_exactly_when_its_parsed_text_holds_nul_or_a_lone_surrogate(value, ensure_ascii):
    raw = json.dumps(value, ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass")
    try:
        expected = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:  # a raw surrogate: not UTF-8
        with pytest.raises(InvalidTextError, match="UTF-8"):
            parse_json_body(raw)
        return
    if holds_bad_text(expected):
        with pytest.raises(InvalidTextError):
            parse_json_body(raw)
    else:
        assert parse_json_body(raw) == expected


@pytest.mark.parametrize("path", sorted(BODIES))
@pytest.mark.parametrize("bad", ["lone surrogate", "nul", "overlong"])
def test_every_body_route_answers_bad_text_with_a_400_naming_it(path, bad):
    raw = json.dumps(BODIES[path]).encode()
    raw = raw.replace(b'"X"', {"lone surrogate": rb'"a\ud800"', "nul": rb'"a\u0000"', "overlong": b'"a\xc0\xaf"'}[bad])
    with TestClient(create_app(FakeEngine(), FakeTokenizer(), model_name="m"), raise_server_exceptions=True) as client:
        response = client.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert ("UTF-8" if bad == "overlong" else "holds a") in message, message
