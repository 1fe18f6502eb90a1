"""Stop strings over a stream: the joined deltas always equal the cut full text."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from agentjax.server.text import StopTextBuffer, apply_stop

ALPHABET = st.text(alphabet="abc ", max_size=6)


@given(pieces=st.lists(ALPHABET, max_size=12), stops=st.lists(st.text(alphabet="abc ", min_size=1, max_size=3),
                                                               max_size=3))
def test_streamed_text_with_stops_joins_to_the_cut_full_text(pieces, stops):
    buffer = StopTextBuffer(stops)
    streamed = "".join(buffer.push(piece, finished=index == len(pieces) - 1) for index, piece in enumerate(pieces))
    if not pieces:
        streamed = buffer.push("", finished=True)
    assert streamed == apply_stop("".join(pieces), stops)


def test_apply_stop_cuts_at_the_earliest_stop():
    assert apply_stop("one two three", ["three", "two"]) == "one "
    assert apply_stop("abc", []) == "abc"
