"""Continuous batching of prefill and verify steps on the target model.

`Engine` is the synchronous core: steps are submitted as work, and each
`step()` runs one forward pass over whatever the scheduler picked, verifies
every finished segment and reports the results through the work's callback.
`AsyncEngine` (async_engine.py) runs it on one dedicated model thread.
"""

import dataclasses
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch

from speclane.speculation import token_cost_at
from verifier_service.batch import StateCommit, StepPlan
from verifier_service.block_manager import BlockManager, MoveSlots
from verifier_service.errors import InvalidRequest, SequenceFinished, StaleDraft
from verifier_service.grammar import GrammarCompiler
from verifier_service.heads.capture import HiddenStateCapture
from verifier_service.heads.drafting import DraftRequest, HeadDrafter, HeadState
from verifier_service.logits_processing import ControlledStep, apply_logit_controls, make_logits_processor
from verifier_service.model_runner import ModelRunner
from verifier_service.penalties import penalty_counts
from verifier_service.sampling import batch_target_probs, greedy_choices, make_generator, step_groups
from verifier_service.scheduler import BatchLimits, Scheduled, Scheduler, Work
from verifier_service.sequence import Draft, GenerationParams, Sequence, StepResult, TokenLogprob, check_token_ids
from verifier_service.verify import (
    SampledStep,
    Verdict,
    committed_logprobs,
    dense_proposals,
    sampled_decisions,
    sampled_verdicts,
    verify_greedy,
)

log = structlog.get_logger()


@dataclass(frozen=True)
class StepStats:
    """One forward pass, for metrics and logs."""

    num_sequences: int
    num_tokens: int
    num_prefill_tokens: int
    num_draft_tokens: int
    forward_seconds: float
    queue_wait_seconds: tuple[float, ...]  # of the work that joined a pass for the first time
    kv_used_tokens: int
    kv_cached_tokens: int
    kv_max_tokens: int
    num_waiting: int
    # Totals since start (the scheduler's counters), for Prometheus counters.
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens of admitted sequences
    prefix_cache_hits: int  # of them, found in the prefix cache


