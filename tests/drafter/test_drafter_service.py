"""Drafter.Session through a real in-process gRPC server and channel."""

import asyncio
import contextlib
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from drafter_service import server
from drafter_service.config import DrafterConfig
from drafter_service.engine import DraftEngine
from drafter_service.metrics import DrafterMetrics
from drafter_service.service import DrafterServicer
from protos.conventions import CHANNEL_OPTIONS
from protos.drafter.v1 import drafter_pb2, drafter_pb2_grpc

REPEATED = [11, 12, 13, 14, 15]
CONFIG = DrafterConfig(max_tree_depth=24, max_cached_requests=100)
RESPONSE = list(range(100, 116))


@contextlib.asynccontextmanager
async def drafter(engine: DraftEngine | None = None, config: DrafterConfig = CONFIG,
                  metrics: DrafterMetrics | None = None):
    engine = engine or DraftEngine(config.max_tree_depth, config.max_cached_requests)
    metrics = metrics or DrafterMetrics(engine.core)
    grpc_server = grpc.aio.server()
    drafter_pb2_grpc.add_DrafterServicer_to_server(DrafterServicer(engine, config, metrics), grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    await grpc_server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as channel:
            yield drafter_pb2_grpc.DrafterStub(channel)
    finally:
        await grpc_server.stop(None)


def start(prompt, method=drafter_pb2.METHOD_SUFFIX, k=8, tenant="", lookahead=0, **params):
    return drafter_pb2.SessionRequest(start=drafter_pb2.Start(
        sequence_id="seq", prompt_token_ids=prompt, tenant=tenant, num_lookahead_tokens=lookahead,
        params=drafter_pb2.ProposerParams(method=method, num_speculative_tokens=k, **params)))


def step(tokens, committed_len, **budget):
    return drafter_pb2.SessionRequest(step=drafter_pb2.Step(committed_token_ids=tokens, committed_len=committed_len,
                                                            **budget))


async def run_session(stub, first, commits, metadata=None):
    """Sends start, then one step per commit (empty first step); returns the drafts, then half-closes."""
    call = stub.Session(metadata=metadata)
    await call.write(first)
    length = len(first.start.prompt_token_ids)
    drafts = []
    for tokens in commits:
        length += len(tokens)
        await call.write(step(tokens, length))
        drafts.append((await call.read()).draft)
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    return drafts


async def expect_error(stub, messages) -> grpc.StatusCode:
    call = stub.Session()
    with pytest.raises(grpc.aio.AioRpcError) as error:
        for message in messages:
            await call.write(message)
        await call.done_writing()
        while await call.read() != grpc.aio.EOF:
            pass
    return error.value.code()


def test_repetitive_sequence_gets_its_repeated_tokens():
    async def main():
        async with drafter() as stub:
            return await run_session(stub, start(REPEATED * 3, k=4), [[], [11, 12]])

    first, second = asyncio.run(main())
    assert list(first.token_ids) == [11, 12, 13, 14]
    assert first.committed_len == 15
    assert first.source == "suffix-request"
    assert list(second.token_ids) == [13, 14, 15, 11]
    assert second.committed_len == 17
    assert len(second.confidences) == 4 and second.score == pytest.approx(sum(second.confidences))
    assert list(second.parents) == []  # a chain


def test_ngram_session_drafts_by_prompt_lookup():
    async def main():
        async with drafter() as stub:
            return await run_session(stub, start([5, 6, 7, 8, 5, 6], drafter_pb2.METHOD_NGRAM, k=3,
                                                  prompt_lookup_min=2, prompt_lookup_max=3), [[]])

    (draft,) = asyncio.run(main())
    assert list(draft.token_ids) == [7, 8, 5]
    assert draft.source == "ngram"


@pytest.mark.parametrize("method", [drafter_pb2.METHOD_SUFFIX, drafter_pb2.METHOD_NGRAM])
def test_a_draft_goes_on_past_its_step_along_the_same_path(method):
    """After "1 2" a match of 2 gives a budget of 2 tokens; with lookahead the draft goes
    on along the same path (the step after matches 5 tokens, so its budget is 5) and
    marks where this step's draft ends. A lookup's draft goes on past k."""
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
    k = 2 if method == drafter_pb2.METHOD_NGRAM else 8

    async def main():
        async with drafter() as stub:
            extras = {"prompt_lookup_min": 2, "prompt_lookup_max": 2} if method == drafter_pb2.METHOD_NGRAM else {}
            return [(await run_session(stub, start(prompt, method, k=k, lookahead=lookahead, **extras), [[]]))[0]
                    for lookahead in (0, 6)]

    plain, ahead = asyncio.run(main())
    assert (list(plain.token_ids), plain.step_len) == ([3, 4], 0)
    assert list(ahead.token_ids) == [3, 4, 5, 6, 7, 8, 9, 1] and ahead.step_len == 2
    assert ahead.score == pytest.approx(plain.score) == pytest.approx(sum(ahead.confidences[:2]))


def test_a_draft_offers_detours_for_the_branches_it_did_not_take():
    """After "1 2" the prompt went on "3" twice and "6" once: the draft takes "3",
    and with lookahead it offers a detour for "6" there, whose draft follows "6"
    within the budget of the match it leaves ("1 2 6": 3 tokens), with its
    probabilities conditional on it (no branch after "6": all 1)."""
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 6, 7, 8, 1, 2]

    async def main():
        async with drafter() as stub:
            return [(await run_session(stub, start(prompt, k=4, lookahead=lookahead), [[]]))[0]
                    for lookahead in (0, 5)]

    plain, ahead = asyncio.run(main())
    assert not plain.detours
    assert list(ahead.token_ids[:2]) == [3, 4]
    [detour] = ahead.detours
    assert (detour.position, detour.token_id) == (0, 6)
    assert list(detour.token_ids) == [7, 8, 1] and list(detour.confidences) == [1, 1, 1]


