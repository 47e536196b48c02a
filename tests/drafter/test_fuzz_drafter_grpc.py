"""Fuzzing the drafter's Session and Sessions APIs, through the real servicer and
compiled engine on a real in-process gRPC server.

Each example is one session: a start (often malformed: unknown method, k of 0
or beyond the limit, lookup min above max, probabilities outside [0, 1] or NaN,
another tree depth, negative or huge token ids, a prompt over the session limit)
or a step or an empty message first; then steps with good and bad commits
(negative ids, committed_len wrong or going backwards, past the session limit),
second starts and empty messages. The status that ends the session is the one
the contract names (INVALID_ARGUMENT / FAILED_PRECONDITION / RESOURCE_EXHAUSTED),
never UNKNOWN or INTERNAL; every draft is well formed.

Meanwhile witness sessions of a tenant of their own run the same script again
and again, by suffix decoding and by n-gram lookup, sharing the engine's batched
steps with the fuzzed ones: their drafts must equal those of a private engine that
sees only the witness. Afterwards no session is left open on the engine.

On one Sessions stream, messages mix starts, good and bad steps, ends and empty
entries for a few session numbers (a second start or a second step of a session
in one message, a step after its session ended, a session ended right after its
step): each refusal is the contract's, in entry order, and each live step gets
one well-formed draft.
"""

import asyncio
import collections
import contextlib
import dataclasses
import math

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from drafter_service.config import DrafterConfig
from drafter_service.engine import SESSION_BUDGET, DraftEngine
from drafter_service.metrics import DrafterMetrics
from drafter_service.proposer import SequenceProposer, propose
from drafter_service.service import DrafterServicer, draft_to_proto
from protos.conventions import CHANNEL_OPTIONS
from protos.drafter.v1 import drafter_pb2, drafter_pb2_grpc
from speclane.speculation import MAX_PROMPT_LOOKUP, MAX_SPECULATIVE_TOKENS, settings_from_proto
from tests.fuzz_support import fuzz_settings, serving, wait_for

CONFIG = DrafterConfig(max_tree_depth=24, max_cached_requests=50, max_session_tokens=200)
ANSWER_SECONDS = 10.0  # any answer slower than this is a hang
INVALID, PRECONDITION, EXHAUSTED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                                    grpc.StatusCode.RESOURCE_EXHAUSTED)
OK = grpc.StatusCode.OK
CODES = {code.value[0]: code for code in grpc.StatusCode}  # a Sessions refusal's code number -> its status
ENDED = "ENDED"  # the stream had ended before a write, its status lost
WITNESS_TENANT = "witness"
WITNESS_PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6]
WITNESS_COMMITS = [[], [2, 6, 4], [3, 3], [8, 3, 2, 7, 9], [5], [0, 2, 8, 8, 4, 1, 9, 7]]
WITNESS_PARAMS = {
    "suffix": drafter_pb2.ProposerParams(method=drafter_pb2.METHOD_SUFFIX, num_speculative_tokens=6,
                                         max_spec_factor=2.0, min_token_prob=0.0),
    "ngram": drafter_pb2.ProposerParams(method=drafter_pb2.METHOD_NGRAM, num_speculative_tokens=4,
                                        prompt_lookup_min=1, prompt_lookup_max=3),
}


@dataclasses.dataclass
class Drafter:
    stub: drafter_pb2_grpc.DrafterStub
    engine: DraftEngine
    witness_runs: int = 0
    witness_failures: list = dataclasses.field(default_factory=list)


def draft_fields(draft) -> tuple:
    return tuple(draft.token_ids), tuple(draft.parents), tuple(draft.confidences), draft.score, draft.source


async def served_witness(stub, params) -> list[tuple]:
    call = stub.Session()
    await call.write(drafter_pb2.SessionRequest(start=drafter_pb2.Start(
        sequence_id="witness", prompt_token_ids=WITNESS_PROMPT, params=params, tenant=WITNESS_TENANT)))
    length, drafts = len(WITNESS_PROMPT), []
    for tokens in WITNESS_COMMITS:
        length += len(tokens)
        await call.write(drafter_pb2.SessionRequest(step=drafter_pb2.Step(committed_token_ids=tokens,
                                                                          committed_len=length)))
        drafts.append(draft_fields((await asyncio.wait_for(call.read(), ANSWER_SECONDS)).draft))
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    return drafts