class Engine:
    """Not thread-safe: AsyncEngine calls it from its model thread only."""

    def __init__(self, runner: ModelRunner, blocks: BlockManager, limits: BatchLimits = BatchLimits(),
                 on_step: Callable[[StepStats], None] | None = None, head: HeadDrafter | None = None):
        self.runner = runner
        self.blocks = blocks
        if runner.linear_layers and blocks.enable_prefix_caching:
            raise ValueError("a model with linear attention cannot reuse cached prefixes: its state is kept per "
                             "sequence, not per block")
        cache = runner.cache
        # A linear-attention state slot for every sequence a pass may hold (vLLM sizes its state cache so too).
        state_slots = limits.max_sequences if runner.linear_layers else 0
        states = runner.states.num_slots if runner.states is not None else 0
        if cache is None or (cache.num_blocks, cache.block_size, states) != (blocks.num_blocks, blocks.block_size,
                                                                           state_slots):
            runner.allocate_cache(blocks.num_blocks, blocks.block_size, state_slots)
        self.scheduler = Scheduler(blocks, limits, num_state_slots=state_slots)
        self._state_commits: list[StateCommit] = []  # the last pass's accepted nodes, sent with the next plan
        self.grammars = GrammarCompiler(runner.model_dir, runner.vocab_size)
        self.token_counts = penalty_counts(runner.vocab_size, runner.device)  # the penalised sequences'
        self.generator = make_generator(None, runner.device)  # the unseeded sequences'
        self.on_step = on_step
        self.head = head
        # A verify step's extra cost per draft token by batch size (draft_cost.py), for the gateway.
        self.draft_token_costs: dict[int, float] = {}
        self.capture: HiddenStateCapture | None = None
        runner.feature_layers = head.head.feature_layers if head is not None else ()
        self._live: set[Sequence] = set()

    @property
    def draft_token_cost(self) -> float:
        """The cost with one sequence in a step (ModelInfo.draft_token_cost)."""
        return self.draft_token_costs.get(1, 0.0)

    def start_capture(self, capture: HiddenStateCapture) -> None:
        """vLLM's extract_hidden_states from now on: every prompt's hidden states to a file, 1 token out."""
        self.capture = capture
        self.runner.feature_layers = capture.layers

    @property
    def num_live(self) -> int:
        return len(self._live)

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.ready or self.scheduler.waiting)

    @property
    def num_between_steps(self) -> int:
        """Running sequences with no step queued: their clients are preparing the next one."""
        queued = {w.seq for w in self.scheduler.ready} | {w.seq for w in self.scheduler.waiting}
        return sum(1 for seq in self._live if not seq.finished and seq not in queued)

    def open(self, sequence_id: str, prompt: list[int], params: GenerationParams) -> Sequence:
        """Validates the prompt and makes a sequence (registered by its first step)."""
        runner = self.runner
        if not prompt:
            raise InvalidRequest("prompt_token_ids is empty")
        check_token_ids(prompt, runner.vocab_size, "prompt token id")
        if len(prompt) >= runner.max_context_len:
            raise InvalidRequest(f"prompt has {len(prompt)} tokens; the model's context is "
                                 f"{runner.max_context_len}, leaving no room to generate")
        sampling = params.sampling
        check_token_ids(sampling.logit_bias, runner.vocab_size, "logit_bias token id")
        # Masked by index until min_tokens: one outside the vocabulary would fail every step.
        check_token_ids(params.stop_token_ids, runner.vocab_size, "stop token id")
        if self.capture is not None:  # vLLM's extract_hidden_states answers one token
            params = dataclasses.replace(params, max_new_tokens=1,
                                         sampling=dataclasses.replace(sampling, min_tokens=0))
        if params.num_head_draft_tokens and self.head is None:
            raise InvalidRequest("this verifier has no draft head (start it with --speculative-config "
                                 "method eagle, eagle3 or mtp)")
        stop = frozenset(params.stop_token_ids if params.ignore_eos
                         else params.stop_token_ids | set(runner.eos_token_ids))
        seq = Sequence(sequence_id, list(prompt), params, stop, runner.max_context_len,
                       self.generator if sampling.seed is None else make_generator(sampling.seed, runner.device),
                       make_logits_processor(sampling, len(prompt), stop, self.token_counts),
                       self.grammars.matcher(params.grammar) if params.grammar else None)
        if params.num_head_draft_tokens:
            seq.head = HeadState()
        return seq

    def submit(self, seq: Sequence, draft: Draft, done: Callable[[object], None]) -> None:
        """Queues the sequence's next step (the first token when it has none yet);
        `done` gets the StepResult, or the exception that refused the step."""
        try:
            if seq.finished:
                raise SequenceFinished(f"sequence already finished ({seq.finish_reason.value})")
            if draft.from_head and not _drafts_on_demand(seq):
                draft = seq.own_draft()  # made after its last step
            draft.check(self.runner.vocab_size)
            if draft.committed_len and draft.committed_len != len(seq.tokens):
                raise StaleDraft(f"draft continues length {draft.committed_len} "
                                 f"but the sequence has {len(seq.tokens)} tokens")
        except (InvalidRequest, SequenceFinished, StaleDraft) as exc:
            done(exc)
            return
        self._live.add(seq)
        self.scheduler.add(Work(seq, draft.trimmed(len(draft.token_ids), seq.max_draft_depth()), done))

    def close(self, seq: Sequence) -> None:
        """Forgets the sequence: queued work dropped, its blocks freed (full ones stay cached)."""
        self.scheduler.remove(seq)
        self._live.discard(seq)
        if self.capture is not None:
            self.capture.forget(seq)

    def step(self) -> bool:
        """One forward pass over what is ready; False when nothing could run."""
        scheduler = self.scheduler
        scheduler.admit()
        self._draft_on_demand()
        picked = scheduler.pick()
        moves = tuple(self.blocks.take_moves())
        commits, self._state_commits = tuple(self._state_commits), []
        if not picked:
            if moves or commits:  # an idle pass still keeps the last accepted trees
                self.runner.execute(StepPlan(moves, (), (), commits))
            return False
        plan = StepPlan(moves, tuple(t for e in picked for t in _fed_tokens(e)), tuple(e.segment for e in picked),
                        commits)
        started = time.perf_counter()
        try:
            logits, features = self.runner.execute(plan)
        except Exception as exc:  # noqa: BLE001 - fail these steps, keep serving the rest
            log.exception("forward_failed", sequences=len(picked), tokens=plan.num_tokens)
            for entry in picked:
                self.close(entry.work.seq)
                entry.work.done(exc)
            return True
        forward_seconds = time.perf_counter() - started
        # Every client's sequences: a gateway sizes its drafts by this load, not by its own share of it.
        num_running = len(self.scheduler.admitted)
        # Each step's first logits row, and every row's argmax copied to the host once for the pass rather than
        # once per sequence (on an accelerator each copy waits for the device): the greedy sequences with no logit
        # controls use them.
        first_rows = list(itertools.accumulate((entry.segment.num_logit_rows for entry in picked), initial=0))
        plain = [_plain_greedy(entry) for entry in picked]
        argmax = greedy_choices(logits).tolist() if any(plain) else None
        verdicts = _judge(picked, first_rows, plain, argmax, logits)
        logprobs = _logprobs(picked, first_rows, verdicts, logits)
        token = 0
        answered: list[tuple[Scheduled, StepResult]] = []
        for entry, verdict, step_logprobs in zip(picked, verdicts, logprobs):
            fed = None if features is None else features[token: token + entry.segment.num_tokens]
            token += entry.segment.num_tokens
            try:
                for failed in (verdict, step_logprobs):
                    if isinstance(failed, Exception):
                        raise failed
                result = self._settle(entry, verdict, step_logprobs, fed, forward_seconds, num_running)
            except Exception as exc:  # noqa: BLE001 - fail this step alone: left queued, it would fail every pass
                self._fail(entry.work, exc)
                continue
            if result is not None:
                answered.append((entry, result))
        self._answer(answered)
        if self.on_step is not None:
            self.on_step(self._stats(picked, plan, forward_seconds))
        return True

    # Synchronous conveniences (tests, benchmarks, start-up measures): submit, then step until answered.
    def run_together(self, steps: list[tuple[Sequence, Draft]]) -> list[StepResult]:
        """Each (sequence, draft)'s step, batched as the scheduler allows; results in order."""
        answers: dict[int, object] = {}
        for i, (seq, draft) in enumerate(steps):
            self.submit(seq, draft, lambda answer, i=i: answers.__setitem__(i, answer))
        while len(answers) < len(steps):
            if not self.step() and len(answers) < len(steps):
                raise RuntimeError("the engine cannot make progress (KV budget full)")
        failed = next((answer for answer in answers.values() if isinstance(answer, Exception)), None)
        if failed is not None:
            raise failed
        return [answers[i] for i in range(len(steps))]

    def run(self, seq: Sequence, draft: Draft = Draft()) -> StepResult:
        return self.run_together([(seq, draft)])[0]

    def prefill(self, seq: Sequence) -> StepResult:
        return self.run(seq)

    def verify(self, seq: Sequence, draft: Draft) -> StepResult:
        return self.run(seq, draft)

    def _fail(self, work: Work, exc: Exception) -> None:
        log.exception("step_failed", sequence_id=work.seq.sequence_id)
        self.close(work.seq)
        work.done(exc)

    def _settle(self, entry: Scheduled, verdict: Verdict | None, logprobs: list[TokenLogprob] | None,
                features: torch.Tensor | None, forward_seconds: float, num_running: int) -> StepResult | None:
        """Commits the step's judged tokens (and their logprobs where asked); its result (None for a prompt
        chunk: more to come)."""
        seq, segment, draft = entry.work.seq, entry.segment, entry.draft
        if self.capture is not None and not seq.num_generated:
            self.capture.add(seq, features[: segment.num_pending])
        if not segment.wants_logits:  # a prompt chunk: more to come
            if seq.head is not None:
                start = seq.num_cached
                seq.head.add(start, features, seq.tokens[start + 1: start + 1 + segment.num_pending])
            seq.num_cached += segment.num_pending
            self.blocks.commit(seq.blocks, seq.tokens, seq.num_cached)
            return None
        base = seq.num_cached + segment.num_pending  # KV row of draft node 0
        if verdict.path != list(range(len(verdict.path))):  # an accepted tree path: its KV moves up to follow
            size, table = self.blocks.block_size, seq.blocks
            self.blocks.moves.append(MoveSlots(tuple(table.slot(base + row, size) for row in verdict.path),
                                               tuple(table.slot(base + i, size) for i in range(len(verdict.path)))))
        if seq.state_slot is not None and segment.num_pending == 1:  # its state after the accepted path's last node
            self._state_commits.append(StateCommit(seq.state_slot, verdict.path[-1] + 1 if verdict.path else 0))
        result = seq.commit(verdict.token_ids, verdict.num_accepted, len(draft.token_ids), logprobs)
        if seq.grammar is not None:
            seq.grammar.commit(result.token_ids)
        if self.capture is not None and seq.num_generated == len(result.token_ids):  # the prompt's pass
            self.capture.write(seq)
        if seq.head is not None:
            self._feed_head(seq, segment, features, verdict, result.token_ids)
            seq.head_draft = None
        seq.num_cached = min(len(seq.tokens) - 1, base + len(verdict.path))
        self.blocks.commit(seq.blocks, seq.tokens, seq.num_cached)
        self.scheduler.ready.remove(entry.work)
        if seq.finished:
            self.scheduler.release(seq)
        return dataclasses.replace(result, forward_seconds=forward_seconds, num_running=num_running)

    def _answer(self, answered: list[tuple[Scheduled, StepResult]]) -> None:
        """Drafts the next step of every answered sequence that drafts with the
        head after its steps, all together, then answers each with its draft."""
        drafting = [seq for seq in (entry.work.seq for entry, _ in answered)
                    if seq.head is not None and not (seq.finished or _drafts_on_demand(seq))]
        try:
            self._draft_heads(drafting)
        except Exception as exc:  # noqa: BLE001 - the head failed: these steps fail, the engine serves on
            for entry, _ in answered:
                self._fail(entry.work, exc)
            return
        for entry, result in answered:
            seq = entry.work.seq
            if seq.head is not None:
                draft, reported = seq.head_draft, {"head_draft_seconds": seq.head_draft_seconds}
                if draft is not None:
                    reported.update(head_draft=draft.token_ids, head_draft_parents=draft.parents,
                                    head_draft_score=draft.score)
                result = dataclasses.replace(result, **reported)
                seq.head_draft_seconds = 0.0
            entry.work.done(result)

    @staticmethod
    def _feed_head(seq: Sequence, segment, features: torch.Tensor, verdict: Verdict, committed: list[int]) -> None:
        """Gives the head this pass's (feature, next token) pairs: pending prompt
        tokens pair with the token after them, the rows that judged the
        committed tokens with those tokens. They go through the head at its next draft."""
        start, pending = seq.num_cached, segment.num_pending
        seq.head.add(start, features[: pending - 1], seq.tokens[start + 1: start + pending])
        judged = [pending - 1 + row for row in verdict.rows[: len(committed)]]
        seq.head.add(start + pending - 1, features[judged], committed)

    def _draft_heads(self, seqs: list[Sequence]) -> None:
        """The sequences' head drafts, made together (each head step one batch);
        each sequence is charged an equal share of the time. A draft stops where
        its next token (or tree node) would not pay at the current load: a big
        batch is compute-bound, so there a draft token costs what another
        sequence's token does (the costs measured by batch size, draft_cost.py)."""
        if not seqs:
            return
        token_cost = token_cost_at(tuple(sorted(self.draft_token_costs.items())), self.num_live)
        started = time.perf_counter()
        requests = [DraftRequest(seq.head, min(seq.params.num_head_draft_tokens, seq.max_draft_depth()),
                                 seq.params.sampling.temperature, seq.generator) for seq in seqs]
        drafts = self.head.draft_many(requests, token_cost)
        share = (time.perf_counter() - started) / len(seqs)
        for seq, draft in zip(seqs, drafts):
            seq.head_draft, seq.head_draft_seconds = draft, share

    def _draft_on_demand(self) -> None:
        """The head drafts of the admitted steps that ask for one where their
        sequence drafts on demand, made together before the pass they may join
        (the pairs fed since each sequence's last draft go through the head first)."""
        asking = [work for work in self.scheduler.ready if work.draft.from_head]
        try:
            self._draft_heads([work.seq for work in asking])
        except Exception as exc:  # noqa: BLE001 - the head failed: these steps fail, the engine serves on
            for work in asking:
                self._fail(work, exc)
            return
        for work in asking:
            work.draft = work.seq.own_draft()  # as deep as the sequence's budget allows (_draft_heads)

    def _stats(self, picked: list[Scheduled], plan: StepPlan, forward_seconds: float) -> StepStats:
        blocks, size = self.blocks, self.blocks.block_size
        return StepStats(
            num_sequences=len(picked),
            num_tokens=plan.num_tokens,
            num_prefill_tokens=sum(e.segment.num_pending for e in picked if e.segment.num_pending > 1),
            num_draft_tokens=sum(len(e.segment.parents) for e in picked),
            forward_seconds=forward_seconds,
            queue_wait_seconds=tuple(e.queue_wait for e in picked if e.queue_wait is not None),
            kv_used_tokens=blocks.used_blocks * size,
            kv_cached_tokens=blocks.cached_blocks * size,
            kv_max_tokens=blocks.max_tokens,
            num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=blocks.prefix_cache_queries,
            prefix_cache_hits=blocks.prefix_cache_hits,
        )