@pytest.mark.parametrize("messages", [
    [step([1], 1)],
    [start([1, 2], lookahead=65)],
    [start([1, 2], method=drafter_pb2.METHOD_UNSPECIFIED)],
    [start([1, 2], method=7)],
    [start([1, 2], k=0)],
    [start([1, 2], k=65)],
    [start([1, 2], prompt_lookup_min=4, prompt_lookup_max=2)],
    [start([1, 2], min_token_prob=1.5)],
    [start([1, 2], max_tree_depth=32)],  # the drafter's trees are 24 deep, for every session
    [start([1, -2])],
    [start([1, 2]), step([-1], 3)],
    [start([1, 2]), step([3], 3, max_spec_factor=0)],
    [start([1, 2]), step([3], 3, max_spec_factor=float("nan"))],
    [start([1, 2]), step([3], 3, min_token_prob=-0.1)],
    [start([1, 2]), start([1, 2])],
    [start([1, 2]), drafter_pb2.SessionRequest()],
])
def test_bad_input_is_invalid_argument(messages):
    async def main():
        async with drafter() as stub:
            return await expect_error(stub, messages)

    assert asyncio.run(main()) == grpc.StatusCode.INVALID_ARGUMENT


def test_a_steps_budget_replaces_the_sessions_for_that_step_alone():
    """The gateway's planner sets the suffix budget by the verifier's load: a step's factor bounds its draft by
    the match's length, and its probability floor drops the unlikely tokens; the next step is the session's."""
    prompt = [*range(20, 40), 1, *range(20, 30)]  # its last 10 tokens match, followed by 30 .. 39

    async def drafts(*budgets):
        async with drafter() as stub:
            call = stub.Session()
            await call.write(start(prompt, k=16, max_spec_factor=1.0))
            out = []
            for budget in budgets:
                await call.write(step([], len(prompt), **budget))
                out.append(list((await call.read()).draft.token_ids))
            await call.done_writing()
            return out

    session, tight, after, floor = asyncio.run(drafts({}, {"max_spec_factor": 0.2}, {}, {"min_token_prob": 1.0}))
    assert session == list(range(30, 40)) == after
    assert tight == [30, 31]  # 0.2 x 10 matched tokens
    assert floor == []