async def private_witness(engine: DraftEngine, params) -> list[tuple]:
    """The witness's drafts from an engine of its own, as the servicer would send them."""
    proposer = SequenceProposer(engine, settings_from_proto(params, CONFIG.limits), WITNESS_TENANT)
    proposer.start(WITNESS_PROMPT)
    drafts = []
    for tokens in WITNESS_COMMITS:
        proposer.commit(tokens, proposer.committed_len + len(tokens))
        (draft,) = propose(engine, [(proposer, SESSION_BUDGET)])
        drafts.append(draft_fields(draft_to_proto(draft, proposer.committed_len)))
    proposer.end()
    return drafts


@contextlib.asynccontextmanager
async def running_drafter():
    engine = DraftEngine(CONFIG.max_tree_depth, CONFIG.max_cached_requests)
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    drafter_pb2_grpc.add_DrafterServicer_to_server(DrafterServicer(engine, CONFIG, DrafterMetrics(engine.core)), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as channel:
            drafter = Drafter(drafter_pb2_grpc.DrafterStub(channel), engine)
            private = DraftEngine(CONFIG.max_tree_depth, CONFIG.max_cached_requests)
            stop = asyncio.Event()

            async def witness():
                while not stop.is_set():
                    for method, params in WITNESS_PARAMS.items():
                        try:
                            served = await served_witness(drafter.stub, params)
                        except Exception as error:  # noqa: BLE001 - recorded; the test fails on it
                            drafter.witness_failures.append(f"{method}: {error!r}")
                            continue
                        expected = await private_witness(private, params)
                        drafter.witness_runs += 1
                        if served != expected:
                            drafter.witness_failures.append(f"{method}: drafts {served} != {expected}")

            task = asyncio.ensure_future(witness())
            try:
                yield drafter
            finally:
                stop.set()
                await asyncio.wait_for(task, 60)
    finally:
        await server.stop(None)


@pytest.fixture(scope="module")
def drafter():
    with serving(running_drafter) as (portal, drafter):
        yield portal, drafter


# -- what to send ------------------------------------------------------------------------------------------------

tokens = st.integers(0, 12) | st.sampled_from([2**31 - 1, 2**31 - 2, 100_000])  # repeats, so drafts happen
bad_tokens = st.sampled_from([-1, -2**31])
floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True)


@st.composite
def params(draw) -> tuple[drafter_pb2.ProposerParams, bool]:
    """(params, whether they are within bounds): within them three times in four."""
    any_values = draw(st.sampled_from([False, False, False, True]))
    message = drafter_pb2.ProposerParams(
        method=draw(st.sampled_from([drafter_pb2.METHOD_SUFFIX, drafter_pb2.METHOD_NGRAM]
                                    + [drafter_pb2.METHOD_UNSPECIFIED, 7] * any_values)),
        num_speculative_tokens=draw(st.sampled_from([8, 1, 3, MAX_SPECULATIVE_TOKENS])
                                    | (st.sampled_from([0, MAX_SPECULATIVE_TOKENS + 1, 2**32 - 1]) if any_values
                                       else st.nothing())))
    valid = message.method in (drafter_pb2.METHOD_SUFFIX, drafter_pb2.METHOD_NGRAM) \
        and 1 <= message.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS
    lookups = st.integers(1, 6) | (st.sampled_from([0, MAX_PROMPT_LOOKUP, MAX_PROMPT_LOOKUP + 1, 2**32 - 1])
                                   if any_values else st.nothing())
    if draw(st.booleans()):
        message.prompt_lookup_min = draw(lookups)
    if draw(st.booleans()):
        message.prompt_lookup_max = draw(lookups)
    low = message.prompt_lookup_min if message.HasField("prompt_lookup_min") else None
    high = message.prompt_lookup_max if message.HasField("prompt_lookup_max") else None
    if low is None and high is None:
        low, high = 2, 5  # vLLM's defaults
    else:  # as in vLLM, one given: the other takes its value
        low, high = (high if low is None else low), (low if high is None else high)
    valid = valid and 1 <= low <= high <= MAX_PROMPT_LOOKUP
    any_float = floats32 if any_values else st.nothing()
    if draw(st.booleans()):
        message.max_spec_factor = draw(st.sampled_from([0.0, 1.0, 2.5]) | any_float)
        valid = valid and math.isfinite(message.max_spec_factor) and message.max_spec_factor >= 0
    if draw(st.booleans()):
        message.min_token_prob = draw(st.sampled_from([0.0, 0.1, 1.0]) | any_float)
        valid = valid and math.isfinite(message.min_token_prob) and 0 <= message.min_token_prob <= 1
    if draw(st.booleans()):
        message.max_tree_depth = draw(st.just(CONFIG.max_tree_depth)
                                      | (st.sampled_from([0, 1, 256, 2**32 - 1]) if any_values else st.nothing()))
        valid = valid and message.max_tree_depth == CONFIG.max_tree_depth
    return message, valid


