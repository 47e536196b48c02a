"""OpenAI's predicted outputs as a draft source: the client sends the text it
expects back (typically a file it asks us to edit), and each step drafts the
prediction's continuation from where the output is in it.

The output follows the prediction token by token while they agree. After an
edit they part; the output usually rejoins the prediction a little later, and
the last few output tokens, found again in the prediction, say where.
"""

from collections import defaultdict
from collections.abc import Sequence

# Shortest run of output tokens that re-aligns the output with the prediction:
# shorter runs ("the output", a newline and an indent) recur in any text and
# re-align at random, and each wrong re-alignment wastes a step's draft.
MIN_REALIGN_TOKENS = 4
MAX_REALIGN_TOKENS = 16


class PredictionDrafter:
    def __init__(self, prediction: Sequence[int]):
        self.prediction = tuple(prediction)
        self.output: list[int] = []
        self.position: int | None = 0  # next prediction token the output should match; None: lost
        # Where each run of MIN_REALIGN_TOKENS tokens ends in the prediction, in order.
        self._run_ends: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for end in range(MIN_REALIGN_TOKENS, len(self.prediction) + 1):
            self._run_ends[self.prediction[end - MIN_REALIGN_TOKENS: end]].append(end)

    def advance(self, committed: Sequence[int]) -> None:
        """Takes a step's committed tokens."""
        for token in committed:
            self.output.append(token)
            at = self.position
            self.position = at + 1 if at is not None and at < len(self.prediction) and \
                self.prediction[at] == token else None
        if self.position is None:
            self.position = self._realign()

    def draft(self, max_tokens: int) -> list[int]:
        if self.position is None:
            return []
        return list(self.prediction[self.position: self.position + max_tokens])

    def _realign(self) -> int | None:
        """Where the prediction continues the output's longest tail (up to
        MAX_REALIGN_TOKENS) found in it; the first such place on a tie."""
        best, best_length = None, 0
        for end in self._run_ends.get(tuple(self.output[-MIN_REALIGN_TOKENS:]), ()):
            length = MIN_REALIGN_TOKENS
            while (length < MAX_REALIGN_TOKENS and length < end and length < len(self.output)
                   and self.prediction[end - length - 1] == self.output[-length - 1]):
                length += 1
            if length > best_length and end < len(self.prediction):
                best, best_length = end, length
        return best
