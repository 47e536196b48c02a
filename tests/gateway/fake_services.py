"""In-process fake drafter and verifier: real grpc.aio servers on 127.0.0.1
with scripted logic, so the gateway's propose/verify loop, its gRPC clients
and its Generate API run for real without a model or a drafter engine."""

import asyncio
import contextlib
import dataclasses
import itertools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc

from gateway.drafter_client import DrafterClient
from gateway.grpc_api import add_generation_servicer
from gateway.metrics import GatewayMetrics
from gateway.orchestrator import Orchestrator
from gateway.planner import PlannerPolicy
from gateway.types import GenerationRequest, TokenDelta
from gateway.verifier_pool import VerifierPool
from protos.common.v1 import common_pb2
from protos.drafter.v1 import drafter_pb2, drafter_pb2_grpc
from protos.gateway.v1 import gateway_pb2_grpc
from protos.verifier.v1 import verifier_pb2, verifier_pb2_grpc
from speclane.speculation import SpeculationSettings
from tests.gateway.fakes import MODEL_NAME, make_context

PROMPT = [5, 6, 7]
# A verify step long enough that the gateway's next-round offer reaches it before it ends even on a loaded host
# (at 20 ms, one offer in a run came late under the full suite).
OFFER_STEP_SECONDS = 0.1
_request_ids = itertools.count()


def target_tokens(start: int, count: int) -> list[int]:
    """The fake model's output from position `start` on: ids 10..49, inside the tiny tokenizer's vocabulary."""
    return [10 + i % 40 for i in range(start, start + count)]


@contextlib.contextmanager
def _recorded(context, outcomes: list[str]):
    """Records how a Session stream ended: "ended" when its request stream closed
    (half-closed or cancelled between steps: gRPC does not tell the servicer which),
    "cancelled" when cancelled mid-step, else the status code it aborted with."""
    outcome = "ended"
    try:
        yield
    except asyncio.CancelledError:
        outcome = "cancelled"
        raise
    except grpc.aio.AbortError:
        outcome = context.code().name
        raise
    finally:
        outcomes.append(outcome)


async def _numbered(requests):
    """The stream's messages with their step number: 0 for the first (prefill, start)."""
    step = 0
    async for request in requests:
        yield step, request
        step += 1


class FakeVerifier(verifier_pb2_grpc.VerifierServicer):
    """Commits the target tokens: one at prefill (step 0), then per verify
    (steps 1, 2...) the first `accept` tokens of the draft cut to remaining - 1
    (as the real verifier cuts it) and one of its own. Takes next-round offers
    as the real verifier does: a step whose outcome an offer matches is
    followed at once by the offered draft's step."""

    def __init__(self, accept: int = 2, prefill_seconds: float = 0.0, step_seconds: float = 0.0):
        self.accept = accept
        self.prefill_seconds = prefill_seconds  # a real prefill is a forward pass
        self.step_seconds = step_seconds  # and so is a verify step: time for an offer to arrive
        self.fail: tuple[grpc.StatusCode, int] | None = None  # abort with this code at this step
        self.hang_at: int | None = None  # never answer this step
        self.quit_at: int | None = None  # end the stream (status OK) instead of answering this step
        self.hanging = asyncio.Event()
        self.drafts: list[list[int]] = []  # every draft verified, as sent or offered
        self.offers: list[verifier_pb2.NextRound] = []  # every next round offered
        self.outcomes: list[str] = []  # one per finished Session
        self.open_sessions = 0
        self.num_running: int | None = None  # the load each answer reports; None: the sessions open here

    def add_to(self, server: grpc.aio.Server) -> None:
        verifier_pb2_grpc.add_VerifierServicer_to_server(self, server)

    async def GetModelInfo(self, request, context):
        return verifier_pb2.ModelInfo(model_name=MODEL_NAME, vocab_size=420, max_context_len=256, eos_token_ids=[2])

    async def GetLoad(self, request, context):
        return verifier_pb2.EngineLoad(num_running=self.open_sessions if self.num_running is None else self.num_running)

    async def Session(self, request_iterator, context):
        prompt_len = max_new = generated = 0
        offered: dict[int, verifier_pb2.NextRound] = {}  # by step_committed_len
        inbox: asyncio.Queue = asyncio.Queue()

        async def read():
            async for request in request_iterator:
                kind = request.WhichOneof("kind")
                if kind != "next_round":
                    inbox.put_nowait(request)
                offer = (request.next_round if kind == "next_round" else
                         request.verify.next_round if kind == "verify" and request.verify.HasField("next_round")
                         else None)
                if offer is not None:
                    self.offers.append(offer)
                    offered[offer.step_committed_len] = offer
            inbox.put_nowait(None)

        reader = asyncio.ensure_future(read())
        continuation = None
        self.open_sessions += 1
        try:
            with _recorded(context, self.outcomes):
                for step in itertools.count():
                    if continuation is None and (request := await inbox.get()) is None:
                        return
                    if self.fail is not None and self.fail[1] == step:
                        await context.abort(self.fail[0], f"scripted failure at step {step}")
                    if self.hang_at == step:
                        self.hanging.set()
                        await asyncio.Event().wait()
                    if self.quit_at == step:
                        return
                    if step == 0:
                        await asyncio.sleep(self.prefill_seconds)
                        prefill = request.prefill
                        prompt_len, max_new = len(prefill.prompt_token_ids), prefill.sampling.max_new_tokens
                        tokens, accepted, verified = target_tokens(0, 1), 0, 0
                    else:
                        await asyncio.sleep(self.step_seconds)
                        draft = list(continuation.draft.token_ids if continuation else request.verify.draft.token_ids)
                        self.drafts.append(draft)
                        verified = len(draft[:max_new - generated - 1])
                        accepted = min(self.accept, verified)
                        tokens = draft[:accepted] + target_tokens(generated + accepted, 1)
                    started_at = prompt_len + generated
                    generated += len(tokens)
                    finished = generated >= max_new
                    offer = offered.pop(started_at, None)
                    continuation = None if finished or offer is None else next(
                        (c for c in offer.continuations if c.draft.committed_len == prompt_len + generated
                         and c.bonus_token_id == tokens[-1]), None)
                    looked_up = None  # a prompt lookup, where no continuation matches: the next target tokens
                    if continuation is None and not finished and offer is not None and offer.lookup_tokens:
                        looked_up = common_pb2.Draft(token_ids=target_tokens(generated, offer.lookup_tokens),
                                                     committed_len=prompt_len + generated, source="lookup")
                        continuation = verifier_pb2.Continuation(draft=looked_up)
                    yield verifier_pb2.SessionResponse(
                        token_ids=tokens, num_accepted_draft_tokens=accepted, committed_len=prompt_len + generated,
                        finish_reason=common_pb2.FINISH_REASON_LENGTH if finished
                        else common_pb2.FINISH_REASON_UNSPECIFIED,
                        num_draft_tokens=verified, next_round_hit=continuation is not None, lookup_draft=looked_up,
                        num_running=self.open_sessions if self.num_running is None else self.num_running)
        finally:
            self.open_sessions -= 1
            reader.cancel()