def _drafts_on_demand(seq: Sequence) -> bool:
    """The head drafts for the steps that verify its draft, when they are about to run, not after every step."""
    return seq.head is not None and seq.params.head_draft_on_demand


def _judge(picked: list[Scheduled], first_rows: list[int], plain: list[bool], argmax: list[int] | None,
           logits: torch.Tensor) -> list[Verdict | Exception | None]:
    """The verdicts of the pass's steps (None for a prompt chunk): the plain greedy steps' from the pass's argmax,
    the rest's rows widened and put through their logit controls and grammars, then the greedy steps' argmax
    and the sampled steps' acceptance, each for all of them at once with one copy to the host, as in vLLM
    (greedy is the argmax after the controls). A step that fails gets its exception."""
    verdicts: list[Verdict | Exception | None] = [None] * len(picked)
    greedy: list[tuple[int, torch.Tensor | None]] = []  # (step, its grammar's row masks)
    sampled: list[tuple[int, torch.Tensor | None]] = []
    for i, (entry, plain_greedy) in enumerate(zip(picked, plain)):
        if plain_greedy:
            verdicts[i] = verify_greedy(entry.draft.token_ids, argmax[first_rows[i]:first_rows[i + 1]],
                                        entry.draft.tree_parents)
            continue
        if not entry.segment.wants_logits:
            continue
        seq, draft = entry.work.seq, entry.draft
        try:
            masks = None if seq.grammar is None else seq.grammar.row_masks(draft.token_ids, draft.tree_parents)
        except Exception as exc:  # noqa: BLE001 - this step fails alone
            verdicts[i] = exc
            continue
        (greedy if seq.params.sampling.greedy else sampled).append((i, masks))
    for group, judge in ((greedy, _judge_greedy), (sampled, _judge_sampled)):
        if not group:
            continue
        steps = [_Judged(picked[i], logits[first_rows[i]:first_rows[i + 1]], masks) for i, masks in group]
        try:
            judged = judge(steps)
        except Exception as exc:  # noqa: BLE001 - these steps fail, the engine serves on
            judged = [exc] * len(group)
        for (i, _), verdict in zip(group, judged):
            verdicts[i] = verdict
    return verdicts


