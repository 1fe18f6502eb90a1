"""Stop strings found incrementally: the same answers as a search of the whole text, in one pass."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from agentjax.sampling_params import SamplingParams
from agentjax.stop_strings import ReplyText, StopStringMatcher, first_stop_ending_after, reply_hit_stop_string


def whole_text_first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    found = [(text.find(s), s) for s in stops if s in text]
    return min(found) if found else None


@pytest.mark.parametrize("seed", range(20))
def test_pieces_in_any_split_report_the_first_stop_where_a_whole_text_search_finds_it(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice("abc d\n") for _ in range(200))
    stops = ["".join(rng.choice("abc d\n") for _ in range(rng.randint(1, 5))) for _ in range(3)]
    matcher = StopStringMatcher(stops)
    position, first = 0, None
    while position < len(text) and first is None:
        piece = text[position:position + rng.randint(1, 7)]
        first = matcher.push(piece)
        position += len(piece)
    expected = whole_text_first_stop(text[:position], stops)
    assert (None if first is None else (first.start, first.stop)) == expected
    if expected is not None:  # and no stop string was complete one piece earlier
        assert expected[0] + len(expected[1]) > position - len(piece)


def test_a_stop_string_split_across_many_deltas_is_found_at_its_start():
    matcher = StopStringMatcher(["</answer>"])
    assert [matcher.push(p) for p in ["The answer is 4", "</", "ans", "wer"]] == [None] * 4
    match = matcher.push(">tail")
    assert (match.start, match.stop) == (len("The answer is 4"), "</answer>")


def test_a_match_is_reported_once_even_when_its_text_is_kept_in_the_tail():
    matcher = StopStringMatcher(["x", "long-stop"])
    assert matcher.push("ax").stop == "x"
    assert matcher.push("b") is None  # "x" still sits in the tail; it is not reported again


def test_the_matcher_keeps_only_a_short_tail_whatever_the_reply_length():
    matcher = StopStringMatcher(["STOP"])
    for _ in range(10_000):
        assert matcher.push("lorem ipsum ") is None
    assert len(matcher.tail) == 3 and matcher.tail_start == 10_000 * 12 - 3


def test_first_stop_ending_after_skips_stops_that_end_before_the_boundary():
    assert first_stop_ending_after("ab|cd|", 3, ["|"]).start == 5
    assert first_stop_ending_after("ab|cd|", 2, ["|"]).start == 2
    assert first_stop_ending_after("abc", 0, []) is None


class CharTokenizer:
    """One token per character (id = code point); enough for the detokenizer."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


@dataclass(eq=False)
class FakeRequest:
    sampling: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)


def test_a_request_watch_reads_each_new_token_once_and_reports_the_token_that_completes_a_stop():
    request = FakeRequest(SamplingParams(max_tokens=50, stop=("END",)))
    tokenizer = CharTokenizer()
    hits = []
    for char in "the END of it":
        request.output_token_ids.append(ord(char))
        hits.append(reply_hit_stop_string(request, tokenizer))
    assert hits.index(True) == len("the END") - 1 and hits.count(True) == 1
    assert reply_hit_stop_string(request, tokenizer) is False  # nothing new to read


def test_engine_stop_strings_match_the_server_cut_on_the_real_tokenizer():
    from checkpoints.embedded import smollm2_path
    from checkpoints.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(smollm2_path())
    ids = tokenizer.encode("Paris is the capital. Über café: done", add_special_tokens=False)
    request = FakeRequest(SamplingParams(max_tokens=64, stop=("café",)))
    stopped_at = None
    for index, token in enumerate(ids):
        request.output_token_ids.append(token)
        if reply_hit_stop_string(request, tokenizer):
            stopped_at = index
            break
    assert stopped_at is not None
    text = tokenizer.decode(ids[: stopped_at + 1])
    assert "café" in text and "café" not in tokenizer.decode(ids[:stopped_at])


def test_reply_text_stops_where_the_engine_stops_and_cuts_once_for_the_server_and_llm():
    """The engine's watch ends the reply at the token completing "END"; the ids then reach `ReplyText` in
    uneven pieces, and the pieces it returns join to the text cut where that stop string begins."""
    request = FakeRequest(SamplingParams(max_tokens=50, stop=("END", "xyz")))
    tokenizer = CharTokenizer()
    for char in "say ENDING and more":
        request.output_token_ids.append(ord(char))
        if reply_hit_stop_string(request, tokenizer):
            break
    ids = request.output_token_ids
    reply = ReplyText(tokenizer, request.sampling.stop)
    pieces = [reply.push(ids[:3], False), reply.push(ids[3:5], False), reply.push(ids[5:], True)]
    assert pieces == ["s", "ay", " "]  # the last 2 characters wait: they may begin "END" or "xyz"
    assert "".join(pieces) == reply.text == "say " and reply.matched == "END"
    assert reply.push([ord("x")], True) == ""  # nothing after the end
