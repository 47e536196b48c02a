"""Prefill and verify steps of sequences on the target model.

`Engine` is the synchronous core. `AsyncEngine` runs it on one dedicated
worker thread, so the event loop stays responsive and the forward passes of
concurrent sequences never interleave on the model.
"""

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from verifier_service.device import set_threads
from verifier_service.errors import InvalidRequest, SequenceFinished, StaleDraft
from verifier_service.model_runner import ModelRunner, crop_cache
from verifier_service.sampling import make_generator, pick, target_probs
from verifier_service.sequence import Draft, GenerationParams, Sequence, StepResult
from verifier_service.verify import dense_proposals, verify_greedy, verify_sampled


class Engine:
    """Sequences of one model; not thread-safe, AsyncEngine serialises the calls."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self._live: set[Sequence] = set()

    @property
    def num_live(self) -> int:
        return len(self._live)

    def open(self, sequence_id: str, prompt: list[int], params: GenerationParams) -> Sequence:
        """Validates the prompt and registers a new sequence (no model work yet)."""
        runner = self.runner
        if not prompt:
            raise InvalidRequest("prompt_token_ids is empty")
        for token in prompt:
            if not 0 <= token < runner.vocab_size:
                raise InvalidRequest(f"prompt token id {token} is outside the vocabulary [0, {runner.vocab_size})")
        if len(prompt) >= runner.max_context_len:
            raise InvalidRequest(f"prompt has {len(prompt)} tokens; the model's context is "
                                 f"{runner.max_context_len}, leaving no room to generate")
        stop = params.stop_token_ids if params.ignore_eos else params.stop_token_ids | set(runner.eos_token_ids)
        seq = Sequence(sequence_id, list(prompt), params, frozenset(stop), runner.max_context_len,
                       make_generator(params.sampling.seed, runner.device))
        self._live.add(seq)
        return seq

    def prefill(self, seq: Sequence) -> StepResult:
        """Runs the prompt; returns the first generated token."""
        seq.cache = self.runner.new_cache()
        logits = self.runner.forward(seq.tokens, seq.cache, last_only=True)
        result = seq.commit([pick(logits[-1], seq.params.sampling, seq.generator)], 0)
        self._settle(seq)
        return result

    def verify(self, seq: Sequence, draft: Draft) -> StepResult:
        """One forward over [last committed, d1..dk], then acceptance; an empty
        draft decodes one token."""
        if seq.finished:
            raise SequenceFinished(f"sequence already finished ({seq.finish_reason.value})")
        draft.check(self.runner.vocab_size)
        if draft.committed_len and draft.committed_len != len(seq.tokens):
            raise StaleDraft(f"draft continues length {draft.committed_len} "
                             f"but the sequence has {len(seq.tokens)} tokens")
        # Drafts past the budget could never be committed (and might not fit the context).
        tokens = list(draft.token_ids[: seq.budget()])
        logits = self.runner.forward([seq.tokens[-1], *tokens], seq.cache)
        sampling = seq.params.sampling
        if sampling.greedy:
            verdict = verify_greedy(tokens, logits)
        else:
            proposals = None
            if draft.proposals:
                sparse = [(p.token_ids, p.probs) for p in draft.proposals[: len(tokens)]]
                proposals = dense_proposals(sparse, logits.shape[-1], logits.device)
            verdict = verify_sampled(tokens, target_probs(logits, sampling), seq.generator, proposals)
        result = seq.commit(verdict.token_ids, verdict.num_accepted, len(tokens))
        self._settle(seq)
        return result

    def close(self, seq: Sequence) -> None:
        """Forgets the sequence and frees its KV cache."""
        seq.cache = None
        self._live.discard(seq)

    def _settle(self, seq: Sequence) -> None:
        if seq.finished:
            seq.cache = None
        else:
            crop_cache(seq.cache, len(seq.tokens) - 1)


class AsyncEngine:
    """The engine behind a single model thread. `load` builds the ModelRunner
    on that thread; `start` also runs a warm-up forward."""

    def __init__(self, load: Callable[[], ModelRunner], threads: int = 0):
        self._load = load
        # The initializer runs on the model thread before its first torch op.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verifier-model",
                                            initializer=set_threads, initargs=(threads,))
        self.engine: Engine | None = None

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def start(self) -> None:
        def load_and_warm_up() -> Engine:
            runner = self._load()
            runner.warm_up()
            return Engine(runner)

        self.engine = await self._run(load_and_warm_up)

    def open(self, sequence_id: str, prompt: list[int], params: GenerationParams) -> Sequence:
        return self.engine.open(sequence_id, prompt, params)

    async def prefill(self, seq: Sequence) -> StepResult:
        return await self._run(self.engine.prefill, seq)

    async def verify(self, seq: Sequence, draft: Draft) -> StepResult:
        return await self._run(self.engine.verify, seq, draft)

    def close(self, seq: Sequence) -> None:
        """Queued behind any step of this sequence still running on the model thread."""
        self._executor.submit(self.engine.close, seq)

    async def num_live(self) -> int:
        """Live sequences, counted after every queued close has run."""
        return await self._run(lambda: self.engine.num_live)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