def _logprobs(picked: list[Scheduled], first_rows: list[int], verdicts: list, logits: torch.Tensor) -> list:
    """Each step's committed tokens' logprobs where its request asks for them (else None), all read with one
    copy to the host; the exception instead where that failed."""
    asking = [i for i, (entry, verdict) in enumerate(zip(picked, verdicts))
              if entry.work.seq.params.logprobs is not None and isinstance(verdict, Verdict)]
    found: list = [None] * len(picked)
    if asking:
        requests = [(first_rows[i], verdicts[i], picked[i].work.seq.params.logprobs) for i in asking]
        try:
            computed = committed_logprobs(logits, requests)
        except Exception as exc:  # noqa: BLE001 - these steps fail, the engine serves on
            computed = [exc] * len(asking)
        for i, step_logprobs in zip(asking, computed):
            found[i] = step_logprobs
    return found


@dataclass(frozen=True)
class _Judged:
    """A step to judge: its raw logits rows and its grammar's row masks (None without a grammar)."""

    entry: Scheduled
    rows: torch.Tensor
    masks: torch.Tensor | None


def _groups(steps: list[_Judged]) -> list[list[_Judged]]:
    """The steps in groups whose rows are processed at once (sampling.step_groups)."""
    rows = steps[0].rows
    return [[steps[i] for i in group] for group in step_groups([len(s.rows) for s in steps], rows.shape[-1],
                                                                rows.device)]


