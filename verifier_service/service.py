"""gRPC adapter of the verifier: protobuf in and out, domain errors to status
codes. All model work goes through the AsyncEngine."""

import asyncio
import pathlib
import time

import grpc
import structlog

from protos.common.v1 import common_pb2
from protos.conventions import MAX_NEXT_ROUND_CONTINUATIONS
from protos.verifier.v1 import verifier_pb2, verifier_pb2_grpc
from speclane.grpc_server import bind_request_id_from
from verifier_service.async_engine import AsyncEngine
from verifier_service.config import DEFAULT_MAX_DRAFT_TOKENS
from verifier_service.engine import Engine
from verifier_service.errors import InvalidRequest, ResourceExhausted, SequenceFinished, StaleDraft
from verifier_service.next_round import Continuation, NextRound
from verifier_service.sampling import SamplingParams
from verifier_service.sequence import Draft, FinishReason, GenerationParams, Proposal, Sequence, StepResult

log = structlog.get_logger()

FINISH_REASONS = {
    FinishReason.NONE: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
}


def _optional(message, name: str, default=None):
    """The field's value when the message has it, else `default` (absent controls are off)."""
    return getattr(message, name) if message.HasField(name) else default


def params_from_proto(prefill: verifier_pb2.Prefill) -> GenerationParams:
    sampling = prefill.sampling
    return GenerationParams(
        sampling=SamplingParams(
            temperature=_optional(sampling, "temperature"),
            top_p=_optional(sampling, "top_p"),
            top_k=_optional(sampling, "top_k"),
            seed=_optional(sampling, "seed"),
            presence_penalty=_optional(sampling, "presence_penalty", 0.0),
            frequency_penalty=_optional(sampling, "frequency_penalty", 0.0),
            repetition_penalty=_optional(sampling, "repetition_penalty", 1.0),
            min_p=_optional(sampling, "min_p", 0.0),
            logit_bias=dict(sampling.logit_bias),
            min_tokens=sampling.min_tokens,
        ),
        max_new_tokens=sampling.max_new_tokens,
        stop_token_ids=frozenset(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        logprobs=_optional(sampling, "logprobs"),
        grammar=_optional(sampling, "grammar"),
        num_head_draft_tokens=prefill.num_head_draft_tokens,
        head_draft_on_demand=prefill.head_draft_on_demand,
        cache_salt=prefill.cache_salt,
    )


def draft_from_proto(draft: common_pb2.Draft, max_tokens: int) -> Draft:
    # Counted on the message, before any of it is copied or checked on the model thread.
    nodes = max(len(draft.token_ids), len(draft.parents), len(draft.proposals))
    if nodes > max_tokens:
        raise InvalidRequest(f"a draft may have at most {max_tokens} nodes (--max-draft-tokens); this one has {nodes}")
    return Draft(
        token_ids=tuple(draft.token_ids),
        parents=tuple(draft.parents),
        proposals=tuple(Proposal(tuple(q.token_ids), tuple(q.probs)) for q in draft.proposals),
        committed_len=draft.committed_len,
    )


def continuations_from_proto(message: verifier_pb2.NextRound, max_tokens: int) -> tuple[Continuation, ...]:
    # Counted on the message, as drafts are, before any of it is copied.
    if len(message.continuations) > MAX_NEXT_ROUND_CONTINUATIONS:
        raise InvalidRequest(f"a next round may offer at most {MAX_NEXT_ROUND_CONTINUATIONS} continuations, "
                             f"this one offers {len(message.continuations)}")
    if message.lookup_tokens > max_tokens:
        raise InvalidRequest(f"a next round may look up at most {max_tokens} tokens (--max-draft-tokens); "
                             f"this one asks for {message.lookup_tokens}")
    return tuple(Continuation(c.bonus_token_id, draft_from_proto(c.draft, max_tokens)) for c in message.continuations)


def response_from(result: StepResult, head_method: str = "") -> verifier_pb2.SessionResponse:
    head_draft = (common_pb2.Draft(token_ids=result.head_draft, parents=result.head_draft_parents,
                                   score=result.head_draft_score, source=head_method)
                  if result.head_draft else None)
    return verifier_pb2.SessionResponse(
        head_draft=head_draft,
        token_ids=result.token_ids,
        num_accepted_draft_tokens=result.num_accepted,
        committed_len=result.committed_len,
        finish_reason=FINISH_REASONS[result.finish_reason],
        num_draft_tokens=result.num_draft_tokens,
        forward_seconds=result.forward_seconds,
        head_draft_seconds=result.head_draft_seconds,
        num_running=result.num_running,
        logprobs=[verifier_pb2.TokenLogprob(logprob=lp.logprob, top_token_ids=lp.top_token_ids,
                                            top_logprobs=lp.top_logprobs) for lp in result.logprobs],
    )


def _log_finish(seq: Sequence, reason: FinishReason) -> None:
    log.info("sequence_finished", sequence_id=seq.sequence_id, finish_reason=reason.value,
             prompt_tokens=seq.prompt_len, generated_tokens=seq.num_generated, steps=seq.num_steps,
             draft_tokens=seq.num_draft_tokens, accepted_tokens=seq.num_accepted_tokens,
             seconds=round(time.perf_counter() - seq.started, 4))


# What a client needs to tokenize as the model does: never the weights.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
    "generation_config.json", "config.json",
)


