"""Next-round offers, as the step planner makes them (gateway/planner.py): the drafts
after a step for its likely outcomes, read from a drafter's draft that goes on
past the step, and which one the verifier took."""

from protos.common.v1 import common_pb2
from protos.conventions import MAX_NEXT_ROUND_CONTINUATIONS
from protos.verifier.v1 import verifier_pb2


def step_part(draft: common_pb2.Draft) -> common_pb2.Draft:
    """The step's own draft, of one that goes on past it (Draft.step_len: next-round drafts)."""
    return cut(draft, 0, draft.step_len) if draft.step_len else draft


def cut(draft: common_pb2.Draft, start: int, stop: int) -> common_pb2.Draft:
    """Tokens start..stop of a draft: anywhere in a chain (the drafter drafts past
    the step when next-round drafts are on), from the start of a tree (its nodes
    come parents first, so its first nodes are a tree too)."""
    if start == 0 and len(draft.token_ids) <= stop:
        return draft
    confidences = draft.confidences[start:stop]
    return common_pb2.Draft(token_ids=draft.token_ids[start:stop], parents=draft.parents[start:stop],
                            confidences=confidences, score=sum(confidences),
                            committed_len=draft.committed_len + start, source=draft.source)


def continuations_after(step: common_pb2.Draft, drafted: common_pb2.Draft, k: int) -> list[verifier_pb2.Continuation]:
    """The drafts of up to k tokens after `step` for its likely outcomes, read
    from `drafted` (drafted from the same committed tokens, further ahead):
    "all of it accepted, then the drafter's next token" where `drafted` goes on
    past `step`, then each detour that leaves `step` where `drafted` does.
    Nothing for trees."""
    if drafted.parents:
        return []
    n, tokens = len(step.token_ids), list(step.token_ids)
    offered = []
    if len(drafted.token_ids) > n + 1 and drafted.token_ids[:n] == tokens:
        offered.append(verifier_pb2.Continuation(bonus_token_id=drafted.token_ids[n],
                                                 draft=cut(drafted, n + 1, n + 1 + k)))
    for detour in drafted.detours:
        j = detour.position
        if j <= n and drafted.token_ids[:j] == tokens[:j] and (j == n or tokens[j] != detour.token_id):
            confidences = detour.confidences[:k]
            draft = common_pb2.Draft(token_ids=detour.token_ids[:k], confidences=confidences, score=sum(confidences),
                                     committed_len=drafted.committed_len + j + 1, source=drafted.source)
            offered.append(verifier_pb2.Continuation(bonus_token_id=detour.token_id, draft=draft))
    return offered[:MAX_NEXT_ROUND_CONTINUATIONS]


def offered_draft(offered: list[verifier_pb2.Continuation], committed_len: int,
                  last_token: int) -> common_pb2.Draft | None:
    """The offered draft for the step's outcome (the sequence length and last
    token after it), as the verifier picks it; None when none was offered."""
    return next((c.draft for c in offered if c.draft.committed_len == committed_len
                 and c.bonus_token_id == last_token), None)


def offer_outcome(result) -> str:
    """How a step offered a next round ended, for the metric: the verifier went on with an offer (or, running
    ahead, without a draft), with its own lookup (NextRound.lookup_tokens), or waited for a Verify."""
    if not result.next_round_hit:
        return "missed"
    return "looked_up" if result.HasField("lookup_draft") else "taken"
