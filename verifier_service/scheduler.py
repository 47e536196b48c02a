"""Which sequences run in the next forward pass, and how much of each.

Sequences wait for admission (KV blocks for their whole prompt, shared with
the prefix cache where it holds its start, and a block of headroom left for
each running sequence) in arrival order; one that
waits longer than `max_queue_wait` or could never fit is refused. Among
admitted sequences with work, decode/verify steps go first and prompt
prefills fill the rest of the token budget in chunks, so a long
prompt never holds decoding up. When a step's KV cannot grow, its draft is
cut (drafts are optional); failing that the most recently admitted other
sequence is preempted: its blocks go back to the pool (its full ones stay in
the prefix cache) and it is prefilled again later from its tokens, so nothing
it committed is lost.
"""

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from speclane.tokens import common_prefix
from verifier_service.batch import Segment
from verifier_service.block_manager import BlockManager, BlockTable
from verifier_service.errors import ResourceExhausted
from verifier_service.sequence import Draft, Sequence


@dataclass(frozen=True)
class BatchLimits:
    max_tokens: int = 512  # tokens in one forward pass
    max_sequences: int = 64
    max_queue_wait: float = 30.0  # seconds a sequence may wait for KV before RESOURCE_EXHAUSTED
    # Draft tokens one sequence's step may verify (0: no limit beyond the pass's): a device whose kernels
    # take at most so many tokens per sequence a pass (device.draft_limit) gets its drafts cut to fit.
    max_draft_tokens: int = 0


@dataclass(eq=False)
class Work:
    """One requested step of a sequence: its first token (empty draft) or a verify."""

    seq: Sequence
    draft: Draft
    done: Callable[[object], None]  # called once with a StepResult or an exception
    submitted: float = field(default_factory=time.monotonic)
    started: float | None = None  # when it first joined a pass


@dataclass(frozen=True)
class Scheduled:
    work: Work
    segment: Segment
    draft: Draft  # the part of the draft in the pass
    queue_wait: float | None = None  # submit to first pass, set on the work's first pass


