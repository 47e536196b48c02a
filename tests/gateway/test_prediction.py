from gateway.prediction import PredictionDrafter

PREDICTION = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]


def test_drafts_the_prediction_while_the_output_follows_it():
    drafter = PredictionDrafter(PREDICTION)
    assert drafter.draft(4) == [10, 11, 12, 13]
    drafter.advance([10, 11, 12])
    assert drafter.draft(4) == [13, 14, 15, 16]
    drafter.advance([13, 14, 15, 16, 17, 18, 19])
    assert drafter.draft(4) == []


def test_realigns_after_an_edit_on_the_output_tail():
    drafter = PredictionDrafter(PREDICTION)
    drafter.advance([10, 11, 99])  # an edit: the output leaves the prediction
    assert drafter.draft(4) == []
    drafter.advance([98, 14, 15, 16])  # three shared tokens are not enough to re-align
    assert drafter.draft(4) == []
    drafter.advance([17])  # ... four are
    assert drafter.draft(3) == [18, 19]


def test_prefers_the_longest_matching_tail():
    prediction = [1, 2, 3, 4, 7, 8, 5, 1, 2, 3, 4, 9]
    drafter = PredictionDrafter(prediction)
    drafter.advance([6, 5, 1, 2, 3, 4])
    assert drafter.draft(2) == [9]


def test_an_output_that_starts_elsewhere_finds_the_prediction_later():
    drafter = PredictionDrafter(PREDICTION)
    drafter.advance([1, 2, 3, 12, 13, 14, 15])
    assert drafter.draft(2) == [16, 17]