@st.composite
def starts(draw) -> tuple[drafter_pb2.SessionRequest, set]:
    """(start message, the status codes it may get)."""
    message, valid = draw(params())
    length = draw(st.sampled_from([10, 0, 1, 40, CONFIG.max_session_tokens, CONFIG.max_session_tokens + 1]))
    prompt = draw(st.lists(tokens, min_size=length, max_size=length))
    if prompt and draw(st.sampled_from([False] * 7 + [True])):
        prompt[draw(st.integers(0, len(prompt) - 1))] = draw(bad_tokens)
        valid = False
    start = drafter_pb2.Start(sequence_id=draw(st.text(max_size=8)), prompt_token_ids=prompt, params=message,
                              tenant=draw(st.sampled_from(["", "a", "b"]) | st.text(max_size=8)).replace(
                                  WITNESS_TENANT, ""))
    expected = {INVALID} if not valid else {EXHAUSTED} if length > CONFIG.max_session_tokens else {OK}
    return drafter_pb2.SessionRequest(start=start), expected


async def _open(stub):
    return stub.Session()


async def _answer(call, request, reply: bool = True):
    """Writes `request` and reads the reply: a response, or the code that ended the stream. A write
    the stream had already ended gives ENDED: grpc fails it with a client-side INTERNAL that hides
    the server's status."""
    try:
        await call.write(request)
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        return ENDED
    if not reply:
        return None
    try:
        return await asyncio.wait_for(call.read(), ANSWER_SECONDS)
    except grpc.aio.AioRpcError as error:
        return error.code()


async def _cancel(call):
    call.cancel()


def check_draft(draft, committed_len: int, k: int, trace) -> None:
    assert draft.committed_len == committed_len, trace
    n = len(draft.token_ids)
    assert n <= k and all(token >= 0 for token in draft.token_ids), trace
    assert not draft.parents or (len(draft.parents) == n and all(-1 <= p < i for i, p in enumerate(draft.parents))), \
        trace
    assert len(draft.confidences) in (0, n) and all(0 <= p <= 1 for p in draft.confidences), trace
    assert draft.source in ("suffix-request", "suffix-global", "ngram", ""), trace


