"""Which segments of a pass share a padded attention call (torch_sdpa.group_segments)."""

from hypothesis import given
from hypothesis import strategies as st

from verifier_service.attention.torch_sdpa import CALL_COST, group_segments

SMOLLM2_WIDTH = 9 * 64  # query heads x head dimension


def test_one_long_draft_gets_a_call_of_its_own_instead_of_padding_the_batch():
    shapes = [(4, 600)] * 15 + [(25, 600)]
    assert group_segments(shapes, CALL_COST / SMOLLM2_WIDTH) == [list(range(15)), [15]]


def test_decodes_of_very_different_contexts_are_not_padded_to_the_longest():
    shapes = [(1, 4000), *[(1, 300)] * 15]
    assert group_segments(shapes, CALL_COST / SMOLLM2_WIDTH) == [list(range(1, 16)), [0]]


def test_where_padding_costs_less_than_a_call_the_segments_share_one():
    shapes = [(1, 40), (2, 40), (6, 40), (3, 40)]
    assert group_segments(shapes, CALL_COST / SMOLLM2_WIDTH) == [[0, 1, 3, 2]]
    assert len(group_segments(shapes, 0)) == 4


@given(st.lists(st.tuples(st.integers(1, 300), st.integers(1, 5000)), min_size=1, max_size=40),
       st.sampled_from([0.0, 100.0, CALL_COST / SMOLLM2_WIDTH, float("inf")]))
def test_every_segment_is_in_exactly_one_call(shapes, call_pairs):
    groups = group_segments(shapes, call_pairs)
    assert sorted(i for group in groups for i in group) == list(range(len(shapes)))
    assert all(groups)
    if call_pairs == float("inf"):
        assert len(groups) == 1
