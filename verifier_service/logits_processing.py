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
penalties' token counts live in one device table (`TokenCounts`), a row per
sequence, as vLLM's and SGLang's persistent batches keep theirs.
"""

import collections
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from verifier_service.sampling import SamplingParams
from verifier_service.tree import ancestors, depths


class TokenCounts:
    """Each penalised sequence's output token counts and prompt tokens: a row of two tables on the logits'
    device. A row is a cache of its sequence's tokens, filled by the passes from the tokens it has not seen; it
    is taken and cleared by the pass (the model thread) and given back by the processor's finalizer, which may
    run on any thread and so only queues it."""

    def __init__(self, vocab_size: int, device: torch.device, capacity: int = 16):
        self.counts = torch.zeros(capacity, vocab_size, dtype=torch.float32, device=device)
        self.in_prompt = torch.zeros(capacity, vocab_size, dtype=torch.bool, device=device)
        self._free = collections.deque(range(capacity))

    @property
    def device(self) -> torch.device:
        return self.counts.device

    def take(self) -> int:
        """A free row, uncleared; the tables double when none is left."""
        if not self._free:
            capacity = len(self.counts)
            self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
            self.in_prompt = torch.cat([self.in_prompt, torch.zeros_like(self.in_prompt)])
            self._free.extend(range(capacity, 2 * capacity))
        return self._free.popleft()

    def give_back(self, row: int) -> None:
        self._free.append(row)

    def update(self, steps: Sequence["ControlledStep"]) -> None:
        """Brings the steps' rows up to their committed tokens, with one operation each for the rows taken now
        (cleared, then their prompts marked) and for the tokens committed since the last pass."""
        fresh, prompt_marks, counted = [], [], []
        for step in steps:
            processor, tokens = step.processor, step.tokens
            if processor.row is None:
                processor.row = self.take()
                weakref.finalize(processor, self.give_back, processor.row)
                fresh.append(processor.row)
                prompt_marks += [(processor.row, token) for token in tokens[:processor.prompt_len]]
                processor.num_counted = processor.prompt_len
            counted += [(processor.row, token) for token in tokens[processor.num_counted:]]
            processor.num_counted = len(tokens)
        if fresh:
            rows = torch.tensor(fresh, device=self.device)
            self.counts[rows] = 0.0
            self.in_prompt[rows] = False
        if prompt_marks:
            self.in_prompt[_index(prompt_marks, self.device)] = True
        if counted:
            at = _index(counted, self.device)
            self.counts.index_put_(at, torch.ones(len(counted), device=self.device), accumulate=True)


class LogitsProcessor:
    """One sequence's controls; its token counts are a row of the engine's TokenCounts, once it is penalised."""

    def __init__(self, params: SamplingParams, prompt_len: int, stop_token_ids: frozenset[int],
                 table: TokenCounts):
        self.params = params
        self.prompt_len = prompt_len
        self.bias = tuple(params.logit_bias.items())
        self.stop_ids = tuple(sorted(stop_token_ids))
        self.penalised = bool(params.repetition_penalty != 1 or params.frequency_penalty or params.presence_penalty)
        self.table = table
        self.row: int | None = None  # its row of `table`, taken by its first pass
        self.num_counted = 0  # its committed tokens before this index are in its row


def make_logits_processor(params: SamplingParams, prompt_len: int, stop_token_ids: frozenset[int],
                          table: TokenCounts) -> LogitsProcessor | None:
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
        logits.index_put_(_index(biased, device), torch.tensor(bias, device=device), accumulate=True)
    if short:
        logits[_index(short, device)] = float("-inf")
    penalised = [step for step in steps if step.processor.penalised]
    if penalised:
        _penalise(logits, penalised)
    return logits


def _penalise(logits: torch.Tensor, steps: Sequence[ControlledStep]) -> None:
    """The repetition, frequency and presence penalties of the steps' rows, each over all of them at once."""
    table = steps[0].processor.table
    table.update(steps)
    device = logits.device
    rows = [row for step in steps for row in step.rows]
    # Each logits row's row of the table, and the logits rows, in one copy. Whole rows are gathered with
    # index_select, which copies them, where a CPU's advanced indexing goes element by element.
    owners, at = torch.tensor([[step.processor.row for step in steps for _ in step.rows], rows], device=device)
    counts, seen = table.counts.index_select(0, owners), table.in_prompt.index_select(0, owners)
    drafted, first = [], 0  # (row among `rows`, token) for each draft token on the path to a row
    for step in steps:
        drafted += [(first + node + 1, step.draft_tokens[ancestor])
                    for node, path in enumerate(ancestors(step.parents)) for ancestor in path]
        first += len(step.rows)
    if drafted:
        counts.index_put_(_index(drafted, device), torch.ones(len(drafted), device=device), accumulate=True)
    params = [step.processor.params for step in steps for _ in step.rows]
    values = torch.tensor([[p.repetition_penalty, 1.0 if p.repetition_penalty >= 1 else -1.0, p.frequency_penalty,
                            p.presence_penalty] for p in params], dtype=torch.float32, device=device)
    repetition, sign, frequency, presence = values.T[:, :, None]
    contiguous = rows == list(range(rows[0], rows[-1] + 1))
    penalised = logits[rows[0]: rows[-1] + 1] if contiguous else logits.index_select(0, at)
    in_output = counts > 0
    if any(p.repetition_penalty != 1 for p in params):
        # x / r where x > 0, else x * r: for r >= 1 the smaller of the two, else the larger, the smaller of the
        # pair negated, negated back (exact). torch.where on the logits' signs costs a CPU a mispredicted branch
        # an element: 11 ms over 64 rows of 49,152, against 2 for these four operations.
        flipped = penalised * sign
        scaled = torch.minimum(flipped / repetition, flipped * repetition) * sign
        penalised = torch.where(in_output | seen, scaled, penalised)
    if any(p.frequency_penalty for p in params):
        penalised = penalised - frequency * counts
    if any(p.presence_penalty for p in params):
        penalised = penalised - presence * in_output
    if contiguous:
        logits[rows[0]: rows[-1] + 1] = penalised
    else:
        logits.index_copy_(0, at, penalised)


def _index(pairs: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, columns) of (row, column) pairs, sent to the device in one copy."""
    at = torch.tensor(pairs, dtype=torch.long).to(device)
    return at[:, 0], at[:, 1]