def check_session(portal, stub, data) -> list[str]:
    first_kind = data.draw(st.sampled_from(["start"] * 8 + ["step first", "empty first"]), label="first")
    call = portal.call(_open, stub)
    try:
        if first_kind == "start":
            first, expected = data.draw(starts(), label="start")
        else:
            first = drafter_pb2.SessionRequest(step=drafter_pb2.Step()) if first_kind == "step first" \
                else drafter_pb2.SessionRequest()
            expected = {INVALID}
        length = len(first.start.prompt_token_ids)
        if first_kind == "start":
            # A start gets no reply of its own: the first step's reply (or the stream's status) tells how it
            # went, as the gateway hears it. Written apart, as the gateway writes them (the verifier's prefill
            # comes between): the drafter must not end the stream before that step arrives (ENDED).
            assert portal.call(_answer, call, first, False) is None
            outcome = portal.call(_answer, call, drafter_pb2.SessionRequest(step=drafter_pb2.Step(
                committed_len=length)))
        else:
            outcome = portal.call(_answer, call, first)
        code = OK if isinstance(outcome, drafter_pb2.SessionResponse) else outcome
        trace = [f"{first_kind}: {getattr(code, 'name', code)}"]
        assert code in expected, f"{trace}: expected {expected}"
        if code != OK:
            return trace
        k = first.start.params.num_speculative_tokens
        check_draft(outcome.draft, length, k, trace)
        for _ in range(data.draw(st.sampled_from([4, 2, 6, 1, 3, 5]), label="steps")):
            kind = data.draw(st.sampled_from(["step"] * 6 + ["start", "empty", "bad step"]), label="kind")
            commit = data.draw(st.lists(tokens, max_size=12), label="commit")
            expected = {INVALID}
            if kind == "start":
                request = first
            elif kind == "empty":
                request = drafter_pb2.SessionRequest()
            else:
                claimed = length + len(commit)
                if kind == "bad step":
                    defect = data.draw(st.sampled_from(["negative id", "length", "backwards", "huge length"]),
                                       label="defect")
                    if defect == "negative id" and commit:
                        commit[data.draw(st.integers(0, len(commit) - 1))] = data.draw(bad_tokens)
                    elif defect == "length":
                        claimed = max(claimed + data.draw(st.sampled_from([-1, 1, 5])), 0)
                        expected = {PRECONDITION} if claimed != length + len(commit) else None
                    elif defect == "backwards":
                        claimed = data.draw(st.integers(0, length))
                        expected = {PRECONDITION} if claimed != length + len(commit) else None
                    elif defect == "huge length":
                        claimed = 2**64 - 1
                        expected = {PRECONDITION}
                    else:
                        expected = None
                    kind = f"bad step ({defect})"
                else:
                    expected = None
                if expected is None:  # a good step
                    expected = {EXHAUSTED} if claimed > CONFIG.max_session_tokens else {OK}
                request = drafter_pb2.SessionRequest(step=drafter_pb2.Step(committed_token_ids=commit,
                                                                           committed_len=claimed))
            outcome = portal.call(_answer, call, request)
            code = OK if isinstance(outcome, drafter_pb2.SessionResponse) else outcome
            trace.append(f"{kind}: {code.name}")
            assert code in expected, f"{trace}: expected {expected}"
            if code != OK:
                return trace
            length += len(commit)
            check_draft(outcome.draft, length, k, trace)
        return trace
    finally:
        portal.call(_cancel, call)


def fuzz(drafter, check, examples: int) -> list[list[str]]:
    """Runs `check(portal, stub, data)` on `examples` generated examples; returns their traces."""
    portal, state = drafter
    traces = []

    @fuzz_settings(examples)
    @given(data=st.data())
    def run(data):
        traces.append(check(portal, state.stub, data))

    run()
    return traces


def test_sessions(drafter):
    portal, state = drafter
    traces = fuzz(drafter, check_session, 300)
    wait_for(lambda: state.witness_runs >= 2, what="witness runs")
    assert not state.witness_failures, state.witness_failures
    steps = collections.Counter(step.split(":")[0] for trace in traces for step in trace[1:])
    assert steps["step"] > len(traces) / 2, steps  # sessions got past their first steps
    # Only the witness's sessions may still be open.
    wait_for(lambda: portal.call(_active_requests, state.engine) <= 1, what="fuzzed sessions ended")


async def _active_requests(engine: DraftEngine) -> int:
    return len(engine.core.active_requests())


# -- many sessions on one Drafter.Sessions stream ----------------------------------------------------------------

async def _open_sessions(stub):
    return stub.Sessions()


async def _exchange(call, request, reply: bool):
    await call.write(request)
    return await asyncio.wait_for(call.read(), ANSWER_SECONDS) if reply else None