def _controlled(steps: list[_Judged]) -> torch.Tensor:
    """The steps' rows, in order, widened to fp32 and put through their logit controls and their grammars'
    masks: each for all the steps at once."""
    logits = torch.cat([step.rows for step in steps]).float()  # a copy, which the controls change in place
    first_rows = list(itertools.accumulate((len(step.rows) for step in steps), initial=0))
    controlled = [ControlledStep(first, step.entry.work.seq.logits_processor, step.entry.work.seq.tokens,
                                 step.entry.draft.token_ids, step.entry.draft.tree_parents)
                  for first, step in zip(first_rows, steps) if step.entry.work.seq.logits_processor is not None]
    if controlled:
        apply_logit_controls(logits, controlled)
    masked = [(first, step.masks) for first, step in zip(first_rows, steps) if step.masks is not None]
    if masked:
        rows = torch.tensor([first + r for first, masks in masked for r in range(len(masks))], device=logits.device)
        allowed = torch.cat([masks for _, masks in masked]).to(logits.device)
        logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(~allowed, float("-inf")))
    return logits


def _judge_greedy(steps: list[_Judged]) -> list[Verdict]:
    targets = torch.cat([greedy_choices(_controlled(group)) for group in _groups(steps)]).tolist()
    verdicts, row = [], 0
    for step in steps:
        draft = step.entry.draft
        verdicts.append(verify_greedy(draft.token_ids, targets[row: row + len(step.rows)], draft.tree_parents))
        row += len(step.rows)
    return verdicts


