"""The Anthropic Messages API (/v1/messages and /v1/messages/count_tokens), which
Claude-Code-style clients speak: its requests translated into the chat prompt,
tools and sampling of the serving layer, and its response body and event
stream written from the shared output stream (gateway/assistant_stream.py).
The routes at the end are thin adapters."""

import dataclasses
import json
import uuid
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from gateway.assistant_stream import AssistantStream
from gateway.auth import tenant_for
from gateway.chat_template import ChatPrompt, render_chat
from gateway.errors import InvalidRequest, ModelNotFound
from gateway.http_serving import (
    bind_request,
    choice_events,
    joined_text,
    request_caller,
    unless_disconnected,
)
from gateway.openai_protocol import RequestBody, documented
from gateway.openai_responses import EventStream, UsageTally, error_for
from gateway.serving import GenerationParams, ServingContext, TextDelta, build_generation_request, prompt_tail
from gateway.structured_output import tool_choice_plan
from gateway.tool_calls import CallArguments, CallEnd, CallStart, Content, Reasoning
from protos.conventions import TENANT_METADATA_KEY

log = structlog.get_logger()

MESSAGES_PATH = "/v1/messages"
# OpenAI's error kinds (and codes), as Anthropic names them.
_ERROR_TYPES = {"invalid_request_error": "invalid_request_error", "authentication_error": "authentication_error",
                "rate_limit_error": "rate_limit_error", "service_unavailable_error": "overloaded_error",
                "server_error": "api_error"}
_ERROR_CODES = {"model_not_found": "not_found_error", "not_found": "not_found_error",
                "request_too_large": "request_too_large"}
_STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}


def anthropic_error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    """Anthropic's error shape, from the arguments of OpenAI's (gateway.openai_responses.error_body)."""
    error_type = _ERROR_CODES.get(code) or _ERROR_TYPES.get(kind, "api_error")
    return {"type": "error", "error": {"type": error_type, "message": message}}


