"""The drafter's limits: open sessions (--max-sessions) and tokens per session
(--max-session-tokens), refused with RESOURCE_EXHAUSTED (the gateway then drafts
nothing for that request), which together bound its memory; and a gRPC message
over the limit is refused, not a crash."""

import asyncio
import contextlib
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from drafter_service import server
from drafter_service.config import DrafterConfig
from drafter_service.engine import DraftEngine
from protos.conventions import MESSAGE_LIMIT_BYTES
from protos.drafter.v1 import drafter_pb2, drafter_pb2_grpc
from tests.drafter.test_drafter_service import REPEATED, drafter, run_session, start, step

LIMITS = DrafterConfig(max_tree_depth=24, max_cached_requests=100, max_sessions=2, max_session_tokens=64)


async def open_session(stub, prompt):
    """A session that has started and answered one step: registered with the engine."""
    call = stub.Session()
    await call.write(start(prompt))
    await call.write(step([], len(prompt)))
    await call.read()
    return call


async def close(call) -> None:
    """Half-closes a session and waits for its end: the drafter has let it go."""
    await call.done_writing()
    while await call.read() != grpc.aio.EOF:
        pass


async def refusal(stub, messages) -> grpc.aio.AioRpcError:
    """The status a refused session ends with. The server may end the call before the
    client's next write, which then fails locally: the call's own status is the answer."""
    call = stub.Session()
    with pytest.raises((grpc.aio.AioRpcError, asyncio.InvalidStateError)):
        for message in messages:
            await call.write(message)
        await close(call)
    return grpc.aio.AioRpcError(await call.code(), await call.initial_metadata(), await call.trailing_metadata(),
                                await call.details())


def test_sessions_beyond_max_sessions_are_refused_until_one_ends():
    async def main():
        engine = DraftEngine(LIMITS.max_tree_depth, LIMITS.max_cached_requests)
        async with drafter(engine, LIMITS) as stub:
            first, second = await open_session(stub, [1, 2]), await open_session(stub, [3, 4])
            full = await refusal(stub, [start([5, 6])])
            assert (await stub.GetInfo(drafter_pb2.GetInfoRequest())).max_tree_depth == 24  # still answers
            await close(first)
            drafts = await run_session(stub, start(REPEATED * 2, k=3), [[]])
            await close(second)
            return full, drafts

    full, (draft,) = asyncio.run(main())
    assert full.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert full.details() == "the drafter has its maximum of 2 sessions open (--max-sessions)"
    assert list(draft.token_ids) == [11, 12, 13]


def test_a_flood_of_long_prompts_cannot_grow_memory():
    async def main():
        engine = DraftEngine(LIMITS.max_tree_depth, LIMITS.max_cached_requests)
        async with drafter(engine, LIMITS) as stub:
            too_long = [await refusal(stub, [start(list(range(65)))]) for _ in range(20)]
            assert engine.core.active_requests() == [] and engine.core.memory_bytes() == baseline
            held = [await open_session(stub, list(range(100, 164))) for _ in range(2)]
            holding = engine.core.memory_bytes()
            flood = [await refusal(stub, [start(list(range(64)))]) for _ in range(20)]
            assert engine.core.memory_bytes() == holding  # nothing of the flood reached the core
            for call in held:
                await close(call)
            return too_long, flood

    baseline = DraftEngine(LIMITS.max_tree_depth, LIMITS.max_cached_requests).core.memory_bytes()
    too_long, flood = asyncio.run(main())
    assert {error.code() for error in too_long + flood} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert too_long[0].details() == ("the prompt has 65 tokens; a drafter session holds at most 64 "
                                     "(--max-session-tokens)")
    assert "--max-sessions" in flood[0].details()


def test_a_session_growing_past_its_token_limit_ends_and_frees_its_place():
    config = DrafterConfig(max_tree_depth=24, max_cached_requests=100, max_sessions=1, max_session_tokens=8)

    async def main():
        engine = DraftEngine(config.max_tree_depth, config.max_cached_requests)
        async with drafter(engine, config) as stub:
            ended = await refusal(stub, [start([1, 2, 3]), step([4, 5, 6, 7, 8], 8), step([9], 9)])
            return ended, await run_session(stub, start([1, 2, 3]), [[]])  # its place is free again

    ended, drafts = asyncio.run(main())
    assert ended.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limit of 8 tokens (--max-session-tokens)" in ended.details()
    assert len(drafts) == 1


def test_config_refuses_limits_below_one():
    for field in ("max_sessions", "max_session_tokens"):
        with pytest.raises(ValueError, match=field):
            DrafterConfig(**{field: 0})


def test_a_message_over_the_grpc_limit_is_refused_and_the_server_goes_on():
    config = DrafterConfig(address="127.0.0.1:0", max_sessions=1)

    async def main():
        port = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(server.run(config, ready=port.set_result))
        try:
            # A channel without our options: no limit on what it sends.
            async with grpc.aio.insecure_channel(f"127.0.0.1:{await port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)
                request = health_pb2.HealthCheckRequest(service="speclane.drafter.v1.Drafter")
                while (await health.Check(request)).status != health_pb2.HealthCheckResponse.SERVING:
                    await asyncio.sleep(0.01)
                stub = drafter_pb2_grpc.DrafterStub(channel)
                huge = drafter_pb2.SessionRequest(start=drafter_pb2.Start(sequence_id="x" * (MESSAGE_LIMIT_BYTES + 1)))
                oversized = await refusal(stub, [huge])
                held = await open_session(stub, [1, 2])  # the one session --max-sessions allows
                full = await refusal(stub, [start([3])])
                # Health answers however full the drafter is: it counts sessions, not RPCs.
                serving = (await health.Check(request)).status
                await close(held)
                drafts = await run_session(stub, start(REPEATED * 2, k=3), [[]])
        finally:
            signal.raise_signal(signal.SIGTERM)  # serve() drains and returns
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return oversized, full, serving, drafts

    oversized, full, serving, (draft,) = asyncio.run(main())
    assert oversized.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert full.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-sessions" in full.details()
    assert serving == health_pb2.HealthCheckResponse.SERVING
    assert list(draft.token_ids) == [11, 12, 13]