class FakeDrafter(drafter_pb2_grpc.DrafterServicer):
    """Answers each step (1, 2...; step 0 is start) with the next `draft_len`
    target tokens: correct guesses, so the output does not depend on the drafts."""

    def __init__(self, draft_len: int = 6, max_tree_depth: int = 24, max_speculative_tokens: int = 64):
        self.info = drafter_pb2.DrafterInfo(methods=[drafter_pb2.METHOD_SUFFIX, drafter_pb2.METHOD_NGRAM],
                                            max_speculative_tokens=max_speculative_tokens,
                                            max_tree_depth=max_tree_depth, max_cached_requests=10000)
        self.draft_len = draft_len
        self.delay = 0.0  # seconds before each answer
        self.wrong_bonus = False  # a draft going on past its step guesses the bonus token wrong
        self.step_len = 0  # where a draft going on past its step ends that step (0: at k, as far as it may)
        # Draft token at this position wrong, with a detour there for the target's token (set detour_token to
        # offer another token instead).
        self.detour_at: int | None = None
        self.detour_token: int | None = None
        self.lookaheads: list[int] = []  # per session, its Start.num_lookahead_tokens
        self.params: list[drafter_pb2.ProposerParams] = []  # per session, as started
        self.fail: tuple[grpc.StatusCode, int] | None = None  # abort with this code at this step
        self.sessions = 0
        self.info_calls = 0
        self.committed: list[list[int]] = []  # per session: every committed token it was sent
        self.proposals = 0  # drafts asked for (Steps), all sessions
        self.outcomes: list[str] = []

    def add_to(self, server: grpc.aio.Server) -> None:
        drafter_pb2_grpc.add_DrafterServicer_to_server(self, server)

    async def GetInfo(self, request, context):
        self.info_calls += 1
        return self.info

    async def Sessions(self, request_iterator, context):
        """The gateway's sequences on one stream: each session's steps numbered from its start (0)."""
        sessions: dict[int, dict] = {}  # by the client's number: step, index (into the lists above), prompt_len

        def end(number: int, outcome: str) -> None:
            if sessions.pop(number, None) is not None:
                self.outcomes.append(outcome)

        try:
            async for request in request_iterator:
                answers = []
                for entry in request.entries:
                    kind = entry.WhichOneof("kind")
                    if kind == "end":
                        end(entry.session, "ended")
                        continue
                    if kind == "start":
                        self.sessions += 1
                        sessions[entry.session] = {"step": 0, "index": len(self.committed),
                                                   "prompt_len": len(entry.start.prompt_token_ids)}
                        self.committed.append([])
                        self.params.append(entry.start.params)
                        self.lookaheads.append(entry.start.num_lookahead_tokens)
                    session = sessions.get(entry.session)
                    if session is None:
                        continue
                    if self.fail is not None and self.fail[1] == session["step"]:
                        code = self.fail[0]
                        answers.append(drafter_pb2.SessionsResponse.Entry(
                            session=entry.session, code=code.value[0], detail=f"scripted failure at step "
                                                                              f"{session['step']}"))
                        end(entry.session, code.name)
                        continue
                    session["step"] += 1
                    if kind == "step":
                        answers.append(drafter_pb2.SessionsResponse.Entry(
                            session=entry.session, draft=await self._draft(session, entry.step)))
                if answers:
                    yield drafter_pb2.SessionsResponse(entries=answers)
        except asyncio.CancelledError:
            for number in list(sessions):
                end(number, "cancelled")
            raise
        for number in list(sessions):
            end(number, "ended")

    async def _draft(self, session: dict, step: drafter_pb2.Step) -> common_pb2.Draft:
        index, prompt_len = session["index"], session["prompt_len"]
        self.committed[index] += step.committed_token_ids
        self.proposals += 1
        await asyncio.sleep(self.delay)
        committed_len = step.committed_len
        k, lookahead = self.params[index].num_speculative_tokens, self.lookaheads[index]
        tokens = target_tokens(committed_len - prompt_len, min(self.draft_len, k + lookahead))
        step_len = min(self.step_len or k, len(tokens)) if len(tokens) > (self.step_len or k) else 0
        if self.wrong_bonus and step_len:
            tokens[step_len] = 999
        detours = []
        if self.detour_at is not None and len(tokens) > self.detour_at:
            at, generated = self.detour_at, committed_len - prompt_len
            detours.append(common_pb2.Detour(
                position=at, token_id=tokens[at] if self.detour_token is None else self.detour_token,
                token_ids=target_tokens(generated + at + 1, k)))
            tokens[at] = 999
        return common_pb2.Draft(token_ids=tokens, committed_len=committed_len, step_len=step_len, detours=detours)


