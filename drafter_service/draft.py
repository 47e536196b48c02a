"""A proposed continuation of one sequence, as the drafters return it."""

from dataclasses import dataclass

from protos.conventions import MAX_NEXT_ROUND_CONTINUATIONS

# Which structure a draft came from (`Draft.source`).
SOURCE_REQUEST = "suffix-request"  # the sequence's own suffix tree (prompt + output)
SOURCE_GLOBAL = "suffix-global"  # the tree over earlier responses
SOURCE_NGRAM = "ngram"  # prompt lookup


@dataclass(frozen=True)
class Detour:
    """Where a draft goes under another outcome of its step: `position` of the
    step's tokens accepted, then the target's `token` (a correction where
    position < the step's length, else another bonus token than the
    continuation's), then `token_ids`. Its `probs` start afresh: they are
    conditional on that outcome."""

    position: int
    token: int
    token_ids: tuple[int, ...]
    probs: tuple[float, ...]


# Detours a draft offers at most: with the step's own continuation they fill one verifier NextRound.
MAX_DETOURS = MAX_NEXT_ROUND_CONTINUATIONS - 1


@dataclass(frozen=True)
class Draft:
    """Draft tokens, possibly a tree.

    `parents[i]` is the index in `token_ids` of token i's parent, -1 for a child
    of the last committed token. `probs` are the drafter's per-token path
    probabilities (empty when it makes no estimate, as n-gram lookup), `score`
    the expected number of accepted tokens (of the step's draft), `match_len`
    how many context tokens the drafter matched to produce it.
    """

    token_ids: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    probs: tuple[float, ...] = ()
    score: float = 0.0
    match_len: int = 0
    source: str = ""
    step_len: int = 0  # tokens of this step's draft where it goes on past them (lookahead); 0: all
    detours: tuple[Detour, ...] = ()  # the likeliest other outcomes' drafts (lookahead), likeliest first

    def __post_init__(self):
        if len(self.parents) != len(self.token_ids):
            raise ValueError("a draft needs one parent per token")
        if self.probs and len(self.probs) != len(self.token_ids):
            raise ValueError("a draft needs one probability per token, or none")

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def is_chain(self) -> bool:
        return all(parent == index - 1 for index, parent in enumerate(self.parents))

