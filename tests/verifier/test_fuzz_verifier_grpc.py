"""Fuzzing the verifier's Session API (issue 14), through the real servicer and
engine on a real in-process gRPC server with the tiny model.

Each example is one session: a prefill (often malformed: empty, negative, out of
range or too long prompts, sampling settings out of bounds or NaN, huge
max_new_tokens) and then verify steps drawn from what the session has committed so
far: chain and tree drafts, good and bad (bad parents, ids out of range,
proposals of the wrong length or with negative or NaN probabilities, stale
committed_len, too many nodes), second prefills and empty messages, and steps
after the sequence finished. The status that ends the session is the one the
contract names (INVALID_ARGUMENT / FAILED_PRECONDITION / RESOURCE_EXHAUSTED),
never UNKNOWN or INTERNAL, and no answer takes more than a few seconds.

Meanwhile a witness session runs greedy sequences again and again on the same
engine (sharing its forward passes) and must get the reference output every time;
afterwards no sequence and no KV block is left behind.
"""

import asyncio
import contextlib
import dataclasses
import math

import grpc
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from protos.common.v1 import common_pb2
from protos.conventions import CHANNEL_OPTIONS
from protos.verifier.v1 import verifier_pb2, verifier_pb2_grpc
from tests.fuzz_support import fuzz_settings, serving, wait_for
from verifier_service.async_engine import AsyncEngine
from verifier_service.model_runner import ModelRunner
from verifier_service.scheduler import BatchLimits
from verifier_service.service import VerifierServicer, add_to_server

from .conftest import BLOCK, MAX_CONTEXT, VOCAB, make_engine

KV_TOKENS = 7 * BLOCK  # below the context: a long prompt can be too big for the KV budget but not the model
MAX_DRAFT_TOKENS = 64  # the servicer's --max-draft-tokens
ANSWER_SECONDS = 10.0  # any answer slower than this is a hang
INVALID, PRECONDITION, EXHAUSTED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                                    grpc.StatusCode.RESOURCE_EXHAUSTED)
WITNESS_PROMPT = [5, 17, 9, 40, 22, 8, 31]
WITNESS_SAMPLING = verifier_pb2.SamplingParams(max_new_tokens=12, ignore_eos=True)


@dataclasses.dataclass
class Verifier:
    stub: verifier_pb2_grpc.VerifierStub
    engine: AsyncEngine
    reference: list[int]  # the witness's greedy output, run alone
    witness_runs: int = 0
    witness_failures: list = dataclasses.field(default_factory=list)


async def run_witness(stub, reference: list[int] | None) -> list[int]:
    """One greedy sequence: half its drafts right (the reference's next tokens), half wrong."""
    call = stub.Session()
    await call.write(verifier_pb2.SessionRequest(prefill=verifier_pb2.Prefill(
        sequence_id="witness", prompt_token_ids=WITNESS_PROMPT, sampling=WITNESS_SAMPLING)))
    answer = await asyncio.wait_for(call.read(), ANSWER_SECONDS)
    output = list(answer.token_ids)
    step = 0
    while answer.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
        step += 1
        draft = []
        if reference is not None:
            draft = reference[len(output):len(output) + 3]
            if step % 2:
                draft = [(token + 1) % VOCAB for token in draft]
        await call.write(verifier_pb2.SessionRequest(verify=verifier_pb2.Verify(draft=common_pb2.Draft(
            token_ids=draft, committed_len=len(WITNESS_PROMPT) + len(output)))))
        answer = await asyncio.wait_for(call.read(), ANSWER_SECONDS)
        output += answer.token_ids
    await call.done_writing()
    return output


