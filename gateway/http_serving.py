"""What every HTTP front end (chat completions, Responses, Messages) shares:
running a request's generations, noticing a client that left, and who is asking."""

import asyncio
import contextlib

import anyio
from fastapi import Request

from gateway.auth import ApiKey
from gateway.errors import InvalidRequest
from gateway.serving import ServingContext, generate_text
from speclane.log import bind_request_id


async def choice_events(ctx: ServingContext, requests, stop_strings, caller: ApiKey | None):
    """(choice index, TextDelta) from the n generations as they come; holds n limiter slots."""
    with ctx.limiter.acquire(len(requests), caller):
        if len(requests) == 1:  # the common case needs no task and no queue
            async with contextlib.aclosing(generate_text(ctx, requests[0], stop_strings)) as deltas:
                async for delta in deltas:
                    yield 0, delta
            return
        queue = asyncio.Queue()

        async def pump(index, request):
            try:
                async for delta in generate_text(ctx, request, stop_strings):
                    queue.put_nowait((index, delta, None))
            except Exception as error:  # noqa: BLE001 - handed to the consumer, which raises it
                queue.put_nowait((index, None, error))

        tasks = [asyncio.create_task(pump(index, request)) for index, request in enumerate(requests)]
        try:
            unfinished = len(requests)
            while unfinished:
                index, delta, error = await queue.get()
                if error is not None:
                    raise error
                unfinished -= delta.finish_reason is not None
                yield index, delta
        finally:
            for task in tasks:
                task.cancel()  # closes the generations that are still running: downstream abort
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*tasks, return_exceptions=True)


async def unless_disconnected(request: Request, work):
    """Awaits coroutine `work`, cancelling it (and returning None) if the client goes away first."""

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        task.cancel()  # a no-op once done
        await asyncio.wait([task])
    return None if task.cancelled() else task.result()


def client_request_id(request: Request) -> str | None:
    """The caller's X-Request-Id if it can travel as gRPC metadata (printable ASCII, at most 256 chars)."""
    value = request.headers.get("x-request-id", "")
    return value if 0 < len(value) <= 256 and value.isascii() and value.isprintable() else None


def bind_request(request: Request, own_id: str) -> str:
    """The request's id, bound to every log line it causes: the caller's X-Request-Id (as vLLM
    honours it, so our logs on every service join its trace), else our own."""
    request_id = client_request_id(request) or own_id
    bind_request_id(request_id)
    return request_id


def request_caller(request: Request) -> ApiKey | None:
    """The key RequireApiKey authenticated the request with; None without keys."""
    return request.scope.get("state", {}).get("api_key")


def joined_text(content, where: str, types: tuple[str, ...], noun: str, separator: str) -> str:
    """A string, or the texts of a list of `noun`s whose type is one of `types`, joined
    (system prompts, tool results, message content); InvalidRequest naming the bad part."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or a list of {noun}s", where)
    texts = []
    for index, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in types or not isinstance(part.get("text"), str):
            raise InvalidRequest(f"{where}[{index}] must be a {noun} (type {' or '.join(types)}, with a text)",
                                 f"{where}.{index}")
        texts.append(part["text"])
    return separator.join(texts)
