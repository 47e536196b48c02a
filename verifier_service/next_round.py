"""Next-round drafts: the client's drafts for the step after the one in flight,
one per likely outcome. When a step ends in one of them (its draft accepted up
to a given token, then the expected bonus or correction token), the verifier
starts that continuation at once instead of waiting a round trip for the
client's next Verify. A client may also let it draft by prompt lookup where
no offer matches (NextRound.lookup_tokens), or run the next step without a
draft (NextRound.run_ahead): plain decoding then never waits for the client."""

from dataclasses import dataclass

from verifier_service.errors import InvalidRequest
from verifier_service.prompt_lookup import lookup_draft
from verifier_service.sequence import Draft, FinishReason, StepResult


@dataclass(frozen=True)
class Continuation:
    bonus_token_id: int
    draft: Draft  # committed_len: the sequence length after the bonus token


@dataclass(frozen=True)
class NextStep:
    draft: Draft
    looked_up: bool  # drafted by prompt lookup, no continuation matching


class NextRound:
    """The latest continuations offered for one step, named by the sequence
    length it starts from. One slot: a client offers one NextRound per step,
    after it has seen the step before, so a newer offer makes an older useless."""

    def __init__(self):
        self._step_committed_len = -1
        self._continuations: tuple[Continuation, ...] = ()
        self._lookup_tokens = 0
        self._run_ahead = False

    def offer(self, step_committed_len: int, continuations: tuple[Continuation, ...], lookup_tokens: int = 0,
              run_ahead: bool = False) -> None:
        if any(c.draft.committed_len == 0 for c in continuations):
            raise InvalidRequest("a continuation's draft needs its committed_len")
        self._step_committed_len, self._continuations = step_committed_len, continuations
        self._lookup_tokens, self._run_ahead = lookup_tokens, run_ahead

    def take(self, step_committed_len: int, result: StepResult, tokens: list[int]) -> NextStep | None:
        """The step to run next, after the step that started at `step_committed_len`
        gave `result` and left the sequence at `tokens`: the matching continuation,
        else a prompt lookup where the offer allows one, else no draft where it
        runs ahead; None: wait for a Verify.
        An offer for this step is used up either way."""
        offered, self._continuations = self._continuations, ()
        if self._step_committed_len != step_committed_len or result.finish_reason is not FinishReason.NONE:
            return None
        # The length says how much of the step's draft was accepted, the last token
        # which token the target committed after it.
        for continuation in offered:
            if (continuation.draft.committed_len == result.committed_len
                    and continuation.bonus_token_id == result.token_ids[-1]):
                return NextStep(continuation.draft, looked_up=False)
        if self._lookup_tokens:
            draft = Draft(tuple(lookup_draft(tokens, self._lookup_tokens)), committed_len=result.committed_len)
            return NextStep(draft, looked_up=True)
        if self._run_ahead:
            return NextStep(Draft(committed_len=result.committed_len), looked_up=False)
        return None
