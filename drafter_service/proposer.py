"""One sequence's drafting session, without gRPC: its proposer settings, the
length committed so far, and drafting by suffix decoding or n-gram lookup on
the compiled engine."""

from collections.abc import Sequence

from drafter_service.engine import CoreDraft, DraftEngine, StepBudget
from speclane.speculation import SpeculationSettings


class CommittedLengthMismatch(ValueError):
    """The client's idea of the sequence length differs from the drafter's."""


class SequenceProposer:
    """Drafting state of one sequence on the engine (drafter_service.engine.DraftEngine)."""

    def __init__(self, engine, settings: SpeculationSettings, tenant: str = "", lookahead: int = 0):
        self._engine = engine
        self.settings = settings
        self.tenant = tenant
        self.lookahead = lookahead  # draft tokens past each step's, for the client's next-round offers
        self.committed_len = 0  # prompt + committed output
        self.seq_id: int | None = None
        self.uncommitted: list[int] = []  # committed here, not yet handed to the engine (propose)

    def start(self, prompt_token_ids: Sequence[int]) -> None:
        self.seq_id = self._engine.start(prompt_token_ids, self.settings, self.tenant, self.lookahead)
        self.committed_len = len(prompt_token_ids)

    def commit(self, token_ids: Sequence[int], committed_len: int) -> None:
        """Appends committed tokens; `committed_len` is the length the caller expects afterwards."""
        if self.committed_len + len(token_ids) != committed_len:
            raise CommittedLengthMismatch(
                f"committed_len {committed_len} != {self.committed_len} known + {len(token_ids)} committed")
        self.committed_len = committed_len
        self.uncommitted.extend(token_ids)

    def end(self) -> None:
        """Ends the sequence: its own tree goes, its output stays in the global tree."""
        if self.seq_id is not None:
            self._engine.end(self.seq_id)
            self.seq_id = None


def propose(engine: DraftEngine, steps: Sequence[tuple[SequenceProposer, StepBudget]]) -> list[CoreDraft]:
    """A draft for each proposer from its prompt and everything committed (suffix decoding or n-gram
    lookup, per its settings; a suffix draft under its step's budget where that overrides the
    session's), all in one call to the core."""
    seq_ids, token_ids, budgets = [], [], []
    for proposer, budget in steps:
        seq_ids.append(proposer.seq_id)
        token_ids.append(proposer.uncommitted)
        proposer.uncommitted = []
        budgets.append(budget)
    return engine.step(seq_ids, token_ids, budgets)
