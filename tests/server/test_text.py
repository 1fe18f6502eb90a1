"""Stop strings over a stream: the joined deltas always equal the cut full text."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from agentjax.server.text import apply_stop
from agentjax.stop_strings import StopStringMatcher, StopTextBuffer

ALPHABET = st.text(alphabet="abc ", max_size=6)


@given(pieces=st.lists(ALPHABET, max_size=12), stops=st.lists(st.text(alphabet="abc ", min_size=1, max_size=3),
                                                               max_size=3))
def test_streamed_text_with_stops_joins_to_the_cut_full_text(pieces, stops):
    """The engine ends the reply at the piece that completes a stop string (or at the last piece);
    the buffer's output then joins to the text cut at the earliest stop string."""
    engine_side = StopStringMatcher(stops)
    sent = []
    for index, piece in enumerate(pieces):
        finished = engine_side.push(piece) is not None or index == len(pieces) - 1
        sent.append(piece)
        if finished:
            break
    buffer = StopTextBuffer(stops)
    streamed = "".join(buffer.push(piece, finished=index == len(sent) - 1) for index, piece in enumerate(sent))
    if not sent:
        streamed = buffer.push("", finished=True)
    assert streamed == apply_stop("".join(sent), stops)
    assert (buffer.matched is not None) == any(s in "".join(sent) for s in stops if s)


def test_text_is_held_back_only_as_long_as_a_stop_string_could_begin_in_it():
    buffer = StopTextBuffer(["STOP"])
    assert buffer.push("hello S", False) == "hell"
    assert buffer.push("T", False) == "o"
    assert buffer.push("OP and more", True) == " "
    assert buffer.matched == "STOP"


def test_apply_stop_cuts_at_the_earliest_stop():
    assert apply_stop("one two three", ["three", "two"]) == "one "
    assert apply_stop("abc", []) == "abc"
