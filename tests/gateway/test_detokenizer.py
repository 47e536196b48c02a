from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer

# Text without U+FFFD itself, so any U+FFFD in the output would be a broken character;
# without lone surrogates (category Cs), which are not encodable text.
ANY_CHARACTER = st.characters(exclude_characters=REPLACEMENT_CHAR, exclude_categories=("Cs",))
TEXT = st.text(alphabet=st.one_of(st.sampled_from("aé你🚀🦀👍🏽 \n,"), ANY_CHARACTER), max_size=30)
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def split(token_ids, cuts):
    bounds = sorted({0, len(token_ids), *(c % (len(token_ids) + 1) for c in cuts)})
    return [token_ids[a:b] for a, b in zip(bounds, bounds[1:])]


def stream(tokenizer, chunks, prompt_ids=()):
    detokenizer = IncrementalDetokenizer(tokenizer, list(prompt_ids))
    pieces = [detokenizer.push(chunk) for chunk in chunks]
    return pieces, detokenizer.flush()


@FAST
@given(text=TEXT, cuts=st.lists(st.integers(min_value=0), max_size=8), prompt=st.sampled_from(["", "Say: ", "你好 "]))
def test_streamed_text_equals_full_decode_and_never_breaks_a_character(any_tokenizer, text, cuts, prompt):
    token_ids = any_tokenizer.encode(text, add_special_tokens=False)
    prompt_ids = any_tokenizer.encode(prompt, add_special_tokens=False)
    pieces, tail = stream(any_tokenizer, split(token_ids, cuts), prompt_ids)
    full_text = any_tokenizer.decode(token_ids, skip_special_tokens=True)
    assert "".join(pieces) + tail == full_text
    if REPLACEMENT_CHAR not in full_text:  # (a vocabulary may lack the bytes of rare characters)
        assert tail == ""  # valid text never needs the end-of-generation flush
        assert not any(REPLACEMENT_CHAR in piece for piece in pieces)


def test_multibyte_character_split_across_tokens_is_held_back(tiny_tokenizer):
    token_ids = tiny_tokenizer.encode("a🦀", add_special_tokens=False)
    crab_ids = tiny_tokenizer.encode("🦀", add_special_tokens=False)
    assert len(crab_ids) > 1  # the premise: the crab's 4 bytes (not in the training corpus) span several tokens
    detokenizer = IncrementalDetokenizer(tiny_tokenizer)
    pieces = [detokenizer.push([token_id]) for token_id in token_ids]
    assert pieces[0] == "a"
    assert pieces[1:-1] == [""] * (len(pieces) - 2)
    assert pieces[-1] == "🦀"


def test_special_tokens_are_left_out_of_the_text(tiny_tokenizer):
    detokenizer = IncrementalDetokenizer(tiny_tokenizer)
    ids = tiny_tokenizer.encode("done", add_special_tokens=False)
    text = detokenizer.push(ids) + detokenizer.push([tiny_tokenizer.eos_token_id]) + detokenizer.flush()
    assert text == "done"


@FAST
@given(token_ids=st.lists(st.integers(min_value=0, max_value=419), max_size=20),
       cuts=st.lists(st.integers(min_value=0), max_size=6))
def test_any_token_sequence_streams_to_its_full_decode(tiny_tokenizer, token_ids, cuts):
    pieces, tail = stream(tiny_tokenizer, split(token_ids, cuts))
    assert "".join(pieces) + tail == tiny_tokenizer.decode(token_ids, skip_special_tokens=True)
    # Held back text is released only at the end, when it can no longer be completed.
    assert not any(piece.endswith(REPLACEMENT_CHAR) for piece in pieces)
