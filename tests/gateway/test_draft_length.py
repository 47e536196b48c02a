from gateway.draft_length import AdaptiveDraftLength


def test_failing_drafts_halve_the_limit_and_landing_ones_double_it_up_to_k():
    length = AdaptiveDraftLength(8)
    for drafted, accepted, limit in [(8, 0, 4), (4, 0, 2), (2, 0, 1), (1, 0, 1),  # never below 1
                                     (1, 1, 2), (2, 1, 2),  # a partial acceptance keeps it
                                     (2, 2, 4), (0, 0, 4),  # a step without a draft says nothing
                                     (3, 3, 8), (8, 8, 8)]:  # a short draft accepted in full grows it too
        length.observe(drafted, accepted)
        assert length.limit == limit, (drafted, accepted)