class MessageParam(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: str = documented(..., enum=["user", "assistant"])
    content: str | list[dict[str, Any]]


class MessagesPrompt(RequestBody):
    """What /v1/messages/count_tokens reads; /v1/messages adds the generation's fields."""

    # Fields this server does not use (metadata, service_tier, betas' fields) are ignored, as
    # Anthropic-compatible servers do: Claude-Code-style clients send several.
    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[MessageParam] = documented(..., minItems=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(MessagesPrompt):
    max_tokens: int = documented(..., minimum=1)
    stop_sequences: list[str] | None = documented(maxItems=4, items={"type": "string", "minLength": 1})
    stream: bool = False
    temperature: float | None = documented(minimum=0, maximum=1)
    top_p: float | None = documented(exclusiveMinimum=0, maximum=1)
    top_k: int | None = documented(minimum=0)
    speculation: dict[str, Any] | None = None  # extension: vLLM --speculative-config keys


def _text(blocks, where: str) -> str:
    """A string, or text blocks joined (system prompts, tool results)."""
    return joined_text(blocks, where, ("text",), "text block", "\n")


def _user_messages(content: list[dict], where: str, known_calls: set[str]) -> list[dict]:
    """A user turn's blocks as chat messages: its tool results (tool messages), then its text."""
    tool_messages, texts = [], []
    for index, block in enumerate(content):
        kind, at = block.get("type"), f"{where}.{index}"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or call_id not in known_calls:
                raise InvalidRequest(f"{at}.tool_use_id {call_id!r} answers no tool_use block of an earlier "
                                     "assistant message", f"{at}.tool_use_id")
            result = _text(block.get("content", ""), f"{at}.content")
            tool_messages.append({"role": "tool", "tool_call_id": call_id,
                                  "content": f"Error: {result}" if block.get("is_error") else result})
        else:
            raise InvalidRequest(f"{at}: a user message takes text and tool_result blocks, got {kind!r}", at)
    return tool_messages + ([{"role": "user", "content": "\n".join(texts)}] if texts else [])


def _assistant_message(content: list[dict], where: str, known_calls: set[str]) -> dict:
    texts, reasoning, calls = [], [], []
    for index, block in enumerate(content):
        kind, at = block.get("type"), f"{where}.{index}"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            reasoning.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # encrypted by Anthropic: nothing a template can render
        elif kind == "tool_use" and isinstance(block.get("id"), str) and isinstance(block.get("name"), str) \
                and isinstance(block.get("input", {}), dict):
            known_calls.add(block["id"])
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
        else:
            raise InvalidRequest(f"{at}: an assistant message takes text, thinking and tool_use blocks "
                                 "(id, name, input object), got {kind!r}", at)
    message = {"role": "assistant", "content": "".join(texts)}
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def chat_messages(body: MessagesPrompt) -> list[dict]:
    """The conversation as the chat template's (OpenAI-style) messages."""
    messages = [{"role": "system", "content": _text(body.system, "system")}] if body.system else []
    known_calls: set[str] = set()
    for index, message in enumerate(body.messages):
        where = f"messages.{index}.content"
        if message.role not in ("user", "assistant"):
            raise InvalidRequest(f"messages[{index}].role must be user or assistant (the system prompt is `system`)",
                                 f"messages.{index}.role")
        if message.role == "assistant":
            content = message.content if isinstance(message.content, list) else [{"type": "text",
                                                                                  "text": message.content}]
            messages.append(_assistant_message(content, where, known_calls))
        elif isinstance(message.content, str):
            messages.append({"role": "user", "content": message.content})
        else:
            messages += _user_messages(message.content, where, known_calls)
    return messages


def openai_tools(tools: list[dict] | None) -> list[dict] | None:
    """Anthropic's tools (name, description, input_schema) as chat completions' function tools."""
    if tools is None:
        return None
    converted = []
    for index, tool in enumerate(tools):
        if not isinstance(tool.get("name"), str) or tool.get("type", "custom") != "custom":
            raise InvalidRequest(f"tools[{index}] must be a client tool with a name and an input_schema "
                                 "(server tools are not available here)", f"tools.{index}")
        schema = tool.get("input_schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise InvalidRequest(f"tools[{index}].input_schema must be a JSON schema object",
                                 f"tools.{index}.input_schema")
        function = {"name": tool["name"], "parameters": schema}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        converted.append({"type": "function", "function": function})
    return converted


def openai_tool_choice(choice: dict | None) -> tuple[Any, bool | None]:
    """(chat completions' tool_choice, parallel_tool_calls) for Anthropic's tool_choice."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise InvalidRequest("tool_choice must be {\"type\": \"auto\" | \"any\" | \"none\"} or "
                         "{\"type\": \"tool\", \"name\": ...}", "tool_choice")


def chat_prompt(body: MessagesPrompt) -> ChatPrompt:
    thinking = (body.thinking or {}).get("type")
    if thinking not in (None, "enabled", "disabled", "adaptive"):
        raise InvalidRequest("thinking.type must be enabled or disabled", "thinking.type")
    # As vLLM maps it: templates of reasoning models read enable_thinking.
    kwargs = {} if thinking is None else {"enable_thinking": thinking != "disabled"}
    return ChatPrompt(chat_messages(body), tools=openai_tools(body.tools), template_kwargs=kwargs)


class MessageWriter:
    """One response message, from the generation's deltas: Anthropic's content
    blocks (thinking, text, tool_use) and the stream events that build them."""

    def __init__(self, ctx: ServingContext, message_id: str, usage: UsageTally, output: AssistantStream):
        self.ctx, self.id, self.usage, self.output = ctx, message_id, usage, output
        self.blocks: list[dict] = []
        self.open_kind: str | None = None  # the type of the last block while it is still open
        self.arguments: dict[int, str] = {}  # a tool_use block's input JSON, by block index
        self.stop_reason, self.stop_sequence = None, None

    def message(self, content: list[dict]) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.ctx.model_name,
                "content": content, "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence,
                "usage": self._usage()}

    def _usage(self) -> dict:
        # Anthropic counts cache reads apart from input_tokens (vLLM's /v1/messages does the same).
        tally, cached = self.usage.as_dict(), self.usage.cached_tokens
        return {"input_tokens": tally["prompt_tokens"] - cached, "cache_read_input_tokens": cached,
                "output_tokens": tally["completion_tokens"], "speculation": tally["speculation"]}

    def start(self) -> list[dict]:
        return [{"type": "message_start", "message": self.message([])}]

    def read(self, delta: TextDelta) -> list[dict]:
        """The stream events of one delta (the last one closes the message)."""
        self.usage.add(delta)
        events, finish_reason = self.output.read(delta.text, delta.finish_reason)
        sent = []
        for event in events:
            sent += self._apply(event)
        if finish_reason:
            sent += self._close()
            self.stop_reason = _STOP_REASONS.get(finish_reason, "stop_sequence" if delta.stop_string else "end_turn")
            self.stop_sequence = delta.stop_string
            sent += [{"type": "message_delta", "delta": {"stop_reason": self.stop_reason,
                                                         "stop_sequence": self.stop_sequence},
                      "usage": self._usage()},
                     {"type": "message_stop"}]
        return sent

    def _apply(self, event) -> list[dict]:
        if isinstance(event, Reasoning | Content):
            kind, field, delta_type = (("thinking", "thinking", "thinking_delta") if isinstance(event, Reasoning)
                                       else ("text", "text", "text_delta"))
            sent = [] if self.open_kind == kind else self._open({"type": kind, field: ""} | (
                {"signature": ""} if kind == "thinking" else {}))
            self.blocks[-1][field] += event.text
            return sent + [self._delta({"type": delta_type, field: event.text})]
        if isinstance(event, CallStart):
            return self._open({"type": "tool_use", "id": event.id, "name": event.name, "input": {}})
        if isinstance(event, CallArguments):
            index = len(self.blocks) - 1
            self.arguments[index] = self.arguments.get(index, "") + event.delta
            return [self._delta({"type": "input_json_delta", "partial_json": event.delta})]
        if isinstance(event, CallEnd):
            return self._close()
        return []

    def _open(self, block: dict) -> list[dict]:
        sent = self._close()
        self.blocks.append(block)
        self.open_kind = block["type"]
        return sent + [{"type": "content_block_start", "index": len(self.blocks) - 1,
                        "content_block": dict(block)}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def _close(self) -> list[dict]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        index = len(self.blocks) - 1
        if self.blocks[index]["type"] == "tool_use":
            self.blocks[index]["input"] = _input_object(self.arguments.get(index, ""))
        return [{"type": "content_block_stop", "index": index}]

    def body(self) -> dict:
        return self.message(self.blocks)


def _input_object(arguments: str) -> dict:
    """A tool_use block's input; a call cut short (max_tokens) has none that parses."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def add_messages_routes(app: FastAPI, ctx: ServingContext) -> None:
    def refuse(error: Exception, headers: dict | None = None) -> JSONResponse:
        status, body = error_for(ctx, error, anthropic_error_body)
        return JSONResponse(body, status_code=status, headers=headers)

    def check_model(body: MessagesPrompt) -> None:
        if body.model != ctx.model_name:
            raise ModelNotFound(f"the model {body.model!r} does not exist; this server serves {ctx.model_name!r}",
                                "model")

    @app.post(MESSAGES_PATH + "/count_tokens")
    async def count_tokens(body: MessagesPrompt):
        try:
            check_model(body)
            return {"input_tokens": len(render_chat(ctx.tokenizer, ctx.chat_template, chat_prompt(body)))}
        except InvalidRequest as error:
            return refuse(error)

    @app.post(MESSAGES_PATH)
    async def messages(body: MessagesRequest, request: Request):
        message_id = f"msg_{uuid.uuid4().hex}"
        request_id = bind_request(request, message_id)
        headers = {"X-Request-Id": request_id}
        caller = request_caller(request)
        try:
            check_model(body)
            if body.temperature is not None and body.temperature > 1:
                raise InvalidRequest(f"temperature must be between 0 and 1, got {body.temperature}", "temperature")
            tools = openai_tools(body.tools)
            tool_choice, parallel = openai_tool_choice(body.tool_choice)
            grammar, tool_parser = tool_choice_plan(ctx.tool_call_parser, tools, tool_choice, parallel,
                                                    ctx.auto_tool_choice)
            stop = list(body.stop_sequences or ())
            params = GenerationParams(
                model=body.model, temperature=body.temperature, top_p=body.top_p,
                top_k=body.top_k or None, stop=stop, speculation=body.speculation,
                tenant=tenant_for(caller, request.headers.get(TENANT_METADATA_KEY)), grammar=grammar)
            generation = build_generation_request(ctx, request_id, params, chat=chat_prompt(body))
            # max_tokens is required here and clients send large ones (32k): it caps the output, which the
            # context length caps too, rather than being refused.
            generation = dataclasses.replace(generation, max_tokens=min(generation.max_tokens, body.max_tokens))
            output = AssistantStream(tool_parser, ctx.reasoning_parser, prompt_tail(ctx, generation))
            writer = MessageWriter(ctx, message_id, UsageTally(len(generation.prompt_token_ids)), output)
            deltas = choice_events(ctx, [generation], stop, caller)
            if body.stream:
                first = await anext(deltas)  # overload and bad input still get a status code
                return EventStream(_events(ctx, writer, first, deltas),
                                   headers={**headers, "Cache-Control": "no-cache"})
            result = await unless_disconnected(request, _whole(writer, deltas))
            if result is None:
                log.info("client disconnected")
                return Response(status_code=499)
            return JSONResponse(result, headers=headers)
        except Exception as error:  # noqa: BLE001 - every failure gets Anthropic's error body (5xx if unexpected)
            return refuse(error, headers)


async def _whole(writer: MessageWriter, deltas) -> dict:
    async for _, delta in deltas:
        writer.read(delta)
    return writer.body()


async def _events(ctx: ServingContext, writer: MessageWriter, first, deltas):
    try:
        for event in writer.start() + writer.read(first[1]):
            yield sse(event)
        async for _, delta in deltas:
            for event in writer.read(delta):
                yield sse(event)
    except Exception as error:  # noqa: BLE001 - headers are gone: reported in-band, as Anthropic does
        yield sse(error_for(ctx, error, anthropic_error_body)[1])
    finally:
        await deltas.aclose()
