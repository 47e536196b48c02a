"""Where a drafter's draft stops paying: a draft token is worth verifying while
its chance of being accepted beats what its compute would commit as plain
decoding at the verifier's current load. On a CPU verifier a busy batch is
compute-bound, so at 32 sequences a chat draft whose tokens land one time in
three costs more than it commits, while a code edit's long copies still pay;
one fixed k, or a k by batch size alone, cannot tell the two apart.

The chance comes from the request's own history of verify outcomes by draft
position, started from what all requests with the same method have seen."""

from dataclasses import dataclass, field

# Prior weight, in steps, of the method-wide estimate in a request's own.
REQUEST_PRIOR_STEPS = 4.0


def break_even(token_cost: float, num_running: int) -> float:
    """The acceptance probability a draft token needs to pay for itself in a
    batch of `num_running` sequences. A verify pass costs (1 - c) + c * n in
    units of a one-token pass, for n tokens in the batch (c: the verifier's
    measured cost of one draft token; linear, as a compute-bound pass is).
    A token adds c to the pass and commits p on average; it pays when p / c
    beats the batch's rate of tokens per unit of time, which is at least
    plain decoding's B / ((1 - c) + c * B)."""
    running = max(1, num_running)
    return token_cost * running / ((1.0 - token_cost) + token_cost * running)


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

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self._counts.observe(num_draft_tokens, num_accepted)
        self._method.counts.observe(num_draft_tokens, num_accepted)

    def worthwhile_length(self, threshold: float, limit: int) -> int:
        """The longest draft, `limit` at most, whose last token is still accepted
        with probability at least `threshold` (every token before it accepted too)."""
        chance = 1.0
        for position in range(limit):
            chance *= self._counts.rate(position, self._method.rate(position), REQUEST_PRIOR_STEPS)
            if chance < threshold:
                return position
        return limit
