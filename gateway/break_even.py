"""Where a drafter's draft stops paying: a draft token is worth verifying while
its chance of being accepted beats what its compute would commit as plain
decoding at the verifier's current load. On a CPU verifier a busy batch is
compute-bound, so at 32 sequences a chat draft whose tokens land one time in
four costs more than it commits, while a code edit's long copies still pay;
one fixed k, or a k by batch size alone, cannot tell the two apart.

The chance comes from the request's own history of verify outcomes, started
from what all requests with the same method have seen. A draft that carries
the drafter's confidences (suffix decoding's path probabilities) is judged
token by token by its confidence: measured on the bench's chat, code and
edits alike, a token the tree gives under 0.4 lands about one time in eight,
while how often the common 0.5 tokens land depends on the request (a third
in chat, three quarters in a code edit), and barely on the position. A draft
without confidences (n-gram lookup) is judged by position."""

from dataclasses import dataclass, field

# Drafter confidences are counted in buckets this wide.
CONFIDENCE_BUCKET = 0.1
_NUM_BUCKETS = round(1 / CONFIDENCE_BUCKET)
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


@dataclass
class ConfidenceCounts:
    """Per bucket of the drafter's confidence in a draft token: tokens verified,
    and those accepted together with every token before them (what a path
    probability estimates)."""

    verified: list[int] = field(default_factory=lambda: [0] * _NUM_BUCKETS)
    accepted: list[int] = field(default_factory=lambda: [0] * _NUM_BUCKETS)

    def observe(self, confidences, num_draft_tokens: int, num_accepted: int) -> None:
        for position, confidence in enumerate(confidences[:num_draft_tokens]):
            bucket = _bucket(confidence)
            self.verified[bucket] += 1
            self.accepted[bucket] += position < num_accepted

    def rate(self, confidence: float, prior: float, prior_steps: float) -> float:
        bucket = _bucket(confidence)
        return (self.accepted[bucket] + prior * prior_steps) / (self.verified[bucket] + prior_steps)


def _bucket(confidence: float) -> int:
    return min(_NUM_BUCKETS - 1, max(0, int(confidence / CONFIDENCE_BUCKET)))


class MethodAcceptance:
    """What a method's drafts have done across all requests: the prior of each new request.
    A position no request has reached yet counts as sure, so that drafts keep exploring it;
    a confidence bucket nothing has landed in yet counts as what the drafter says."""

    def __init__(self):
        self.counts = PositionCounts()
        self.confidences = ConfidenceCounts()
        self.scored = False  # its drafts carry confidences: judged once drafted, not before

    def rate(self, position: int) -> float:
        return self.counts.rate(position, prior=1.0, prior_steps=1.0)

    def confidence_rate(self, confidence: float) -> float:
        return self.confidences.rate(confidence, prior=confidence, prior_steps=1.0)


class RequestAcceptance:
    """One request's chance of acceptance by draft position and by the drafter's
    confidence, learned from its verify steps."""

    def __init__(self, method: MethodAcceptance):
        self._method = method
        self._counts = PositionCounts()
        self._confidences = ConfidenceCounts()
        self._cut_steps = 0  # steps in a row whose whole draft was cut

    def observe(self, num_draft_tokens: int, num_accepted: int, confidences=()) -> None:
        """A verify step's outcome; `confidences`: the drafter's, of the draft verified."""
        self._counts.observe(num_draft_tokens, num_accepted)
        self._method.counts.observe(num_draft_tokens, num_accepted)
        if confidences:
            self._method.scored = True
            self._confidences.observe(confidences, num_draft_tokens, num_accepted)
            self._method.confidences.observe(confidences, num_draft_tokens, num_accepted)

    def length_before_drafting(self, threshold: float, limit: int) -> int:
        """How long a draft can pay, before the drafter is asked: judged by position,
        or `limit` for a request whose drafts are judged by their confidences."""
        return limit if self._method.scored else self.worthwhile_length(threshold, limit)

    def worthwhile_length(self, threshold: float, limit: int, confidences=()) -> int:
        """The longest draft, `limit` at most, whose last token is still accepted
        with probability at least `threshold` (every token before it accepted too):
        by the drafter's `confidences` (one per token up to `limit`) where the draft
        has them, else by position."""
        chance, length = 1.0, limit
        for position in range(limit):
            if confidences:
                confidence = confidences[position]
                chance = min(chance, self._confidences.rate(
                    confidence, self._method.confidence_rate(confidence), REQUEST_PRIOR_STEPS))
            else:
                chance *= self._counts.rate(position, self._method.rate(position), REQUEST_PRIOR_STEPS)
            if chance < threshold:
                length = position
                break
        self._cut_steps = self._cut_steps + 1 if length == 0 and limit > 0 else 0
        if self._cut_steps == EXPLORE_EVERY:
            self._cut_steps = 0
            return 1
        return length