def _judge_sampled(steps: list[_Judged]) -> list[Verdict | RuntimeError]:
    """The steps' target probabilities and decisions group by group, all read with one copy to the host."""
    vocab, device = steps[0].rows.shape[-1], steps[0].rows.device
    groups, decisions = [], []
    for group in _groups(steps):
        probs = batch_target_probs(_controlled(group), [step.entry.work.seq.params.sampling for step in group],
                                   [len(step.rows) for step in group])
        first, group_steps = 0, []
        for step in group:
            draft = step.entry.draft
            proposals = draft.proposal_probs
            if draft.proposals:
                sparse = [(q.token_ids, q.probs) for q in draft.proposals]
                proposals = dense_proposals(sparse, vocab, device)
            group_steps.append(SampledStep(draft.token_ids, first, step.entry.work.seq.generator, proposals,
                                           draft.tree_parents))
            first += len(step.rows)
        decisions.append(sampled_decisions(probs, group_steps))
        groups.append(group_steps)
    decided = iter(torch.cat(decisions).tolist())
    return [verdict for group_steps in groups for verdict in sampled_verdicts(group_steps, decided)]


def _fed_tokens(entry: Scheduled) -> list[int]:
    seq, segment = entry.work.seq, entry.segment
    return [*seq.tokens[seq.num_cached: seq.num_cached + segment.num_pending], *entry.draft.token_ids]


def _plain_greedy(entry: Scheduled) -> bool:
    """A step judged by its rows' raw argmax: greedy, no logit controls, no grammar, and logits wanted."""
    seq = entry.work.seq
    return (entry.segment.wants_logits and seq.params.sampling.greedy and seq.logits_processor is None
            and seq.grammar is None)