def test_get_info_reports_the_server_wide_settings_and_bounds():
    async def main():
        config = DrafterConfig(max_tree_depth=32, max_cached_requests=7, max_cached_tokens=1000, share_tenants=True)
        async with drafter(config=config) as stub:
            return await stub.GetInfo(drafter_pb2.GetInfoRequest())

    info = asyncio.run(main())
    assert (info.max_tree_depth, info.max_cached_requests, info.max_cached_tokens) == (32, 7, 1000)
    assert info.share_tenants and info.max_speculative_tokens == 64
    assert set(info.methods) == {drafter_pb2.METHOD_SUFFIX, drafter_pb2.METHOD_NGRAM}


def test_committed_len_mismatch_is_failed_precondition():
    async def main():
        engine = DraftEngine(max_tree_depth=24, max_cached_requests=100)
        async with drafter(engine) as stub:
            code = await expect_error(stub, [start([1, 2, 3]), step([4, 5], 4)])
            return code, engine.core.active_requests()

    code, active = asyncio.run(main())
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert not active


def test_finished_session_teaches_later_sessions():
    async def main():
        async with drafter() as stub:
            await run_session(stub, start([1, 2, 3]), [RESPONSE[:6], RESPONSE[6:]])
            return await run_session(stub, start([7, 8, 9], max_spec_factor=2), [RESPONSE[:4]])

    (draft,) = asyncio.run(main())
    assert list(draft.token_ids) == RESPONSE[4:12]
    assert draft.source == "suffix-global"


def test_cancelled_session_ends_and_keeps_its_response():
    async def main():
        engine = DraftEngine(max_tree_depth=24, max_cached_requests=100)
        async with drafter(engine) as stub:
            call = stub.Session()
            await call.write(start([1, 2, 3]))
            await call.write(step(RESPONSE, 3 + len(RESPONSE)))
            await call.read()
            call.cancel()
            while engine.core.active_requests():
                await asyncio.sleep(0.01)
            (draft,) = await run_session(stub, start([7], max_spec_factor=2), [RESPONSE[:4]])
            return draft

    draft = asyncio.run(main())
    assert list(draft.token_ids) == RESPONSE[4:12]


def test_tenant_from_metadata_or_start_isolates_global_trees():
    async def main():
        async with drafter() as stub:
            await run_session(stub, start([1]), [RESPONSE], metadata=(("x-tenant-id", "a"),))
            other = await run_session(stub, start([7], tenant="b"), [RESPONSE[:4]], metadata=(("x-tenant-id", "a"),))
            shared = await run_session(stub, start([7]), [RESPONSE[:4]])
            same = await run_session(stub, start([7], tenant="a", max_spec_factor=2), [RESPONSE[:4]])
            return other[0], shared[0], same[0]

    other, shared, same = asyncio.run(main())
    assert list(other.token_ids) == [] and list(shared.token_ids) == []
    assert list(same.token_ids) == RESPONSE[4:12]


