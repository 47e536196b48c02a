"""The OpenAI API's response bodies: chat and text completions as one JSON body or
as SSE chunks, usage summed over choices, and errors in OpenAI's shape."""

import contextlib
import dataclasses
import json
import time

import anyio
import structlog
from fastapi.responses import StreamingResponse

from gateway.assistant_stream import AssistantMessage, AssistantStream
from gateway.errors import InvalidRequest, ModelNotFound, NotFound, Overloaded, Unavailable
from gateway.openai_logprobs import TextLogprobs, chat_logprobs, merge_text_logprobs
from gateway.serving import ServingContext, TextDelta
from gateway.tool_calls import CallArguments, CallStart, ToolCallParser
from gateway.types import SpeculationUsage

log = structlog.get_logger()


@dataclasses.dataclass(frozen=True)
class ApiFlavor:
    """Where chat and text completions differ in their response bodies."""

    chat: bool
    id_prefix: str
    object: str
    chunk_object: str


CHAT = ApiFlavor(True, "chatcmpl", "chat.completion", "chat.completion.chunk")
TEXT = ApiFlavor(False, "cmpl", "text_completion", "text_completion")


class UsageTally:
    """Completion tokens and speculation usage summed over a request's choices."""

    def __init__(self, prompt_tokens: int):
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.cached_tokens = 0  # the prompt is counted once, so the most any choice found cached
        self.speculation = SpeculationUsage()

    def add(self, delta: TextDelta) -> None:
        self.completion_tokens += len(delta.token_ids)
        self.cached_tokens = max(self.cached_tokens, delta.cached_tokens)
        if delta.speculation is not None:
            self.speculation += delta.speculation

    def as_dict(self) -> dict:
        speculation = self.speculation
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
                # Prediction tokens the verifier checked: accepted ones are in the output, rejected ones not.
                "completion_tokens_details": {
                    "accepted_prediction_tokens": speculation.prediction_accepted_tokens,
                    "rejected_prediction_tokens": speculation.prediction_draft_tokens
                    - speculation.prediction_accepted_tokens},
                "speculation": {"draft_tokens": speculation.draft_tokens,
                                "accepted_tokens": speculation.accepted_tokens,
                                "verify_steps": speculation.verify_steps,
                                "drafter_steps": speculation.drafter_steps,
                                "head_steps": speculation.head_steps,
                                "next_round_steps": speculation.next_round_steps}}


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_for(ctx: ServingContext, error: Exception, shape=error_body) -> tuple[int, dict]:
    """HTTP status and error body for an exception (OpenAI's, or the `shape` of another API); counts it."""
    if isinstance(error, ModelNotFound):
        status, kind, code, label = 404, "invalid_request_error", "model_not_found", "model_not_found"
    elif isinstance(error, NotFound):
        status, kind, code, label = 404, "invalid_request_error", "not_found", "not_found"
    elif isinstance(error, InvalidRequest):
        status, kind, code, label = 400, "invalid_request_error", None, "invalid_request"
    elif isinstance(error, Overloaded):
        status, kind, code, label = 429, "rate_limit_error", "overloaded", "overloaded"
    elif isinstance(error, Unavailable):
        status, kind, code, label = 503, "service_unavailable_error", "verifier_unavailable", "unavailable"
    else:
        log.error("request failed", exc_info=error)
        ctx.metrics.record_error("internal")
        return 500, shape("Internal server error", "server_error")
    ctx.metrics.record_error(label)
    return status, shape(str(error), kind, error.param if isinstance(error, InvalidRequest) else None, code)


def reasoning_fields(reasoning: str) -> dict:
    """vLLM's current field and the DeepSeek convention many clients still read."""
    return {"reasoning": reasoning, "reasoning_content": reasoning} if reasoning else {}


def chunk_tool_calls(events: list) -> list[dict]:
    """A step's call events as OpenAI streams them: id and name first, then argument fragments."""
    entries = {}
    for event in events:
        if isinstance(event, CallStart):
            entries[event.index] = {"index": event.index, "id": event.id, "type": "function",
                                    "function": {"name": event.name, "arguments": ""}}
        elif isinstance(event, CallArguments):
            entry = entries.setdefault(event.index, {"index": event.index, "function": {"arguments": ""}})
            entry["function"]["arguments"] += event.delta
    return list(entries.values())


