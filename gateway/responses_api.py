"""OpenAI's Responses API (/v1/responses) as vLLM serves it, which the OpenAI
Agents SDK and Codex speak: input items translated into the chat prompt, tools
and sampling of the serving layer; output items (reasoning, message,
function_call) and the Responses event stream written from the shared output
stream (gateway/assistant_stream.py); stored responses for previous_response_id
(gateway/response_store.py). The routes at the end are thin adapters."""

import json
import time
import uuid
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ConfigDict

from gateway.assistant_stream import AssistantStream
from gateway.auth import tenant_for
from gateway.chat_template import ChatPrompt
from gateway.errors import InvalidRequest, NotFound
from gateway.http_serving import (
    bind_request,
    choice_events,
    joined_text,
    request_caller,
    unless_disconnected,
)
from gateway.openai_protocol import RequestBody, documented
from gateway.openai_responses import EventStream, UsageTally, error_for
from gateway.response_store import StoredResponse
from gateway.serving import GenerationParams, ServingContext, TextDelta, build_generation_request, prompt_tail
from gateway.structured_output import response_format_grammar, tool_choice_plan, tools_or_format_grammar
from gateway.tool_calls import CallArguments, CallEnd, CallStart, Content, Reasoning
from gateway.types import CACHE_SALT_PATTERN
from protos.conventions import TENANT_METADATA_KEY

log = structlog.get_logger()
_TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text")


class ResponsesRequest(RequestBody):
    # Fields that ask for nothing here (metadata, include, truncation, prompt_cache_key...) are
    # ignored, as vLLM does: the Agents SDK sends several.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = documented(minimum=1)
    temperature: float | None = documented(minimum=0, maximum=2)
    top_p: float | None = documented(exclusiveMinimum=0, maximum=1)
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    speculation: dict[str, Any] | None = None  # extension: vLLM --speculative-config keys
    cache_salt: str | None = documented(pattern=f"^{CACHE_SALT_PATTERN}$")  # extension (vLLM)


def _part_text(content, where: str) -> str:
    return joined_text(content, where, _TEXT_PARTS, "text part", "")


def _known_calls(messages: list[dict]) -> set[str]:
    return {call["id"] for message in messages for call in message.get("tool_calls", ())}


def input_messages(items: str | list[dict], history: list[dict]) -> list[dict]:
    """The input items as chat messages following `history` (a previous response's conversation)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages, known, reasoning = [], _known_calls(history), None

    def assistant() -> dict:
        nonlocal reasoning
        if not messages or messages[-1]["role"] != "assistant" or "tool_calls" not in messages[-1]:
            messages.append({"role": "assistant", "content": "", "tool_calls": []})
        if reasoning is not None:
            messages[-1]["reasoning_content"], reasoning = reasoning, None
        return messages[-1]

    for index, item in enumerate(items):
        where = f"input.{index}"
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") in ("user", "system", "developer", "assistant"):
            message = {"role": item["role"], "content": _part_text(item.get("content"), f"{where}.content")}
            if item["role"] == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call" and all(isinstance(item.get(key), str) for key in ("call_id", "name")) \
                and isinstance(item.get("arguments", ""), str):
            known.add(item["call_id"])
            assistant()["tool_calls"].append({"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": item.get("arguments") or "{}"}})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str) or item["call_id"] not in known:
                raise InvalidRequest(f"{where}.call_id {item.get('call_id')!r} answers no function_call of the "
                                     "conversation", f"{where}.call_id")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _part_text(item.get("output", ""), f"{where}.output")})
        elif kind == "reasoning":
            reasoning = _part_text(item.get("content") or [], f"{where}.content")
        else:
            raise InvalidRequest(f"{where}: items are messages (user, system, developer, assistant), "
                                 f"function_call, function_call_output or reasoning; got {kind!r}", where)
    return messages


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses' function tools (flat) as chat completions' (nested under `function`)."""
    if tools is None:
        return None
    converted = []
    for index, tool in enumerate(tools):
        if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise InvalidRequest(f"tools[{index}] must be a function tool with a name (built-in tools are not "
                                 "available here)", f"tools.{index}")
        converted.append({"type": "function", "function": {
            key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}})
    return converted


def chat_tool_choice(choice):
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise InvalidRequest("tool_choice must be auto, none, required or {\"type\": \"function\", "
                                 "\"name\": ...}", "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def response_format(text: dict | None) -> dict | None:
    """text.format as chat completions' response_format."""
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise InvalidRequest("text.format must be an object with a type (text, json_object or json_schema)",
                             "text.format")
    if fmt is None or fmt.get("type") != "json_schema":
        return fmt
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}


