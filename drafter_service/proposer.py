"""One sequence's drafting session, without gRPC: its proposer settings, the
length committed so far, and drafting by suffix decoding or n-gram lookup on
the compiled engine."""

from collections.abc import Sequence

from drafter_service.draft import Draft
from drafter_service.engine import SESSION_BUDGET, StepBudget
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
        self._seq_id: int | None = None
        self._uncommitted: list[int] = []  # committed here, not yet handed to the engine

    def start(self, prompt_token_ids: Sequence[int]) -> None:
        self._seq_id = self._engine.start(prompt_token_ids, self.settings, self.tenant, self.lookahead)
        self.committed_len = len(prompt_token_ids)

    def commit(self, token_ids: Sequence[int], committed_len: int) -> None:
        """Appends committed tokens; `committed_len` is the length the caller expects afterwards."""
        if self.committed_len + len(token_ids) != committed_len:
            raise CommittedLengthMismatch(
                f"committed_len {committed_len} != {self.committed_len} known + {len(token_ids)} committed")
        self.committed_len = committed_len
        self._uncommitted.extend(token_ids)

    async def propose(self, budget: StepBudget = SESSION_BUDGET) -> Draft:
        """Draft from prompt + everything committed (suffix decoding or n-gram lookup, per settings;
        a suffix draft under this step's budget where it overrides the session's)."""
        token_ids, self._uncommitted = self._uncommitted, []
        return await self._engine.step(self._seq_id, token_ids, budget)

    def end(self) -> None:
        """Ends the sequence: its own tree goes, its output stays in the global tree."""
        if self._seq_id is not None:
            self._engine.end(self._seq_id)
            self._seq_id = None