class Scheduler:
    def __init__(self, blocks: BlockManager, limits: BatchLimits, clock: Callable[[], float] = time.monotonic,
                 num_state_slots: int = 0):
        self.blocks = blocks
        self.limits = limits
        self.clock = clock
        # Models with linear attention: an admitted sequence also holds one of these state slots.
        self.free_state_slots = list(range(num_state_slots))
        self.keeps_states = num_state_slots > 0
        self.waiting: deque[Work] = deque()  # not admitted, arrival order
        self.ready: list[Work] = []  # admitted, with a step to run
        self.admitted: dict[Sequence, None] = {}  # holding KV, in admission order
        # When each sequence first joined a pass (its queue time ends there, its prefill
        # time starts): kept across preemptions, as vLLM times a request, until removed.
        self.first_scheduled: dict[Sequence, float] = {}
        self.num_preemptions = 0  # since start

    def add(self, work: Work) -> None:
        (self.ready if work.seq.blocks is not None else self.waiting).append(work)

    def remove(self, seq: Sequence) -> None:
        """Drops the sequence's queued work and gives its KV back (to the prefix cache)."""
        self.waiting = deque(w for w in self.waiting if w.seq is not seq)
        self.ready = [w for w in self.ready if w.seq is not seq]
        self.first_scheduled.pop(seq, None)
        self.release(seq)

    def release(self, seq: Sequence) -> None:
        if seq.blocks is not None:
            self.blocks.free(seq.blocks, seq.tokens, seq.num_cached)
            seq.blocks = None
            seq.num_cached = 0
            self.admitted.pop(seq, None)
        if seq.state_slot is not None:
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = None

    def admit(self) -> None:
        now = self.clock()
        while self.waiting:
            work = self.waiting[0]
            seq = work.seq
            if not self.blocks.fits_ever(len(seq.tokens)):
                self._refuse(work, f"the prompt needs {len(seq.tokens)} KV tokens but the budget is "
                                   f"{self.blocks.max_tokens}")
                continue
            if self._prefix_in_flight(seq) or not self._allocate(seq):
                break
            self.admitted[seq] = None
            self.ready.append(self.waiting.popleft())
        for work in [w for w in self.waiting if now - w.submitted > self.limits.max_queue_wait]:
            self._refuse(work, f"no KV space within {self.limits.max_queue_wait:g} s "
                               f"({self.blocks.max_tokens}-token budget in use)")

    def pick(self) -> list[Scheduled]:
        """The next pass: decode/verify steps first, then prefill chunks."""
        tokens_left, seqs_left = self.limits.max_tokens, self.limits.max_sequences
        picked: list[Scheduled] = []
        decodes = [w for w in self.ready if _pending(w.seq) == 1]
        prefills = [w for w in self.ready if _pending(w.seq) > 1]
        for work in decodes + prefills:
            if tokens_left <= 0 or seqs_left <= 0:
                break
            if work.seq.blocks is None:  # preempted for an earlier pick of this round
                continue
            entry = self._fit(work, tokens_left, picked)
            if entry is not None:
                picked.append(entry)
                tokens_left -= entry.segment.num_tokens
                seqs_left -= 1
        now = self.clock()
        for i, entry in enumerate(picked):
            if entry.work.started is None:
                entry.work.started = now
                self.first_scheduled.setdefault(entry.work.seq, now)
                picked[i] = replace(entry, queue_wait=now - entry.work.submitted)
        return picked

    def _fit(self, work: Work, tokens_left: int, picked: list[Scheduled]) -> Scheduled | None:
        seq = work.seq
        pending = _pending(seq)
        chunk = min(pending, tokens_left)
        final = chunk == pending
        # A linear-attention state is kept per step node, not per prompt token: drafts go with single-token steps.
        drafts = final and (pending == 1 or not self.keeps_states)
        allowed = tokens_left - chunk
        if self.limits.max_draft_tokens:
            allowed = min(allowed, self.limits.max_draft_tokens)
        draft = work.draft.trimmed(allowed, seq.max_draft_depth()) if drafts else Draft()
        base = seq.num_cached + chunk
        while not self.blocks.grow(seq.blocks, base + len(draft.token_ids)):
            room = self.blocks.reachable(seq.blocks) - base
            if room >= 0:
                draft = draft.trimmed(room, seq.max_draft_depth())
                continue
            if not self._preempt_one(spare={seq, *(e.work.seq for e in picked)}):
                if not picked and len(self.admitted) == 1:
                    self.ready.remove(work)
                    self.release(seq)
                    work.done(ResourceExhausted(f"the sequence needs {base} KV tokens but the budget "
                                                f"is {self.blocks.max_tokens}"))
                return None
        segment = Segment(tuple(seq.blocks.blocks), seq.num_cached, chunk,
                          draft.tree_parents if draft.token_ids else (), wants_logits=final,
                          state_slot=seq.state_slot or 0)
        return Scheduled(work, segment, draft)

    def _preempt_one(self, spare: set[Sequence]) -> bool:
        for victim in reversed(list(self.admitted)):
            if victim not in spare:
                self.num_preemptions += 1
                self.release(victim)
                for i, w in enumerate(self.ready):
                    if w.seq is victim:
                        self.waiting.appendleft(self.ready.pop(i))
                        break
                return True
        return False

    def _prefix_in_flight(self, seq: Sequence) -> bool:
        """Whether a sequence still prefilling is computing blocks this prompt starts
        with that the cache does not hold yet: it then waits for them rather than
        computing them a second time, so a system prompt that many concurrent
        requests share is computed once."""
        if not self.blocks.enable_prefix_caching:
            return False
        size = self.blocks.block_size
        reusable = (len(seq.tokens) - 1) // size * size
        salt = seq.params.cache_salt
        held = self.blocks.cached_tokens(seq.tokens, salt)
        return any(other.num_cached < len(other.tokens) - 1 and other.params.cache_salt == salt
                   and min(common_prefix(other.tokens, seq.tokens) // size * size, reusable) > held
                   for other in self.admitted)

    def _allocate(self, seq: Sequence) -> bool:
        if self.keeps_states and not self.free_state_slots:
            return False
        table = BlockTable(seq.params.cache_salt)
        # Leave every admitted sequence a free block to grow into, so admitting
        # one more does not force the next decode steps into preemption.
        cached = self.blocks.allocate(table, seq.tokens, len(seq.tokens), headroom_blocks=len(self.admitted))
        if cached is None:
            return False
        if seq not in self.first_scheduled:  # a preempted sequence's second admission reuses its own blocks
            seq.num_cached_prompt_tokens = cached
        seq.blocks, seq.num_cached = table, cached
        if self.keeps_states:
            seq.state_slot = self.free_state_slots.pop()
        return True

    def _refuse(self, work: Work, message: str) -> None:
        self.waiting.remove(work)
        work.done(ResourceExhausted(message))


def _pending(seq: Sequence) -> int:
    """Committed tokens not yet in the KV store (1 between decode steps)."""
    return len(seq.tokens) - seq.num_cached
