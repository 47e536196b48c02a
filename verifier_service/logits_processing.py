"""The requests' logit controls applied to the target's raw logits rows, with
vLLM's semantics and order: logit_bias, min_tokens, then the repetition,
frequency and presence penalties. Temperature, min_p, top-k and top-p follow in
sampling.batch_target_probs; greedy decoding takes the argmax of what this
returns, as vLLM's does.

Every row of a step judges a different position (verify.py): row 0 follows
the committed tokens, row i + 1 follows draft node i. Each row is processed
with the output as it would be at its position, the committed output plus
the draft tokens on the path from the root to that node, so a draft token is
judged against exactly the distribution plain decoding would sample it from.

The controlled steps of a pass are processed together: each control is a
few operations over all their rows, with the rows' own values and indices
sent to the device in one copy each, whatever the number of sequences. The
penalties are penalties.py's.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from verifier_service.penalties import SeenTokenCounts, SeenTokens, TokenCounts, index_pairs
from verifier_service.sampling import SamplingParams
from verifier_service.tree import depths


class LogitsProcessor:
    """One sequence's controls; once it is penalised, its token counts are in the engine's `table`: a row of it
    (TokenCounts), or its own SeenTokens (SeenTokenCounts)."""

    def __init__(self, params: SamplingParams, prompt_len: int, stop_token_ids: frozenset[int],
                 table: TokenCounts | SeenTokenCounts):
        self.params = params
        self.prompt_len = prompt_len
        self.bias = tuple(params.logit_bias.items())
        self.stop_ids = tuple(sorted(stop_token_ids))
        self.penalised = bool(params.repetition_penalty != 1 or params.frequency_penalty or params.presence_penalty)
        self.table = table
        self.row: int | None = None  # TokenCounts: its row, taken by its first pass
        self.num_counted = 0  # TokenCounts: its committed tokens before this index are in its row
        self.seen: SeenTokens | None = None  # SeenTokenCounts: its tokens, from its first pass


def make_logits_processor(params: SamplingParams, prompt_len: int, stop_token_ids: frozenset[int],
                          table: TokenCounts | SeenTokenCounts) -> LogitsProcessor | None:
    """None when the request sets none of these controls: its steps then do no per-row work."""
    if not (params.logit_bias or params.min_tokens or params.repetition_penalty != 1
            or params.frequency_penalty or params.presence_penalty):
        return None
    return LogitsProcessor(params, prompt_len, stop_token_ids, table)


@dataclass(frozen=True)
class ControlledStep:
    """A step's rows logits[first_row: first_row + len(draft_tokens) + 1], over the committed `tokens` (prompt
    and output) and a draft tree (`parents`, see tree.py)."""

    first_row: int
    processor: LogitsProcessor
    tokens: Sequence[int]
    draft_tokens: Sequence[int]
    parents: Sequence[int]

    @property
    def rows(self) -> range:
        return range(self.first_row, self.first_row + len(self.draft_tokens) + 1)

    def row_depths(self) -> list[int]:
        """Each row's position below the last committed token."""
        return [0, *depths(self.parents)]


def apply_logit_controls(logits: torch.Tensor, steps: Sequence[ControlledStep]) -> torch.Tensor:
    """Applies the steps' controls to their rows of the fp32 `logits` [rows, vocab], in place; returns it."""
    biased, bias, short = [], [], []
    for step in steps:
        processor = step.processor
        biased += [(row, token) for row in step.rows for token, _ in processor.bias]
        bias += [value for _ in step.rows for _, value in processor.bias]
        generated = len(step.tokens) - processor.prompt_len
        if generated < processor.params.min_tokens:
            short += [(row, token) for row, depth in zip(step.rows, step.row_depths())
                      if generated + depth < processor.params.min_tokens for token in processor.stop_ids]
    device = logits.device
    if biased:  # a step's tokens are distinct (a map's keys), so accumulating is adding
        logits.index_put_(index_pairs(biased, device), torch.tensor(bias, device=device), accumulate=True)
    if short:
        logits[index_pairs(short, device)] = float("-inf")
    penalised = [step for step in steps if step.processor.penalised]
    if penalised:
        penalised[0].processor.table.penalise(logits, penalised)
    return logits
