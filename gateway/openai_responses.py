"""The OpenAI API's response bodies: chat and text completions as one JSON body or
as SSE chunks, usage summed over choices, and errors in OpenAI's shape."""

import contextlib
import dataclasses
import json
import time

import anyio
import structlog
from fastapi.responses import StreamingResponse

from gateway.errors import InvalidRequest, ModelNotFound, Overloaded, Unavailable
from gateway.serving import ServingContext, TextDelta
from gateway.types import SpeculationUsage

log = structlog.get_logger()


@dataclasses.dataclass(frozen=True)
class ApiFlavor:
    """Where chat and text completions differ in their response bodies."""

    chat: bool
    id_prefix: str
    object: str
    chunk_object: str

    def choice(self, index: int, text: str, finish_reason: str | None) -> dict:
        body = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        return {"index": index, **body, "logprobs": None, "finish_reason": finish_reason}

    def chunk_choice(self, index: int, text: str, finish_reason: str | None) -> dict:
        body = {"delta": {"content": text} if text else {}} if self.chat else {"text": text}
        return {"index": index, **body, "logprobs": None, "finish_reason": finish_reason}


CHAT = ApiFlavor(True, "chatcmpl", "chat.completion", "chat.completion.chunk")
TEXT = ApiFlavor(False, "cmpl", "text_completion", "text_completion")


class UsageTally:
    """Completion tokens and speculation usage summed over a request's choices."""

    def __init__(self, prompt_tokens: int):
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.speculation = SpeculationUsage()

    def add(self, delta: TextDelta) -> None:
        self.completion_tokens += len(delta.token_ids)
        if delta.speculation is not None:
            self.speculation += delta.speculation

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "speculation": dataclasses.asdict(self.speculation)}


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_for(ctx: ServingContext, error: Exception) -> tuple[int, dict]:
    """HTTP status and OpenAI error body for an exception; counts it."""
    if isinstance(error, ModelNotFound):
        status, kind, code, label = 404, "invalid_request_error", "model_not_found", "model_not_found"
    elif isinstance(error, InvalidRequest):
        status, kind, code, label = 400, "invalid_request_error", None, "invalid_request"
    elif isinstance(error, Overloaded):
        status, kind, code, label = 429, "rate_limit_error", "overloaded", "overloaded"
    elif isinstance(error, Unavailable):
        status, kind, code, label = 503, "service_unavailable_error", "verifier_unavailable", "unavailable"
    else:
        log.error("request failed", exc_info=error)
        ctx.metrics.record_error("internal")
        return 500, error_body("Internal server error", "server_error")
    ctx.metrics.record_error(label)
    return status, error_body(str(error), kind, error.param if isinstance(error, InvalidRequest) else None, code)


@dataclasses.dataclass
class ResponseWriter:
    """Writes one request's response from its choices' deltas: a JSON body, or SSE chunks."""

    ctx: ServingContext
    flavor: ApiFlavor
    response_id: str
    n: int
    usage: UsageTally
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def envelope(self, object_name: str, choices: list) -> dict:
        return {"id": self.response_id, "object": object_name, "created": self.created,
                "model": self.ctx.model_name, "choices": choices}

    async def body(self, events) -> dict:
        texts, finish_reasons = [[] for _ in range(self.n)], [None] * self.n
        async with contextlib.aclosing(events):
            async for index, delta in events:
                texts[index].append(delta.text)
                finish_reasons[index] = delta.finish_reason
                self.usage.add(delta)
        choices = [self.flavor.choice(index, "".join(texts[index]), finish_reasons[index])
                   for index in range(self.n)]
        return {**self.envelope(self.flavor.object, choices), "usage": self.usage.as_dict()}

    def event(self, choices: list, include_usage: bool, usage: dict | None = None) -> str:
        chunk = self.envelope(self.flavor.chunk_object, choices)
        if include_usage:
            chunk["usage"] = usage  # null on all but the last chunk, as OpenAI does
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    def delta_event(self, index: int, delta: TextDelta, include_usage: bool) -> str | None:
        self.usage.add(delta)
        if not (delta.text or delta.finish_reason):
            return None
        return self.event([self.flavor.chunk_choice(index, delta.text, delta.finish_reason)], include_usage)

    async def events(self, first: tuple[int, TextDelta], events, include_usage: bool):
        async with contextlib.aclosing(events):
            try:
                if self.flavor.chat:
                    for index in range(self.n):
                        yield self.event([{"index": index, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}], include_usage)
                if chunk := self.delta_event(*first, include_usage):
                    yield chunk
                async for index, delta in events:
                    if chunk := self.delta_event(index, delta, include_usage):
                        yield chunk
                if include_usage:
                    yield self.event([], include_usage, self.usage.as_dict())
            except Exception as error:  # noqa: BLE001 - headers are gone: report in-band, as OpenAI and vLLM do
                yield f"data: {json.dumps(error_for(self.ctx, error)[1])}\n\n"
        yield "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Starlette leaves the body iterator suspended when the client goes
            # away; closing it cancels the generations and frees their slots.
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