@contextlib.asynccontextmanager
async def running_verifier(model_dir: str):
    def load():
        runner = ModelRunner(model_dir, "cpu", torch.float32)
        return make_engine(runner, max_kv_tokens=KV_TOKENS, limits=BatchLimits(max_queue_wait=10.0))

    engine = AsyncEngine(load, threads=1)
    await engine.start()
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    add_to_server(server, VerifierServicer(engine, "tiny", model_dir, max_draft_tokens=MAX_DRAFT_TOKENS))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as channel:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            verifier = Verifier(stub, engine, await run_witness(stub, None))
            stop = asyncio.Event()

            async def witness():
                while not stop.is_set():
                    try:
                        output = await run_witness(stub, verifier.reference)
                    except Exception as error:  # noqa: BLE001 - recorded; the test fails on it
                        verifier.witness_failures.append(repr(error))
                        await asyncio.sleep(0.05)
                        continue
                    verifier.witness_runs += 1
                    if output != verifier.reference:
                        verifier.witness_failures.append(f"output {output} != reference {verifier.reference}")

            task = asyncio.ensure_future(witness())
            try:
                yield verifier
            finally:
                stop.set()
                await asyncio.wait_for(task, 60)
    finally:
        await server.stop(None)
        await engine.stop()


@pytest.fixture(scope="module")
def verifier(tiny_model_dir):
    with serving(lambda: running_verifier(tiny_model_dir)) as (portal, verifier):
        yield portal, verifier


# -- what to send ------------------------------------------------------------------------------------------------

good_tokens = st.integers(0, VOCAB - 1)
bad_tokens = st.sampled_from([-1, -2**31, VOCAB, VOCAB + 1, 2**31 - 1])
floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True)


def optional(strategy):
    return st.none() | strategy


@st.composite
def prompts(draw) -> tuple[list[int], bool]:
    """(prompt, whether its ids are all in the vocabulary)."""
    length = draw(st.sampled_from([0, 1, 2, 7, 30, KV_TOKENS - 1, KV_TOKENS + 1, MAX_CONTEXT - 1, MAX_CONTEXT,
                                   MAX_CONTEXT + 40]) | st.integers(1, 12))
    prompt = draw(st.lists(good_tokens, min_size=length, max_size=length))
    if prompt and draw(st.sampled_from([False] * 7 + [True])):
        prompt[draw(st.integers(0, len(prompt) - 1))] = draw(bad_tokens)
        return prompt, False
    return prompt, True


# Each field: (values within the contract's bounds, any values, whether a value is within the bounds).
SAMPLING_FIELDS = {
    "temperature": (st.sampled_from([0.0, 0.7, 1.0, 2.0, 1e-30, 1e30]), floats32, lambda v: 0 <= v < math.inf),
    "top_p": (st.sampled_from([1e-30, 0.5, 1.0]), floats32, lambda v: 0 < v <= 1),
    "top_k": (st.sampled_from([0, 1, 5, VOCAB, VOCAB + 1, 2**31 - 1]), st.integers(-2**31, 2**31 - 1),
              lambda v: v >= 0),
    "seed": (st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), lambda v: True),
    "presence_penalty": (st.sampled_from([0.5, -2.0, 2.0]), floats32, lambda v: -2 <= v <= 2),
    "frequency_penalty": (st.sampled_from([0.5, -2.0, 2.0]), floats32, lambda v: -2 <= v <= 2),
    "repetition_penalty": (st.sampled_from([1e-30, 0.5, 1.0, 1.3, 2.0]), floats32, lambda v: 0 < v <= 2),
    "min_p": (st.sampled_from([0.0, 0.1, 1.0]), floats32, lambda v: 0 <= v <= 1),
    "logprobs": (st.sampled_from([0, 1, 20]), st.integers(0, 2**32 - 1), lambda v: v <= 20),
    # The tiny model has no tokenizer, so no grammar compiles (an empty one is none at all).
    "grammar": (st.just(""), st.sampled_from(['start: "yes" | "no"', "start: %json {}", "((("]), lambda v: not v),
}
bias_values = st.sampled_from([1.0, -100.0, 100.0])


