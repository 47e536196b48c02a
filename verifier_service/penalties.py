"""The repetition, frequency and presence penalties with vLLM's meanings, over
all the penalised rows of a pass at once, each row with the output as it would
be at its position (the committed output plus the draft tokens on the path to
its node).

Two forms, picked by the logits' device (`penalty_counts`):
- on an accelerator, `TokenCounts`: a dense row of counts per sequence on the
  device, as vLLM's and SGLang's persistent batches keep theirs, so a pass
  sends the device only the tokens committed since the last one and its
  operations are a few launches over [rows, vocab];
- on a CPU, `SeenTokenCounts`: each sequence's distinct prompt and output
  tokens in host arrays, so a pass reads and writes only those logits: a few
  hundred of a row's 49,152 to 151,936, where the dense form reads the whole
  row several times (16 of a 64-sequence decode pass's 17 ms on SmolLM2).
Both give the same values (tests/verifier/test_logits_processing.py).
"""

import collections
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from verifier_service.tree import ancestors

if TYPE_CHECKING:
    from verifier_service.logits_processing import ControlledStep


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
            self.in_prompt[index_pairs(prompt_marks, self.device)] = True
        if counted:
            at = index_pairs(counted, self.device)
            self.counts.index_put_(at, torch.ones(len(counted), device=self.device), accumulate=True)

    def penalise(self, logits: torch.Tensor, steps: Sequence["ControlledStep"]) -> None:
        """The steps' rows of `logits`, penalised in place, each penalty over all of them at once."""
        self.update(steps)
        device = logits.device
        rows = [row for step in steps for row in step.rows]
        # Each logits row's row of the table, and the logits rows, in one copy. Whole rows are gathered with
        # index_select, which copies them, where a CPU's advanced indexing goes element by element.
        owners, at = torch.tensor([[step.processor.row for step in steps for _ in step.rows], rows], device=device)
        counts, seen = self.counts.index_select(0, owners), self.in_prompt.index_select(0, owners)
        drafted, first = [], 0  # (row among `rows`, token) for each draft token on the path to a row
        for step in steps:
            drafted += [(first + node + 1, step.draft_tokens[ancestor])
                        for node, path in enumerate(ancestors(step.parents)) for ancestor in path]
            first += len(step.rows)
        if drafted:
            counts.index_put_(index_pairs(drafted, device), torch.ones(len(drafted), device=device),
                              accumulate=True)
        params = [step.processor.params for step in steps for _ in step.rows]
        values = torch.tensor([[p.repetition_penalty, 1.0 if p.repetition_penalty >= 1 else -1.0,
                                p.frequency_penalty, p.presence_penalty] for p in params],
                              dtype=torch.float32, device=device)
        repetition, sign, frequency, presence = values.T[:, :, None]
        contiguous = rows == list(range(rows[0], rows[-1] + 1))
        penalised = logits[rows[0]: rows[-1] + 1] if contiguous else logits.index_select(0, at)
        in_output = counts > 0
        if any(p.repetition_penalty != 1 for p in params):
            penalised = torch.where(in_output | seen, repetition_scaled(penalised, repetition, sign), penalised)
        if any(p.frequency_penalty for p in params):
            penalised = penalised - frequency * counts
        if any(p.presence_penalty for p in params):
            penalised = penalised - presence * in_output
        if contiguous:
            logits[rows[0]: rows[-1] + 1] = penalised
        else:
            logits.index_copy_(0, at, penalised)


class SeenTokens:
    """One sequence's distinct prompt and output tokens, in the order first seen, each with its output count and
    whether its prompt holds it: host arrays that double when full, so a pass reads them without a copy."""

    def __init__(self, prompt: Sequence[int]):
        distinct = np.unique(np.asarray(prompt, dtype=np.int64))
        size = len(distinct)
        self.tokens = np.zeros(max(16, 2 * size), dtype=np.int64)
        self.tokens[:size] = distinct
        self.counts = np.zeros(len(self.tokens), dtype=np.float32)
        self.in_prompt = np.zeros(len(self.tokens), dtype=bool)
        self.in_prompt[:size] = True
        self.position = dict(zip(distinct.tolist(), range(size)))  # each token's index in the arrays
        self.num_counted = len(prompt)  # its committed tokens before this index are counted

    @property
    def size(self) -> int:
        """How many distinct tokens the arrays hold."""
        return len(self.position)

    def update(self, tokens: Sequence[int]) -> None:
        """Counts the committed `tokens` (prompt and output) not counted yet: one output occurrence each."""
        for token in tokens[self.num_counted:]:
            at = self.position.get(token)
            if at is None:
                if self.size == len(self.tokens):
                    self.tokens, self.counts, self.in_prompt = (np.concatenate([a, np.zeros_like(a)])
                                                                for a in (self.tokens, self.counts, self.in_prompt))
                at = self.position[token] = self.size
                self.tokens[at] = token
            self.counts[at] += 1
        self.num_counted = len(tokens)


