"""Where a drafter's draft stops paying: a draft token is worth verifying while
its chance of being accepted beats what its compute would commit as plain
decoding at the verifier's current load. On a CPU verifier a busy batch is
compute-bound, so at 32 sequences a chat draft whose tokens land one time in
four costs more than it commits, while a code edit's long copies still pay;
one fixed k, or a k by batch size alone, cannot tell the two apart.

The chance of reaching and accepting each draft position comes from the
request's own history of verify outcomes, started from what all requests with
the same method have seen. Drafts are judged by position only, also where the
drafter reports confidences (suffix decoding's path probabilities): replayed on
the target's recorded replies at a 32-sequence cost (`speclane bench policy
--break-even`), judging suffix drafts by confidence buckets kept their long
tails, whose every token sat in the same bucket, and ran 2-9% slower on the
four bench data sets than judging them by position; at one sequence's cost the
two tie."""

from dataclasses import dataclass, field

# Prior weight, in steps, of the method-wide estimate in a request's own.
REQUEST_PRIOR_STEPS = 2.0
# A request whose drafts are all cut still verifies one draft token every this many
# steps: without outcomes its estimate could never recover (a chat turn that starts
# quoting code, or a method-wide prior learnt on other traffic).
EXPLORE_EVERY = 4


@dataclass
class PositionCounts:
    """Per draft position: verify steps that reached it (every token before it
    accepted) and those that accepted it."""

    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        reached = min(num_draft_tokens, num_accepted + 1)
        if reached > len(self.reached):
            grow = reached - len(self.reached)
            self.reached += [0] * grow
            self.accepted += [0] * grow
        for position in range(reached):
            self.reached[position] += 1
            self.accepted[position] += position < num_accepted

    def rate(self, position: int, prior: float, prior_steps: float) -> float:
        """The chance position `position` is accepted once reached: the counts, with
        `prior` weighing as `prior_steps` observations."""
        seen = position < len(self.reached)
        reached, accepted = (self.reached[position], self.accepted[position]) if seen else (0, 0)
        return (accepted + prior * prior_steps) / (reached + prior_steps)


class MethodAcceptance:
    """What a method's drafts have done across all requests: the prior of each new request.
    A position no request has reached yet counts as sure, so that drafts keep exploring it."""

    def __init__(self):
        self.counts = PositionCounts()

    def rate(self, position: int) -> float:
        return self.counts.rate(position, prior=1.0, prior_steps=1.0)


class RequestAcceptance:
    """One request's chance of acceptance by draft position, learned from its verify steps."""

    def __init__(self, method: MethodAcceptance):
        self._method = method
        self._counts = PositionCounts()
        self._cut_steps = 0  # steps in a row whose whole draft was cut

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """A verify step's outcome."""
        self._counts.observe(num_draft_tokens, num_accepted)
        self._method.counts.observe(num_draft_tokens, num_accepted)

    def worthwhile_length(self, threshold: float, limit: int) -> int:
        """The longest draft, `limit` at most, whose last token is still accepted
        with probability at least `threshold` (every token before it accepted too)."""
        chance, length = 1.0, limit
        for position in range(limit):
            chance *= self._counts.rate(position, self._method.rate(position), REQUEST_PRIOR_STEPS)
            if chance < threshold:
                length = position
                break
        self._cut_steps = self._cut_steps + 1 if length == 0 and limit > 0 else 0
        if self._cut_steps == EXPLORE_EVERY:
            self._cut_steps = 0
            return 1
        return length
