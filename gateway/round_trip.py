"""When a verifier should draft a step itself rather than wait for the gateway.

A step whose next-round offers all missed waits for the gateway's round trip:
the answer's way back, the drafter's draft, the Verify's way out. With
NextRound.lookup_tokens the verifier instead drafts that step by prompt lookup
over the sequence's own tokens and starts it at once. That draft is often the
one the drafter's per-request tree would propose, but it lacks the global tree,
other requests' answers: on agent loops it commits about a tenth fewer tokens a
step. So a lookup pays where the wait it saves is worth more than the tokens it
loses, and "auto" weighs the two as measured: the wait on steps that waited, the
tokens on steps that looked up, where the gateway still gets the drafter's draft
for the same step and sees how much of it the target wrote."""

from dataclasses import dataclass

from speclane.tokens import common_prefix

# Below this share of a forward pass the round trip is not worth a lookup whatever it loses.
MIN_WAIT_SHARE = 0.02
# While lookups do not pay, one step in this many still looks up, so their loss is measured again.
EXPLORE_EVERY = 16


@dataclass
class RoundTrip:
    """One verifier's running means, by the steps that measure each."""

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

    def lookup_pays(self) -> bool:
        if not self.forward_seconds or self.wait_seconds < MIN_WAIT_SHARE * self.forward_seconds:
            return False
        token_seconds = (self.forward_seconds + self.wait_seconds) / self.tokens_per_step
        return self.wait_seconds >= self.lost_tokens * token_seconds or self.steps_since_lookup >= EXPLORE_EVERY


def looks_up(mode: str, round_trip: RoundTrip) -> bool:
    """Whether a verifier drafts missed steps itself, under --speculative-config's next_round_lookup."""
    return mode == "on" or (mode == "auto" and round_trip.lookup_pays())


def lookup_loss(drafter_draft: list[int], looked_up_accepted: int, committed: list[int]) -> int:
    """How many more tokens the drafter's draft for a looked-up step would have had accepted: the
    committed tokens it foresaw (all of them at most, so a loss is never overstated) minus the lookup's."""
    return common_prefix(drafter_draft, committed) - looked_up_accepted