def _usage(tally: UsageTally) -> dict:
    usage = tally.as_dict()
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": usage["prompt_tokens_details"],
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"], "speculation": usage["speculation"]}


class ResponseBuilder:
    """One response: its output items and the Responses events that build them."""

    def __init__(self, ctx: ServingContext, response_id: str, body: ResponsesRequest, usage: UsageTally,
                 output: AssistantStream):
        self.ctx, self.id, self.request, self.usage, self.output = ctx, response_id, body, usage, output
        self.items: list[dict] = []
        self.open = False  # the last item is still being written
        self.status, self.incomplete = "in_progress", None
        self.created = int(time.time())
        self.sequence = 0

    def response(self) -> dict:
        body = self.request
        return {"id": self.id, "object": "response", "created_at": self.created, "status": self.status,
                "error": None, "incomplete_details": self.incomplete, "model": self.ctx.model_name,
                "instructions": body.instructions, "output": [dict(item) for item in self.items],
                "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
                "parallel_tool_calls": body.parallel_tool_calls is not False, "temperature": body.temperature,
                "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
                "previous_response_id": body.previous_response_id, "store": body.store,
                "text": body.text or {"format": {"type": "text"}}, "reasoning": body.reasoning, "metadata": {},
                "truncation": "disabled", "usage": _usage(self.usage) if self.status != "in_progress" else None}

    def event(self, kind: str, **fields) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def start(self) -> list[dict]:
        return [self.event("response.created", response=self.response()),
                self.event("response.in_progress", response=self.response())]

    def read(self, delta: TextDelta) -> list[dict]:
        self.usage.add(delta)
        events, finish_reason = self.output.read(delta.text, delta.finish_reason)
        sent = []
        for event in events:
            sent += self._apply(event)
        if finish_reason:
            sent += self._close()
            if finish_reason == "length":
                self.status, self.incomplete = "incomplete", {"reason": "max_output_tokens"}
            else:
                self.status = "completed"
            sent.append(self.event(f"response.{self.status}", response=self.response()))
        return sent

    def _where(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _apply(self, event) -> list[dict]:
        last = self.items[-1] if self.open else None
        if isinstance(event, Reasoning):
            sent = [] if last is not None and last["type"] == "reasoning" else self._add(
                {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                 "content": [{"type": "reasoning_text", "text": ""}]})
            self.items[-1]["content"][0]["text"] += event.text
            return sent + [self.event("response.reasoning_text.delta", **self._where(), content_index=0,
                                      delta=event.text)]
        if isinstance(event, Content):
            sent = []
            if last is None or last["type"] != "message":
                sent = self._add({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "in_progress",
                                  "role": "assistant", "content": [{"type": "output_text", "text": "",
                                                                    "annotations": []}]})
                sent.append(self.event("response.content_part.added", **self._where(), content_index=0,
                                       part={"type": "output_text", "text": "", "annotations": []}))
            self.items[-1]["content"][0]["text"] += event.text
            return sent + [self.event("response.output_text.delta", **self._where(), content_index=0,
                                      delta=event.text, logprobs=[])]
        if isinstance(event, CallStart):
            return self._add({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": event.id,
                              "name": event.name, "arguments": "", "status": "in_progress"})
        if isinstance(event, CallArguments):
            self.items[-1]["arguments"] += event.delta
            return [self.event("response.function_call_arguments.delta", **self._where(), delta=event.delta)]
        if isinstance(event, CallEnd):
            return self._close()
        return []

    def _add(self, item: dict) -> list[dict]:
        sent = self._close()
        added = dict(item, content=[]) if item["type"] == "message" else dict(item)
        self.items.append(item)
        self.open = True
        return sent + [self.event("response.output_item.added", output_index=len(self.items) - 1, item=added)]

    def _close(self) -> list[dict]:
        if not self.open:
            return []
        self.open = False
        item, where = self.items[-1], self._where()
        sent = []
        if item["type"] == "message":
            part = item["content"][0]
            sent = [self.event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[]),
                    self.event("response.content_part.done", **where, content_index=0, part=dict(part))]
        elif item["type"] == "reasoning":
            sent = [self.event("response.reasoning_text.done", **where, content_index=0,
                               text=item["content"][0]["text"])]
        else:
            sent = [self.event("response.function_call_arguments.done", **where, name=item["name"],
                               arguments=item["arguments"])]
        if "status" in item:
            item["status"] = "completed"
        return sent + [self.event("response.output_item.done", output_index=where["output_index"], item=dict(item))]

    def conversation(self, messages: list[dict]) -> tuple[dict, ...]:
        """The conversation this response continues, with its output as the assistant's turn."""
        reply = {"role": "assistant", "content": "", "tool_calls": []}
        for item in self.items:
            if item["type"] == "message":
                reply["content"] += item["content"][0]["text"]
            elif item["type"] == "reasoning":
                reply["reasoning_content"] = item["content"][0]["text"]
            else:
                reply["tool_calls"].append({"id": item["call_id"], "type": "function",
                                            "function": {"name": item["name"], "arguments": item["arguments"]}})
        if not reply["tool_calls"]:
            del reply["tool_calls"]
        return (*messages, reply)