def check_sessions_stream(portal, stub, data) -> list[str]:
    """Messages of starts, steps (good and bad), ends and empty entries for a few session numbers;
    each answer (a draft, or the refusal that ended its session) is the one the contract names."""
    Entry = drafter_pb2.SessionsRequest.Entry  # noqa: N806 - a message class
    call = portal.call(_open_sessions, stub)
    open_sessions: dict[int, list] = {}  # number -> [committed length, k]
    trace = []
    try:
        for _ in range(data.draw(st.integers(1, 5), label="messages")):
            entries, refusals, stepped = [], [], {}  # stepped: number -> (length after, k, incarnation)
            for _ in range(data.draw(st.integers(1, 6), label="entries")):
                number = data.draw(st.integers(0, 3), label="session")
                kind = data.draw(st.sampled_from(["step"] * 4 + ["start"] * 2 + ["end", "empty", "bad step"]),
                                 label="kind")

                def refuse(code, number=number, refusals=refusals):
                    refusals.append((number, code))
                    open_sessions.pop(number, None)

                if kind == "start":
                    request, expected = data.draw(starts(), label="start")
                    entries.append(Entry(session=number, start=request.start))
                    if number in open_sessions:
                        refuse(INVALID)
                    elif expected != {OK}:
                        (code,) = expected
                        refuse(code)
                    else:
                        open_sessions[number] = [len(request.start.prompt_token_ids),
                                                 request.start.params.num_speculative_tokens]
                elif kind == "end":
                    entries.append(Entry(session=number, end=drafter_pb2.End()))
                    open_sessions.pop(number, None)
                elif kind == "empty":
                    entries.append(Entry(session=number))
                    refuse(INVALID)
                else:
                    commit = data.draw(st.lists(tokens, max_size=12), label="commit")
                    length = open_sessions.get(number, [0])[0]
                    claimed, code = length + len(commit), None
                    if kind == "bad step":
                        defect = data.draw(st.sampled_from(["negative id", "length", "huge length"]), label="defect")
                        if defect == "negative id":
                            commit.append(data.draw(bad_tokens))
                            claimed, code = claimed + 1, INVALID
                        else:
                            claimed, code = (claimed + 1, PRECONDITION) if defect == "length" else (2**64 - 1,
                                                                                                    PRECONDITION)
                    entries.append(Entry(session=number, step=drafter_pb2.Step(committed_token_ids=commit,
                                                                               committed_len=claimed)))
                    if number not in open_sessions or number in stepped:
                        refuse(INVALID)
                    elif code is not None:
                        refuse(code)
                    elif claimed > CONFIG.max_session_tokens:
                        refuse(EXHAUSTED)
                    else:
                        open_sessions[number][0] = claimed
                        stepped[number] = (claimed, open_sessions[number][1], id(open_sessions[number]))
            # Steps whose session ended (or was refused and started again) later in the message get no draft.
            drafted = {number: step for number, step in stepped.items()
                       if number in open_sessions and id(open_sessions[number]) == step[2]}
            reply = portal.call(_exchange, call, drafter_pb2.SessionsRequest(entries=entries),
                                bool(refusals or drafted))
            trace.append(f"{[e.WhichOneof('kind') for e in entries]} -> {len(refusals)} refused, {len(drafted)} drafts")
            if reply is None:
                continue
            assert [(a.session, CODES[a.code]) for a in reply.entries if a.code] == refusals, trace
            answered = {a.session: a.draft for a in reply.entries if not a.code}
            assert set(answered) == set(drafted), trace
            for number, (length, k, _) in drafted.items():
                check_draft(answered[number], length, k, trace)
        return trace
    finally:
        portal.call(_cancel, call)


def test_many_sessions_on_one_stream(drafter):
    portal, state = drafter
    traces = fuzz(drafter, check_sessions_stream, 200)
    assert not state.witness_failures, state.witness_failures
    assert sum("drafts" in line and not line.endswith(" 0 drafts") for trace in traces for line in trace) > 20
    wait_for(lambda: portal.call(_active_requests, state.engine) <= 1, what="fuzzed sessions ended")