class _Choice:
    """One choice's output so far: its text split into reasoning, content and tool
    calls, and its logprobs in the flavor's shape."""

    def __init__(self, writer: "ResponseWriter", index: int):
        self.index = index
        self.chat = writer.flavor.chat
        self.tokenizer = writer.ctx.tokenizer
        self.want_logprobs = writer.logprobs
        self.output = (AssistantStream(writer.tool_parser, writer.ctx.reasoning_parser, writer.prompt_text)
                       if self.chat else AssistantStream())
        self.text_logprobs = TextLogprobs(self.tokenizer)

    def read(self, delta: TextDelta) -> dict:
        """The delta's part of the choice: content/text, reasoning, tool_calls, logprobs, finish_reason."""
        events, finish_reason = self.output.read(delta.text, delta.finish_reason)
        message = AssistantMessage()
        message.add(events)
        part = {"text": message.content, "reasoning": message.reasoning, "calls": message.calls,
                "tool_calls": chunk_tool_calls(events), "logprobs": None, "finish_reason": finish_reason}
        if self.want_logprobs:
            part["logprobs"] = (chat_logprobs(self.tokenizer, delta.token_ids, delta.logprobs) if self.chat
                                else self.text_logprobs.add(delta.token_ids, delta.logprobs))
        return part

    def whole(self, parts: list[dict]) -> dict:
        text = "".join(part["text"] for part in parts)
        calls = [call for part in parts for call in part["calls"]]
        logprobs = None
        if self.want_logprobs:
            logprobs = ({"content": [entry for part in parts for entry in part["logprobs"]]} if self.chat
                        else merge_text_logprobs([part["logprobs"] for part in parts]))
        if self.chat:
            message = {"role": "assistant", "content": text if text or not calls else None,
                       **reasoning_fields("".join(part["reasoning"] for part in parts))}
            if calls:
                message["tool_calls"] = [{"id": call.id, "type": "function",
                                          "function": {"name": call.name, "arguments": call.arguments}}
                                         for call in calls]
            body = {"message": message}
        else:
            body = {"text": text}
        return {"index": self.index, **body, "logprobs": logprobs, "finish_reason": parts[-1]["finish_reason"]}

    def chunk(self, part: dict) -> dict:
        if self.chat:
            delta = {"content": part["text"]} if part["text"] else {}
            delta.update(reasoning_fields(part["reasoning"]))
            if part["tool_calls"]:
                delta["tool_calls"] = part["tool_calls"]
            body = {"delta": delta}
        else:
            body = {"text": part["text"]}
        logprobs = {"content": part["logprobs"]} if self.chat and part["logprobs"] is not None else part["logprobs"]
        return {"index": self.index, **body, "logprobs": logprobs, "finish_reason": part["finish_reason"]}


@dataclasses.dataclass
class ResponseWriter:
    """Writes one request's response from its choices' deltas: a JSON body, or SSE chunks."""

    ctx: ServingContext
    flavor: ApiFlavor
    response_id: str
    n: int
    usage: UsageTally
    tool_parser: ToolCallParser | None = None  # set: tool calls are read from the output
    logprobs: bool = False
    prompt_text: str = ""  # the prompt's end: whether it opened a reasoning block
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.choices = [_Choice(self, index) for index in range(self.n)]

    def envelope(self, object_name: str, choices: list) -> dict:
        return {"id": self.response_id, "object": object_name, "created": self.created,
                "model": self.ctx.model_name, "choices": choices}

    async def body(self, events) -> dict:
        parts = [[] for _ in range(self.n)]
        async with contextlib.aclosing(events):
            async for index, delta in events:
                parts[index].append(self.choices[index].read(delta))
                self.usage.add(delta)
        choices = [choice.whole(parts[choice.index]) for choice in self.choices]
        return {**self.envelope(self.flavor.object, choices), "usage": self.usage.as_dict()}

    def event(self, choices: list, include_usage: bool, usage: dict | None = None) -> str:
        chunk = self.envelope(self.flavor.chunk_object, choices)
        if include_usage:
            chunk["usage"] = usage  # null on all but the last chunk, as OpenAI does
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    def delta_event(self, index: int, delta: TextDelta, include_usage: bool) -> str | None:
        self.usage.add(delta)
        part = self.choices[index].read(delta)
        if not (part["text"] or part["reasoning"] or part["tool_calls"] or part["finish_reason"]
                or (self.logprobs and delta.token_ids)):
            return None
        return self.event([self.choices[index].chunk(part)], include_usage)

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
