"""The gRPC Generate API's messages to and from the serving layer's terms:
protobuf stops here, on both sides."""

import json

from gateway.assistant_stream import AssistantMessage
from gateway.chat_template import ChatPrompt
from gateway.errors import InvalidRequest
from gateway.json_limits import json_problem
from gateway.serving import GenerationParams, ServingContext, TextDelta
from gateway.structured_output import json_grammar, tool_choice_plan
from gateway.tool_calls import ToolCallParser
from gateway.types import LogitControls
from protos.conventions import FINISH_REASONS_BY_NAME
from protos.gateway.v1 import gateway_pb2

_OPTIONAL_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs")
_LOGIT_CONTROL_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")


def _json_object(text: str, param: str) -> dict:
    try:
        value = json.loads(text or "{}")
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        raise InvalidRequest(f"{param} is not valid JSON", param) from None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{param} must be a JSON object", param)
    if (problem := json_problem(value)) is not None:
        raise InvalidRequest(f"{param}: {problem[0] or 'the value'} {problem[1]}", param)
    return value


def _tools(request: gateway_pb2.GenerateRequest) -> list[dict]:
    return [{"type": "function", "function": {"name": tool.name, "description": tool.description,
                                              "parameters": _json_object(tool.parameters, f"tools.{i}.parameters")}}
            for i, tool in enumerate(request.tools)]


def _tool_choice(request: gateway_pb2.GenerateRequest):
    choice = request.tool_choice
    if choice in ("", "none", "auto", "required"):
        return choice or None
    return {"type": "function", "function": {"name": choice}}


def tool_plan(ctx: ServingContext, request: gateway_pb2.GenerateRequest) -> tuple[str | None, ToolCallParser | None]:
    if request.WhichOneof("input") != "messages":
        if request.tools or request.tool_choice:
            raise InvalidRequest("tools need a chat (messages) input", "tools")
        return None, None
    parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else None
    return tool_choice_plan(ctx.tool_call_parser, _tools(request), _tool_choice(request), parallel,
                            ctx.auto_tool_choice)


def params(request: gateway_pb2.GenerateRequest, tenant: str, tool_grammar: str | None) -> GenerationParams:
    optional = {name: getattr(request, name) for name in _OPTIONAL_SAMPLING_FIELDS if request.HasField(name)}
    controls = {name: getattr(request, name) for name in _LOGIT_CONTROL_FIELDS if request.HasField(name)}
    speculation = {field.name: value for field, value in request.speculation.ListFields()}
    grammar = json_grammar(_json_object(request.json_schema, "json_schema")) if request.json_schema else None
    if grammar and tool_grammar:
        raise InvalidRequest("json_schema cannot be combined with a tool_choice that requires a call", "json_schema")
    return GenerationParams(
        model=request.model or None, stop=list(request.stop), stop_token_ids=list(request.stop_token_ids),
        ignore_eos=request.ignore_eos, speculation=speculation or None, tenant=tenant,
        logit_controls=LogitControls(**controls, min_tokens=request.min_tokens),
        logit_bias=dict(request.logit_bias), prediction=request.prediction or None,
        grammar=grammar or tool_grammar, **optional,
    )


def _message(message: gateway_pb2.ChatMessage) -> dict:
    rendered = {"role": message.role, "content": message.content or None}
    for key in ("name", "tool_call_id"):
        if getattr(message, key):
            rendered[key] = getattr(message, key)
    if message.tool_calls:
        rendered["tool_calls"] = [{"id": call.id, "type": "function",
                                   "function": {"name": call.name, "arguments": call.arguments}}
                                  for call in message.tool_calls]
    elif rendered["content"] is None:
        rendered["content"] = ""
    return rendered


def prompt(request: gateway_pb2.GenerateRequest) -> dict:
    kind = request.WhichOneof("input")
    if kind == "text":
        return {"text": request.text}
    if kind == "token_ids":
        return {"token_ids": list(request.token_ids.ids)}
    if kind == "messages":
        add_generation_prompt = request.add_generation_prompt if request.HasField("add_generation_prompt") else True
        return {"chat": ChatPrompt([_message(m) for m in request.messages.messages], tools=_tools(request) or None,
                                   add_generation_prompt=add_generation_prompt,
                                   continue_final_message=request.continue_final_message,
                                   template_kwargs=_json_object(request.chat_template_kwargs,
                                                                "chat_template_kwargs"))}
    raise InvalidRequest("one of text, token_ids or messages is required", "input")


def response(delta: TextDelta, split: AssistantMessage, finish_reason: str | None,
             prompt_tokens: int, completion_tokens: int) -> gateway_pb2.GenerateResponse:
    """One streamed message; `split` is the delta's text split into reasoning, content and tool calls."""
    message = gateway_pb2.GenerateResponse(
        token_ids=delta.token_ids, text=split.content, reasoning=split.reasoning,
        logprobs=[gateway_pb2.TokenLogprob(logprob=entry.logprob, top_token_ids=[i for i, _ in entry.top],
                                           top_logprobs=[lp for _, lp in entry.top]) for entry in delta.logprobs],
        tool_calls=[gateway_pb2.ToolCall(id=call.id, name=call.name, arguments=call.arguments)
                    for call in split.calls])
    if finish_reason:
        message.finish_reason = FINISH_REASONS_BY_NAME[finish_reason]
        usage = delta.speculation
        message.usage.CopyFrom(gateway_pb2.Usage(
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
            speculation=gateway_pb2.SpeculationUsage(draft_tokens=usage.draft_tokens,
                                                     accepted_tokens=usage.accepted_tokens,
                                                     verify_steps=usage.verify_steps,
                                                     drafter_steps=usage.drafter_steps,
                                                     head_steps=usage.head_steps,
                                                     next_round_steps=usage.next_round_steps),
            accepted_prediction_tokens=usage.prediction_accepted_tokens,
            rejected_prediction_tokens=usage.prediction_draft_tokens - usage.prediction_accepted_tokens,
            cached_prompt_tokens=delta.cached_tokens,
        ))
    return message
