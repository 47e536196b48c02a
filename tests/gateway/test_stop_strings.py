import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.stop_strings import StopStringMatcher


def first_stop_by_scanning(text, stop_strings):
    """Reference: read the text one character at a time; at the first position
    where a stop string has been read completely, cut before it."""
    for end in range(1, len(text) + 1):
        complete = [stop for stop in stop_strings if text[:end].endswith(stop)]
        if complete:
            return text[:end - max(map(len, complete))], True
    return text, False


def stream(stop_strings, chunks):
    matcher = StopStringMatcher(stop_strings)
    out = []
    for chunk in chunks:
        text, stopped = matcher.push(chunk)
        out.append(text)
        if stopped:
            return out, True
    out.append(matcher.flush())
    return out, False


ALPHABET = "ab c"


@settings(max_examples=300, deadline=None)
@given(chunks=st.lists(st.text(ALPHABET, max_size=5), max_size=8),
       stop_strings=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=4))
def test_streamed_output_is_the_text_cut_at_the_first_stop_string(chunks, stop_strings):
    out, stopped = stream(stop_strings, chunks)
    assert ("".join(out), stopped) == first_stop_by_scanning("".join(chunks), stop_strings)


def test_possible_stop_prefix_is_held_back_then_released():
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.push("42 </an") == ("42 ", False)
    assert matcher.push("d more") == ("</and more", False)
    assert matcher.flush() == ""


def test_stop_string_split_across_chunks_is_excluded():
    matcher = StopStringMatcher(["STOP", "\n\n"])
    assert matcher.push("one ST") == ("one ", False)
    assert matcher.push("OP two") == ("", True)


def test_held_text_is_flushed_at_the_end():
    matcher = StopStringMatcher(["xyz"])
    assert matcher.push("abcxy") == ("abc", False)
    assert matcher.flush() == "xy"


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError, match="empty"):
        StopStringMatcher(["ok", ""])