def tokenizer_files(model_dir: str) -> dict[str, bytes]:
    directory = pathlib.Path(model_dir)
    return {name: (directory / name).read_bytes() for name in TOKENIZER_FILES if (directory / name).is_file()}


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, engine: AsyncEngine, model_name: str, model_dir: str,
                 max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS):
        self.engine = engine
        self.model_name = model_name
        self.model_dir = model_dir
        self.max_draft_tokens = max_draft_tokens

    @property
    def head_method(self) -> str:
        """The loaded head's method ("" without one, or while loading)."""
        engine = self.engine.engine
        return engine.head.head.kind if engine is not None and engine.head is not None else ""

    async def _require_loaded(self, context) -> None:
        if self.engine.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")

    async def GetModelInfo(self, request, context):
        bind_request_id_from(context)
        await self._require_loaded(context)
        runner = self.engine.engine.runner
        return verifier_pb2.ModelInfo(
            model_name=self.model_name,
            vocab_size=runner.vocab_size,
            max_context_len=runner.max_context_len,
            eos_token_ids=runner.eos_token_ids,
            device=str(runner.device),
            dtype=str(runner.dtype).removeprefix("torch."),
            tensor_parallel_size=runner.tp_size,
            draft_head=self.head_method,
            draft_token_cost=self.engine.engine.draft_token_cost,
            draft_token_cost_by_batch_size=self.engine.engine.draft_token_costs,
        )

    async def GetTokenizer(self, request, context):
        bind_request_id_from(context)
        return verifier_pb2.TokenizerFiles(files=tokenizer_files(self.model_dir))

    async def Session(self, request_iterator, context):
        bind_request_id_from(context)
        await self._require_loaded(context)
        seq, step, status = None, None, None
        next_round = NextRound()
        # Read apart from the steps: a NextRound for the step in flight arrives while it runs.
        inbox: asyncio.Queue = asyncio.Queue()
        reader = asyncio.ensure_future(self._read(request_iterator, inbox, next_round))
        try:
            while (request := await inbox.get()) is not None:
                if isinstance(request, Exception):
                    raise request
                kind = request.WhichOneof("kind")
                if seq is None:
                    if kind != "prefill":
                        raise InvalidRequest("the first message of a session must be prefill")
                    params = params_from_proto(request.prefill)
                    # Opened before the await, so `finally` frees it even if the prefill is cancelled.
                    seq = self.engine.open(request.prefill.sequence_id, list(request.prefill.prompt_token_ids), params)
                    result, timing = await self._prefill(seq)
                    yield self._answer(seq, result, timing)
                    continue
                if kind != "verify":
                    raise InvalidRequest("after prefill, every message must be verify or next_round")
                draft = (Draft(from_head=True) if request.verify.use_head_draft
                         else draft_from_proto(request.verify.draft, self.max_draft_tokens))
                step = self._step(seq, draft)
                while step is not None:
                    started_at = result.committed_len  # the answer before this step
                    result, seconds = await step
                    # The sequence has no step in flight here, so its tokens are settled.
                    taken = next_round.take(started_at, result, seq.tokens)
                    # Started before this answer goes out: the model thread need not wait for it.
                    step = self._step(seq, taken.draft) if taken is not None else None
                    timing = verifier_pb2.SessionResponse(step_seconds=seconds, next_round_hit=step is not None)
                    if taken is not None and taken.looked_up:
                        timing.lookup_draft.CopyFrom(common_pb2.Draft(token_ids=taken.draft.token_ids,
                                                                      committed_len=taken.draft.committed_len,
                                                                      source="lookup"))
                    yield self._answer(seq, result, timing)
        except InvalidRequest as exc:
            status = grpc.StatusCode.INVALID_ARGUMENT, str(exc)
        except (SequenceFinished, StaleDraft) as exc:
            status = grpc.StatusCode.FAILED_PRECONDITION, str(exc)
        except ResourceExhausted as exc:
            status = grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
        finally:
            reader.cancel()
            if step is not None:
                step.cancel()
            if seq is not None:
                if not seq.finished:
                    _log_finish(seq, FinishReason.ABORT)
                self.engine.close(seq)
        if status is not None:
            # After the close: abort sends the status before it returns, and a client that
            # has it may count live sequences at once.
            await context.abort(*status)

    async def _read(self, request_iterator, inbox: asyncio.Queue, next_round: NextRound) -> None:
        """Offers each NextRound at once (alone or in a Verify); queues the other
        messages for the session, then None at the stream's end, or the error that stopped it."""
        try:
            async for request in request_iterator:
                kind = request.WhichOneof("kind")
                if kind == "next_round":
                    self._offer(next_round, request.next_round)
                    continue
                if kind == "verify" and request.verify.HasField("next_round"):  # a bad offer refuses its Verify
                    self._offer(next_round, request.verify.next_round)
                inbox.put_nowait(request)
            inbox.put_nowait(None)
        except Exception as exc:  # noqa: BLE001 - raised by the session, which answers with a status
            inbox.put_nowait(exc)

    def _offer(self, next_round: NextRound, message: verifier_pb2.NextRound) -> None:
        next_round.offer(message.step_committed_len, continuations_from_proto(message, self.max_draft_tokens),
                         message.lookup_tokens, message.run_ahead)

    def _step(self, seq: Sequence, draft: Draft) -> asyncio.Future:
        """A verify step, started now; resolves to (result, seconds it took)."""

        async def timed():
            arrived = time.monotonic()
            result = await self.engine.verify(seq, draft)
            return result, time.monotonic() - arrived
        return asyncio.ensure_future(timed())

    def _answer(self, seq: Sequence, result: StepResult, timing: verifier_pb2.SessionResponse):
        if result.finish_reason is not FinishReason.NONE:
            _log_finish(seq, result.finish_reason)
        response = response_from(result, self.head_method)
        response.MergeFrom(timing)  # every answer is timed: prefill and verify alike
        return response

    async def GetLoad(self, request, context):
        await self._require_loaded(context)
        return await self.engine.call(engine_load)

    async def _prefill(self, seq: Sequence) -> tuple[StepResult, verifier_pb2.SessionResponse]:
        """The first token, and the prefill answer's queue and prefill times."""
        arrived = time.monotonic()
        result = await self.engine.prefill(seq)
        answered = time.monotonic()
        # Written on the model thread before the result was handed over; reading one key is atomic.
        scheduled = self.engine.engine.scheduler.first_scheduled[seq]
        timing = verifier_pb2.SessionResponse(queue_seconds=scheduled - arrived, prefill_seconds=answered - scheduled,
                                              num_cached_tokens=seq.num_cached_prompt_tokens)
        log.info("sequence_prefilled", sequence_id=seq.sequence_id, prompt_tokens=seq.prompt_len,
                 max_new_tokens=seq.params.max_new_tokens, greedy=seq.params.sampling.greedy,
                 seconds=round(answered - arrived, 4), queue_seconds=round(timing.queue_seconds, 4),
                 cached_tokens=seq.num_cached_prompt_tokens)
        return result, timing


def engine_load(engine: Engine) -> verifier_pb2.EngineLoad:
    """The engine's load (run on the model thread, between passes)."""
    scheduler, blocks = engine.scheduler, engine.blocks
    return verifier_pb2.EngineLoad(
        num_running=len(scheduler.admitted), num_waiting=len(scheduler.waiting),
        kv_used_tokens=blocks.used_blocks * blocks.block_size,
        kv_cached_tokens=blocks.cached_blocks * blocks.block_size,
        kv_max_tokens=blocks.max_tokens, num_preemptions=scheduler.num_preemptions,
        prefix_cache_queries=blocks.prefix_cache_queries, prefix_cache_hits=blocks.prefix_cache_hits,
    )


def add_to_server(server: grpc.aio.Server, servicer: VerifierServicer) -> list[str]:
    """Registers the servicer; returns the full service names (for health and reflection)."""
    verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server)
    return [verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name]