@st.composite
def samplings(draw) -> tuple[verifier_pb2.SamplingParams, bool]:
    """(sampling params, whether they are within bounds): within them three times in four."""
    any_values = draw(st.sampled_from([False, False, False, True]))
    sampling = verifier_pb2.SamplingParams(
        max_new_tokens=draw(st.sampled_from([12, 5, 2**32 - 1, 2, 1]) | st.integers(1 - any_values, 20)),
        ignore_eos=draw(st.booleans()), min_tokens=draw(st.sampled_from([0, 0, 1, 3] + [30] * any_values)))
    valid = sampling.max_new_tokens >= 1 and sampling.min_tokens <= sampling.max_new_tokens
    for name in draw(st.lists(st.sampled_from(sorted(SAMPLING_FIELDS)), max_size=4, unique=True)):
        good, anything, in_bounds = SAMPLING_FIELDS[name]
        setattr(sampling, name, draw(good | anything if any_values else good))
        valid = valid and in_bounds(getattr(sampling, name))  # as float32 makes it
    tokens = good_tokens | bad_tokens if any_values else good_tokens
    for token in draw(st.lists(tokens, max_size=2)):
        sampling.stop_token_ids.append(token)
        valid = valid and 0 <= token < VOCAB
    for token, bias in draw(st.dictionaries(tokens, bias_values | floats32 if any_values else bias_values,
                                            max_size=2)).items():
        sampling.logit_bias[token] = bias
        valid = valid and 0 <= token < VOCAB and -100 <= sampling.logit_bias[token] <= 100
    return sampling, valid


def chain_or_tree(draw, k: int) -> list[int]:
    """Parents of a well-formed draft of k nodes: empty (a chain), a chain spelled out, or a random tree."""
    kind = draw(st.sampled_from(["chain", "explicit chain", "tree"]))
    if kind == "chain" or k == 0:
        return []
    if kind == "explicit chain":
        return list(range(-1, k - 1))
    return [draw(st.integers(-1, i - 1)) for i in range(k)]


BAD_DRAFTS = ["token out of range", "self parent", "forward parent", "parent below -1", "parent out of range",
              "cycle", "parents length", "proposals length", "proposal ids and probs", "negative prob", "NaN prob",
              "proposal without the token", "too many nodes"]


@st.composite
def drafts(draw) -> tuple[common_pb2.Draft, str, object]:
    """(draft, what is wrong with it ("" when nothing is), its committed_len: 0 (untagged), "right" (the
    session's length when it is sent), or an offset from it or a number (stale))."""
    k = draw(st.integers(0, 6))
    tokens = draw(st.lists(good_tokens, min_size=k, max_size=k))
    parents = chain_or_tree(draw, k)
    draft = common_pb2.Draft(token_ids=tokens, parents=parents)
    tag = draw(st.sampled_from([0, "right"]))
    if k and draw(st.booleans()):  # proposals: a sparse q per node that gives its token mass
        for token in tokens:
            draft.proposals.add(token_ids=[token, (token + 1) % VOCAB], probs=[0.7, 0.3])
    defect = draw(st.sampled_from([""] * len(BAD_DRAFTS) + ["stale", *BAD_DRAFTS]))  # half of them good
    if defect == "stale":
        tag = draw(st.sampled_from([("offset", -1), ("offset", 1), ("length", 1), ("length", 2**64 - 1)]))
    elif defect == "too many nodes":
        del draft.parents[:]
        draft.token_ids[:] = [1] * (MAX_DRAFT_TOKENS + 1)
        del draft.proposals[:]
    elif defect == "token out of range" and k:
        draft.token_ids[draw(st.integers(0, k - 1))] = draw(bad_tokens)
    elif defect == "self parent" and k:
        at = draw(st.integers(0, k - 1))
        draft.parents[:] = parents or list(range(-1, k - 1))
        draft.parents[at] = at
    elif defect == "forward parent" and k >= 2:
        draft.parents[:] = parents or list(range(-1, k - 1))
        at = draw(st.integers(0, k - 2))
        draft.parents[at] = draw(st.integers(at + 1, k - 1))
    elif defect == "parent below -1" and k:
        draft.parents[:] = parents or list(range(-1, k - 1))
        draft.parents[draw(st.integers(0, k - 1))] = draw(st.integers(-2**31, -2))
    elif defect == "parent out of range" and k:
        draft.parents[:] = parents or list(range(-1, k - 1))
        draft.parents[draw(st.integers(0, k - 1))] = draw(st.integers(k, 2**31 - 1))
    elif defect == "cycle" and k >= 2:
        draft.parents[:] = [1, 0, *range(1, k - 1)]  # 0 -> 1 -> 0
    elif defect == "parents length" and k:
        draft.parents[:] = [-1] * draw(st.sampled_from([k - 1, k + 1])) if k > 1 else [-1, -1]
    elif defect == "proposals length" and k:
        del draft.proposals[:]
        for i in range(draw(st.sampled_from([k - 1, k + 1])) if k > 1 else 2):
            draft.proposals.add(token_ids=[tokens[i % k]], probs=[1.0])
    elif defect in ("proposal ids and probs", "negative prob", "NaN prob", "proposal without the token") and k:
        del draft.proposals[:]
        for token in tokens:
            draft.proposals.add(token_ids=[token], probs=[1.0])
        bad = draft.proposals[draw(st.integers(0, k - 1))]
        if defect == "proposal ids and probs":
            bad.probs.append(0.5)
        elif defect == "negative prob":
            bad.probs[0] = -0.5
        elif defect == "NaN prob":
            bad.probs[0] = draw(st.sampled_from([math.nan, math.inf]))
        else:
            bad.token_ids[0] = (bad.token_ids[0] + 1) % VOCAB
    else:
        defect = ""  # a defect this draft is too small for
    return draft, defect, tag


