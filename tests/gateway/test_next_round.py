"""Next-round offers: the drafts after a step for its likely outcomes (gateway/next_round.py)."""

from gateway.next_round import continuations_after, cut
from protos.common.v1 import common_pb2


def test_a_continuation_is_read_from_the_longer_draft_where_it_goes_on_past_the_step():
    drafted = common_pb2.Draft(token_ids=[1, 2, 3, 4, 5, 6], confidences=[1, 1, .5, .5, .5, .25], committed_len=10)
    step = cut(drafted, 0, 2)
    assert list(step.token_ids) == [1, 2] and step.score == 2 and step.committed_len == 10
    [continuation] = continuations_after(step, drafted, k=2)
    assert continuation.bonus_token_id == 3
    assert list(continuation.draft.token_ids) == [4, 5] and continuation.draft.committed_len == 13
    assert list(continuation.draft.confidences) == [.5, .5]
    assert continuations_after(common_pb2.Draft(token_ids=[1, 7]), drafted, k=2) == []  # drafted something else
    assert continuations_after(cut(drafted, 0, 5), drafted, k=2) == []  # nothing after the bonus
    tree = common_pb2.Draft(token_ids=[1, 2, 3, 4], parents=[-1, 0, 0, 1], confidences=[1, .5, .5, .25])
    held = cut(tree, 0, 3)  # a load or adaptive limit holds for trees too
    assert (list(held.token_ids), list(held.parents), held.score) == ([1, 2, 3], [-1, 0, 0], 2)
    assert continuations_after(cut(tree, 0, 1), tree, k=2) == []


def test_detours_are_offered_for_the_outcomes_of_the_step_that_is_verified():
    def detour(position, token):
        return common_pb2.Detour(position=position, token_id=token, token_ids=[20 + token, 21, 22],
                                 confidences=[1, .5, .25])

    drafted = common_pb2.Draft(token_ids=[1, 2, 3, 4, 5], confidences=[1, 1, .5, .5, .5], committed_len=10,
                               step_len=3, detours=[detour(0, 7), detour(2, 8), detour(3, 9), detour(4, 6)])
    step = cut(drafted, 0, 2)  # cut by the gateway below the drafter's step of 3
    offered = continuations_after(step, drafted, k=2)
    # The path on (bonus 3), then the detours at positions 0 and 2 (2 is now the bonus's position).
    assert [(c.bonus_token_id, c.draft.committed_len) for c in offered] == [(3, 13), (7, 11), (8, 13)]
    assert list(offered[1].draft.token_ids) == [27, 21] and list(offered[1].draft.confidences) == [1, .5]
    assert offered[1].draft.score == 1.5
    # The verifier runs an offered draft: detours leaving it where the drafted path does still apply.
    running = common_pb2.Draft(token_ids=[1, 2, 8], committed_len=10)
    assert [c.bonus_token_id for c in continuations_after(running, drafted, k=2)] == [7]
    assert len(continuations_after(drafted, common_pb2.Draft(
        token_ids=[1], detours=[detour(0, 100 + i) for i in range(12)]), k=2)) == 8  # one NextRound's worth
