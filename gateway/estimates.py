"""What the step planner (gateway/planner.py) knows about drafts, learnt from
verify outcomes: how likely each draft position is to be accepted, what a
step verifying the head's draft is worth, and what a verifier's round trip
costs against what its own lookups lose. One place for every estimate, so the
planner's choices share one cost model: a plain step costs 1, a draft token
the verifier's measured cost at its current batch size (token_cost_at).

Drafts are judged by position only, also where the drafter reports
confidences (suffix decoding's path probabilities): replayed on the target's
recorded replies at a 32-sequence cost (`speclane bench policy`), judging
suffix drafts by confidence buckets kept their long tails, whose every token
sat in the same bucket, and ran 2-9% slower on the four bench data sets than
judging them by position; at one sequence's cost the two tie."""

from dataclasses import dataclass, field

from speclane.speculation import draft_value
from speclane.tokens import common_prefix

# Prior weight, in steps, of the method-wide estimate in a request's own.
REQUEST_PRIOR_STEPS = 2.0
# Prior weight, in scored tokens, of an estimate of the drafter's scores: the method-wide
# one in a request's own, and "as scored" in the method-wide one.
SCORE_PRIOR_TOKENS = 4.0
# How much one head step moves a request's estimate of the head's worth (a few steps
# follow a change of topic, one lucky step does not decide the rest) and the server's.
REQUEST_HEAD_WEIGHT = 0.25
SERVER_HEAD_WEIGHT = 0.02
# Below this share of a forward pass the round trip is not worth a lookup whatever it loses.
MIN_WAIT_SHARE = 0.02


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
class ScoreCounts:
    """The drafter's own estimates of its verified drafts' accepted tokens (Draft.score:
    suffix decoding's path probabilities, summed), and what those drafts accepted."""

    scored: float = 0.0
    accepted: int = 0

    def observe(self, score: float, num_accepted: int) -> None:
        self.scored += score
        self.accepted += num_accepted

    def scale(self, prior: float) -> float:
        """accepted / scored, with `prior` weighing as SCORE_PRIOR_TOKENS scored tokens."""
        return (self.accepted + prior * SCORE_PRIOR_TOKENS) / (self.scored + SCORE_PRIOR_TOKENS)


class MethodAcceptance:
    """What a method's drafts have done across all requests: the prior of each new request.
    A position no request has reached yet counts as sure, so that drafts keep exploring it."""

    def __init__(self):
        self.counts = PositionCounts()
        self.scores = ScoreCounts()

    def rate(self, position: int) -> float:
        return self.counts.rate(position, prior=1.0, prior_steps=1.0)


class RequestAcceptance:
    """One request's chance of acceptance by draft position, and how the drafter's
    scores compare with what its drafts accept, learnt from its verify steps,
    started from what its method has seen on all requests."""

    def __init__(self, method: MethodAcceptance):
        self._method = method
        self._counts = PositionCounts()
        self._scores = ScoreCounts()

    def observe(self, num_draft_tokens: int, num_accepted: int, score: float = 0.0) -> None:
        """A verified draft; `score`: the drafter's estimate of its accepted tokens (0: none made)."""
        self._counts.observe(num_draft_tokens, num_accepted)
        self._method.counts.observe(num_draft_tokens, num_accepted)
        if score > 0:
            self._scores.observe(score, num_accepted)
            self._method.scores.observe(score, num_accepted)

    def score_scale(self) -> float:
        """What the drafter's drafts accept per token of their score (1: as scored).
        Suffix decoding's path probabilities are counts over past text: on chats, where
        continuations vary, they promise more than the target accepts."""
        return self._scores.scale(self._method.scores.scale(1.0))

    def rates(self, limit: int) -> tuple[float, ...]:
        """Positions 0..limit-1: each one's chance of acceptance once reached."""
        return tuple(self._counts.rate(position, self._method.rate(position), REQUEST_PRIOR_STEPS)
                     for position in range(limit))


def head_step_worth(result, token_cost: float) -> float:
    """What a step that verified the head's draft committed per unit of step
    time (a verifier's SessionResponse): its verification, plus the head's
    drafting in plain steps, read off the pass (its time over its cost). The
    head's draft is a tenth to a quarter of a step on a CPU, so leaving it out
    would send steps to the head that a drafter draft does better; the
    drafter's answer, a millisecond, is small enough to leave out."""
    verify_cost = 1.0 + token_cost * result.num_draft_tokens
    drafting = result.head_draft_seconds / result.forward_seconds * verify_cost if result.forward_seconds > 0 else 0.0
    return draft_value(result.num_accepted_draft_tokens, result.num_draft_tokens, token_cost, drafting)


@dataclass
class HeadWorth:
    """What a step verifying the head's draft commits per unit of step time
    (head_step_worth), as a running average. It starts at a plain step's worth,
    1: until the head has shown what it is worth, a drafter draft that pays
    for its own verification is taken."""

    weight: float
    worth: float = 1.0

    def observe(self, worth: float) -> None:
        self.worth += self.weight * (worth - self.worth)


@dataclass
class RoundTrip:
    """One verifier's running means, by the steps that measure each: what a
    step that waited for the gateway's round trip waited (the answer's way
    back, the drafter's draft, the Verify's way out), and what the verifier's
    own lookups lost against the drafter's drafts for the same steps."""

    weight: float = 0.05
    wait_seconds: float = 0.0  # beyond the verifier's own time (network both ways, drafter), when it waited
    forward_seconds: float = 0.0
    tokens_per_step: float = 1.0
    lost_tokens: float = 0.0  # per looked-up step: the drafter's draft's accepted tokens minus the lookup's
    steps_since_lookup: int = 0

    def observe_wait(self, wait_seconds: float, forward_seconds: float) -> None:
        if not self.forward_seconds:  # the first step sets the means
            self.wait_seconds, self.forward_seconds = wait_seconds, forward_seconds
            return
        self.wait_seconds += self.weight * (wait_seconds - self.wait_seconds)
        self.forward_seconds += self.weight * (forward_seconds - self.forward_seconds)

    def observe_step(self, tokens: int, looked_up_loss: float | None) -> None:
        """A step's committed tokens, and with a lookup what it lost against the drafter's draft."""
        self.tokens_per_step += self.weight * (tokens - self.tokens_per_step)
        if looked_up_loss is None:
            self.steps_since_lookup += 1
            return
        self.steps_since_lookup = 0
        self.lost_tokens += self.weight * (looked_up_loss - self.lost_tokens)

    def lookup_pays(self, explore_every: int) -> bool:
        """Whether the wait a lookup saves outweighs the tokens lookups lose; while they do not,
        one step in `explore_every` still looks up, so their loss is measured again."""
        if not self.forward_seconds or self.wait_seconds < MIN_WAIT_SHARE * self.forward_seconds:
            return False
        token_seconds = (self.forward_seconds + self.wait_seconds) / self.tokens_per_step
        return self.wait_seconds >= self.lost_tokens * token_seconds or self.steps_since_lookup >= explore_every


def lookup_loss(drafter_draft: list[int], looked_up_accepted: int, committed: list[int]) -> int:
    """How many more tokens the drafter's draft for a looked-up step would have had accepted: the
    committed tokens it foresaw (all of them at most, so a loss is never overstated) minus the lookup's."""
    return common_prefix(drafter_draft, committed) - looked_up_accepted