def tagged(draft: common_pb2.Draft, defect: str, tag, committed: int) -> tuple[common_pb2.Draft, str]:
    """The draft with its committed_len for a session of `committed` tokens, and its defect."""
    if tag == "right":
        draft.committed_len = committed
    elif tag:
        kind, value = tag
        draft.committed_len = max(committed + value, 0) if kind == "offset" else value
        if draft.committed_len == committed:
            defect = ""  # stale by chance no more
    return draft, defect


def expected_prefill(prompt: list[int], ids_ok: bool, sampling_ok: bool) -> set:
    if not prompt or not ids_ok or not sampling_ok or len(prompt) >= MAX_CONTEXT:
        return {INVALID}
    if len(prompt) > KV_TOKENS:
        return {EXHAUSTED}  # can never fit the KV budget
    return {grpc.StatusCode.OK}


async def answer(call, request):
    """Writes `request` and reads its answer: a response, or the status that ended the stream."""
    try:
        await call.write(request)
        return await asyncio.wait_for(call.read(), ANSWER_SECONDS)
    except grpc.aio.AioRpcError as error:
        return error.code()
    except asyncio.InvalidStateError:  # written after the server ended the stream: its status tells why
        return await call.code()


STEP_KINDS = st.sampled_from(["verify"] * 6 + ["second prefill", "empty"])


class Stream:
    """A Session stream on the server's loop, driven from the test's thread (hypothesis draws there)."""

    def __init__(self, portal, stub):
        self.portal = portal
        self.call = portal.call(_open, stub)

    def answer(self, request):
        return self.portal.call(answer, self.call, request)

    def cancel(self):
        self.portal.call(_cancel, self.call)


async def _open(stub):
    return stub.Session()


async def _cancel(call):
    call.cancel()