class SeenTokenCounts:
    """The penalties over each sequence's seen tokens alone (a CPU's form; the module's docstring says why)."""

    def penalise(self, logits: torch.Tensor, steps: Sequence["ControlledStep"]) -> None:
        """The steps' rows of `logits`, penalised in place: every (row, seen token) of the pass gathered, changed
        and written back at once."""
        rows, tokens, counts, params, entries = [], [], [], [], []
        for step in steps:
            processor = step.processor
            if processor.seen is None:
                processor.seen = SeenTokens(step.tokens[:processor.prompt_len])
            seen = processor.seen
            seen.update(step.tokens)
            size, num_rows = seen.size, len(step.rows)
            # The step's rows over the sequence's seen tokens; each draft token on a row's path counts once more
            # there, and one the sequence has not seen is an entry of that row alone.
            row_counts = np.tile(seen.counts[:size], (num_rows, 1))
            new = collections.Counter()
            for node, path in enumerate(ancestors(step.parents)):
                for ancestor in path:
                    token = step.draft_tokens[ancestor]
                    at = seen.position.get(token)
                    if at is None:
                        new[node + 1, token] += 1
                    else:
                        row_counts[node + 1, at] += 1
            rows += [np.repeat(np.arange(step.first_row, step.first_row + num_rows), size),
                     np.fromiter((step.first_row + row for row, _ in new), np.int64, len(new))]
            tokens += [np.tile(seen.tokens[:size], num_rows), np.fromiter((token for _, token in new), np.int64,
                                                                          len(new))]
            counts += [row_counts.ravel(), np.fromiter(new.values(), np.float32, len(new))]
            params.append(processor.params)
            entries.append(num_rows * size + len(new))
        at = (torch.from_numpy(np.concatenate(rows)), torch.from_numpy(np.concatenate(tokens)))
        count = torch.from_numpy(np.concatenate(counts))
        values = np.array([[p.repetition_penalty, 1.0 if p.repetition_penalty >= 1 else -1.0, p.frequency_penalty,
                            p.presence_penalty] for p in params], dtype=np.float32)
        repetition, sign, frequency, presence = torch.from_numpy(np.repeat(values, entries, axis=0)).T
        # Every entry is a seen token (the prompt's, or counted): TokenCounts' operations on those logits, in its
        # order; the logits of tokens not seen it leaves equal too.
        x = repetition_scaled(logits[at], repetition, sign)
        x = x - frequency * count
        x = x - presence * (count > 0)
        logits.index_put_(at, x)


def repetition_scaled(x: torch.Tensor, repetition: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    """x / r where x > 0, else x * r (vLLM's repetition penalty), as the smaller of the two for r >= 1 and the
    larger below (`sign` -1 there: the smaller of the pair negated, negated back), which gives the same bits
    without choosing by each logit's sign: torch's CPU `where` on a condition that random mispredicts a branch an
    element (11 ms over 64 rows of 49,152, against 2 for these four operations)."""
    flipped = x * sign
    return torch.minimum(flipped / repetition, flipped * repetition) * sign


def penalty_counts(vocab_size: int, device: torch.device) -> TokenCounts | SeenTokenCounts:
    """The penalties' form for logits on `device`."""
    return SeenTokenCounts() if device.type == "cpu" else TokenCounts(vocab_size, device)


def index_pairs(pairs: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, columns) of (row, column) pairs, sent to the device in one copy."""
    at = torch.tensor(pairs, dtype=torch.long).to(device)
    return at[:, 0], at[:, 1]