@contextlib.asynccontextmanager
async def serve(add: Callable[[grpc.aio.Server], object]) -> AsyncIterator[str]:
    """A grpc.aio server on a free local port, with what `add` registers; yields its address."""
    server = grpc.aio.server()
    add(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


@dataclass
class Gateway:
    """The real gateway loop and its clients, over fakes the test can still script."""

    verifiers: list[FakeVerifier]
    pool: VerifierPool
    client: DrafterClient | None
    metrics: GatewayMetrics
    orchestrator: Orchestrator


@contextlib.asynccontextmanager
async def gateway(verifiers: Sequence[FakeVerifier], drafter: FakeDrafter | None = None, *,
                  timeout: float = 10.0, retry_seconds: float = 5.0,
                  policy: PlannerPolicy = PlannerPolicy()) -> AsyncIterator[Gateway]:
    """Starts the fakes and the real gateway loop over them (a DrafterClient only with a drafter). The
    drafter's timeout is long unless a test is about it: a loaded CI host must not turn a step into a miss."""
    async with contextlib.AsyncExitStack() as stack:
        addresses = [await stack.enter_async_context(serve(fake.add_to)) for fake in verifiers]
        pool = VerifierPool(tuple(addresses))
        stack.push_async_callback(pool.close)
        client = None
        if drafter is not None:
            client = DrafterClient(await stack.enter_async_context(serve(drafter.add_to)), timeout, retry_seconds)
            stack.push_async_callback(client.close)
        metrics = GatewayMetrics(MODEL_NAME)
        pool.attach_metrics(metrics)  # as the server wires it
        orchestrator = Orchestrator(pool, client, metrics, policy)
        yield Gateway(list(verifiers), pool, client, metrics, orchestrator)
        # Drafter sessions still handing their last tokens over.
        await asyncio.wait_for(asyncio.gather(*orchestrator._finishing, return_exceptions=True), 5)


@contextlib.asynccontextmanager
async def generation_api(tokenizer, gw: Gateway):
    """The public Generate API over the gateway loop, its context checking requests
    against the drafter's limits as the server wires it; yields (stub, context)."""
    ctx = dataclasses.replace(make_context(tokenizer, gw.orchestrator), metrics=gw.metrics,
                              drafter_limits=lambda: gw.client.limits if gw.client else None)
    async with serve(lambda server: add_generation_servicer(server, ctx)) as address:
        async with grpc.aio.insecure_channel(address) as channel:
            yield gateway_pb2_grpc.GenerationStub(channel), ctx


def generation(max_tokens: int = 10) -> GenerationRequest:
    return GenerationRequest(request_id=f"req-{next(_request_ids)}", prompt_token_ids=PROMPT, max_tokens=max_tokens,
                             speculation=SpeculationSettings(num_speculative_tokens=8))


async def collect(gw: Gateway, request: GenerationRequest | None = None, into: list | None = None) -> list[TokenDelta]:
    """Runs one generation to its end; `into` receives the deltas as they come (kept if it raises)."""
    deltas = [] if into is None else into
    async for delta in gw.orchestrator.generate(request or generation()):
        deltas.append(delta)
    return deltas


def tokens_of(deltas) -> list[int]:
    return [token for delta in deltas for token in delta.token_ids]


async def eventually(predicate: Callable[[], bool], timeout: float = 2.0) -> None:
    """Waits for a server-side effect of a client action (it arrives asynchronously)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)