def check_session(portal, stub, data) -> list[str]:
    """Runs one drawn session; returns what happened, step by step. All of it is drawn before it
    runs: what the server answers (sampled tokens, when a sequence finishes) never changes what is
    drawn, so hypothesis can replay it."""
    prompt, ids_ok = data.draw(prompts(), label="prompt")
    sampling, sampling_ok = data.draw(samplings(), label="sampling")
    first_kind = data.draw(st.sampled_from(["prefill"] * 8 + ["verify first", "empty first"]), label="first")
    sequence_id = data.draw(st.text(max_size=8), label="sequence_id")
    plan = [(kind, data.draw(drafts(), label="draft") if kind == "verify" else None)
            for kind in data.draw(st.sampled_from([5, 3, 6, 1, 2, 4]).flatmap(
                lambda steps: st.lists(STEP_KINDS, min_size=steps, max_size=steps)), label="steps")]
    call = Stream(portal, stub)
    try:
        if first_kind == "prefill":
            request = verifier_pb2.SessionRequest(prefill=verifier_pb2.Prefill(
                sequence_id=sequence_id, prompt_token_ids=prompt, sampling=sampling))
            expected = expected_prefill(prompt, ids_ok, sampling_ok)
        else:
            request = verifier_pb2.SessionRequest(verify=verifier_pb2.Verify()) if first_kind == "verify first" \
                else verifier_pb2.SessionRequest()
            expected = {INVALID}
        outcome = call.answer(request)
        code = grpc.StatusCode.OK if isinstance(outcome, verifier_pb2.SessionResponse) else outcome
        trace = [f"{first_kind}: {code.name}"]
        assert code in expected, f"{trace}: expected {expected}"
        if code != grpc.StatusCode.OK:
            return trace
        committed = len(prompt) + len(outcome.token_ids)
        finished = outcome.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
        # A sequence that outgrows the KV budget may be refused more room.
        may_exhaust = min(len(prompt) + sampling.max_new_tokens, MAX_CONTEXT) > KV_TOKENS
        for kind, drawn in plan:
            defect = ""
            if kind == "verify":
                draft, defect = tagged(*drawn, committed)
                request = verifier_pb2.SessionRequest(verify=verifier_pb2.Verify(draft=draft))
            elif kind == "second prefill":
                request = verifier_pb2.SessionRequest(prefill=verifier_pb2.Prefill(prompt_token_ids=[1]))
            else:
                request = verifier_pb2.SessionRequest()
            outcome = call.answer(request)
            code = grpc.StatusCode.OK if isinstance(outcome, verifier_pb2.SessionResponse) else outcome
            trace.append(f"{kind} {defect or 'good'}{' (finished)' if finished else ''}: {code.name}")
            if kind != "verify" or defect == "too many nodes":  # the nodes are counted on the message, first
                expected = {INVALID}
            elif finished or defect == "stale":  # a finished sequence is refused before its draft is read
                expected = {PRECONDITION}
            elif defect:
                expected = {INVALID}
            else:
                expected = {grpc.StatusCode.OK} | ({EXHAUSTED} if may_exhaust else set())
            assert code in expected, f"{trace}: expected {expected}"
            if code != grpc.StatusCode.OK:
                return trace
            assert outcome.committed_len == committed + len(outcome.token_ids), trace
            assert 1 <= len(outcome.token_ids) <= len(draft.token_ids) + 1, trace
            committed = outcome.committed_len
            finished = outcome.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
        return trace
    finally:
        call.cancel()


def test_sessions(verifier):
    portal, state = verifier
    traces = []

    @fuzz_settings(300)
    @given(data=st.data())
    def run(data):
        traces.append(check_session(portal, state.stub, data))

    run()
    wait_for(lambda: portal.call(state.engine.num_live) <= 1, what="fuzzed sequences freed")  # 1: the witness
    assert state.witness_runs > 0 and not state.witness_failures, state.witness_failures
    assert any(len(trace) > 2 for trace in traces)  # sessions got past their first steps


def test_nothing_is_left_behind(verifier):
    portal, state = verifier
    wait_for(lambda: state.witness_runs > 0)

    async def load():
        return await state.stub.GetLoad(verifier_pb2.GetLoadRequest())

    # Only the witness may hold KV: at most one sequence, within its blocks.
    wait_for(lambda: (lambda load: load.num_running <= 1 and load.num_waiting == 0
                      and load.kv_used_tokens <= 2 * BLOCK)(portal.call(load)), what="KV freed")
    assert not state.witness_failures, state.witness_failures