def test_server_run_reports_serving_and_drafts():
    async def main():
        loop = asyncio.get_running_loop()
        port = loop.create_future()
        task = asyncio.create_task(server.run(DrafterConfig(address="127.0.0.1:0"), ready=port.set_result))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{await port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest(service="speclane.drafter.v1.Drafter")
            while (await health.Check(request)).status != health_pb2.HealthCheckResponse.SERVING:
                await asyncio.sleep(0.01)
            drafts = await run_session(drafter_pb2_grpc.DrafterStub(channel), start(REPEATED * 2, k=3), [[]])
        signal.raise_signal(signal.SIGTERM)  # serve() drains and returns
        await task
        return drafts

    (draft,) = asyncio.run(main())
    assert list(draft.token_ids) == [11, 12, 13]


def test_config_validation():
    with pytest.raises(ValueError):
        DrafterConfig(address="nowhere")
    with pytest.raises(ValueError):
        DrafterConfig(max_tree_depth=0)
    with pytest.raises(ValueError):
        DrafterConfig(max_cached_requests=-1)


def entry(session, request):
    """A Sessions entry for one sequence's Session message (start or step)."""
    kind = request.WhichOneof("kind")
    return drafter_pb2.SessionsRequest.Entry(session=session, **{kind: getattr(request, kind)})


def test_many_sessions_on_one_stream_draft_as_each_on_its_own_and_answer_each_batch_in_one_message():
    prompts = [REPEATED * 3, [21, 22, 23, 24] * 3, REPEATED * 2]

    async def main():
        async with drafter() as stub:
            alone = [await run_session(stub, start(prompt, k=4), [[], [prompt[0], prompt[1]]]) for prompt in prompts]
        async with drafter() as stub:
            call = stub.Sessions()
            await call.write(drafter_pb2.SessionsRequest(entries=[
                *(entry(n, start(prompt, k=4)) for n, prompt in enumerate(prompts)),
                *(entry(n, step([], len(prompt))) for n, prompt in enumerate(prompts))]))
            first = await call.read()
            await call.write(drafter_pb2.SessionsRequest(entries=[
                entry(n, step(prompt[:2], len(prompt) + 2)) for n, prompt in enumerate(prompts)]))
            second = await call.read()
            await call.write(drafter_pb2.SessionsRequest(entries=[
                drafter_pb2.SessionsRequest.Entry(session=n, end=drafter_pb2.End()) for n in range(len(prompts))]))
            await call.done_writing()
            assert await call.read() == grpc.aio.EOF  # an end has no answer
            return alone, first, second

    alone, first, second = asyncio.run(main())
    for answers in (first, second):
        assert [answer.session for answer in answers.entries] == [0, 1, 2]
        assert not any(answer.code for answer in answers.entries)
    together = [[first.entries[n].draft, second.entries[n].draft] for n in range(len(prompts))]
    assert together == alone
    assert any(draft.token_ids for drafts in together for draft in drafts)


def test_a_refused_session_gets_an_entry_saying_why_and_the_others_go_on():
    config = DrafterConfig(max_tree_depth=24, max_cached_requests=100, max_sessions=1)

    async def main():
        async with drafter(config=config) as stub:
            call = stub.Sessions()
            await call.write(drafter_pb2.SessionsRequest(entries=[
                entry(0, start(REPEATED * 3, k=4)), entry(1, start(REPEATED, k=4)),  # over --max-sessions
                entry(2, start(REPEATED, k=999)),  # bad settings
                entry(0, step([], 15)), entry(3, step([], 5))]))  # a step of a session never started
            answers = await call.read()
            await call.done_writing()
            return answers

    answers = {answer.session: answer for answer in asyncio.run(main()).entries}
    assert answers[1].code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and "--max-sessions" in answers[1].detail
    assert answers[2].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert answers[3].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert answers[0].code == 0 and answers[0].draft.token_ids == [11, 12, 13, 14]


def test_a_session_ended_right_after_its_step_costs_the_stream_nothing():
    """A request cancelled while its step was on its way: the step and the end go out in one message.
    Nothing waits for that draft; the stream and its other sessions go on."""
    async def main():
        async with drafter() as stub:
            call = stub.Sessions()
            await call.write(drafter_pb2.SessionsRequest(entries=[
                entry(0, start(REPEATED * 3, k=4)), entry(1, start(REPEATED * 3, k=4))]))
            await call.write(drafter_pb2.SessionsRequest(entries=[
                entry(0, step([], 15)), drafter_pb2.SessionsRequest.Entry(session=0, end=drafter_pb2.End()),
                entry(1, step([], 15)), entry(1, step([11], 16))]))  # a second step in one message
            refused = await call.read()
            await call.write(drafter_pb2.SessionsRequest(entries=[entry(0, start(REPEATED * 3, k=4)),
                                                                  entry(0, step([], 15))]))
            after = await call.read()
            await call.done_writing()
            return refused, after

    refused, after = asyncio.run(main())
    # Session 1's second step ends it (one step per session per message); session 0's step gets no draft.
    assert [(a.session, a.code) for a in refused.entries] == [(1, grpc.StatusCode.INVALID_ARGUMENT.value[0])]
    assert [(a.session, a.code, list(a.draft.token_ids)) for a in after.entries] == [(0, 0, [11, 12, 13, 14])]