def add_responses_routes(app: FastAPI, ctx: ServingContext) -> None:
    def refuse(error: Exception, headers: dict | None = None) -> JSONResponse:
        status, body = error_for(ctx, error)
        return JSONResponse(body, status_code=status, headers=headers)

    def stored(response_id: str) -> StoredResponse:
        found = ctx.responses.get(response_id)
        if found is None:
            raise NotFound(f"Response with id {response_id!r} not found (responses live in one gateway's memory "
                           "and are lost on restart)", "response_id")
        return found

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        try:
            return stored(response_id).body
        except NotFound as error:
            return refuse(error)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        if not ctx.responses.delete(response_id):
            return refuse(NotFound(f"Response with id {response_id!r} not found", "response_id"))
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        response_id = f"resp_{uuid.uuid4().hex}"
        request_id = bind_request(request, response_id)
        headers = {"X-Request-Id": request_id}
        caller = request_caller(request)
        try:
            history = []
            if body.previous_response_id is not None:
                try:
                    history = list(stored(body.previous_response_id).messages)
                except NotFound as error:
                    error.param = "previous_response_id"
                    raise
            messages = [*history, *input_messages(body.input, history)]
            if body.instructions:  # not carried over from a previous response, as OpenAI does
                messages = [{"role": "system", "content": body.instructions}, *messages]
            tools, tool_choice = chat_tools(body.tools), chat_tool_choice(body.tool_choice)
            tool_grammar, tool_parser = tool_choice_plan(ctx.tool_call_parser, tools, tool_choice,
                                                         body.parallel_tool_calls, ctx.auto_tool_choice)
            grammar = tools_or_format_grammar(response_format_grammar(response_format(body.text)), tool_grammar,
                                              tool_parser, tools, body.parallel_tool_calls)
            effort = (body.reasoning or {}).get("effort")
            kwargs = {} if effort is None else {"enable_thinking": effort != "none"}
            params = GenerationParams(
                model=body.model, max_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p,
                speculation=body.speculation, tenant=tenant_for(caller, request.headers.get(TENANT_METADATA_KEY)),
                cache_salt=body.cache_salt, grammar=grammar)
            generation = build_generation_request(ctx, request_id, params, chat=ChatPrompt(
                messages, tools=tools, template_kwargs=kwargs))
            output = AssistantStream(tool_parser, ctx.reasoning_parser, prompt_tail(ctx, generation))
            builder = ResponseBuilder(ctx, response_id, body, UsageTally(len(generation.prompt_token_ids)), output)
            deltas = choice_events(ctx, [generation], (), caller)

            def keep() -> None:
                if body.store:
                    ctx.responses.put(response_id, StoredResponse(builder.response(), builder.conversation(messages)))

            if body.stream:
                first = await anext(deltas)  # overload and bad input still get a status code
                return EventStream(_events(ctx, builder, first, deltas, keep),
                                   headers={**headers, "Cache-Control": "no-cache"})
            result = await unless_disconnected(request, _whole(builder, deltas))
            if result is None:
                log.info("client disconnected")
                return Response(status_code=499)
            keep()
            return JSONResponse(result, headers=headers)
        except Exception as error:  # noqa: BLE001 - every failure gets an OpenAI error body (5xx if unexpected)
            return refuse(error, headers)


async def _whole(builder: ResponseBuilder, deltas) -> dict:
    async for _, delta in deltas:
        builder.read(delta)
    return builder.response()


def sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


async def _events(ctx: ServingContext, builder: ResponseBuilder, first, deltas, keep):
    try:
        for event in builder.start() + builder.read(first[1]):
            yield sse(event)
        async for _, delta in deltas:
            for event in builder.read(delta):
                yield sse(event)
        keep()
    except Exception as error:  # noqa: BLE001 - headers are gone: reported in-band, as OpenAI does
        body = error_for(ctx, error)[1]["error"]
        yield sse(builder.event("error", **body))
    finally:
        await deltas.aclose()

