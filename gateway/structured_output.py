"""Structured output requests (OpenAI's response_format, tool_choice that
insists on a call) as grammars the verifier enforces at every position."""

import json

from gateway.errors import InvalidRequest
from gateway.tool_calls import ToolCallParser

TOOL_CHOICE_MODES = ("none", "auto", "required")


def json_grammar(schema: dict) -> str:
    """llguidance's Lark syntax: the whole output is one JSON value matching `schema`."""
    return "start: %json " + json.dumps(schema)


def response_format_grammar(response_format: dict | None) -> str | None:
    """None for plain text; InvalidRequest naming the field for what is not understood."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_grammar({"type": "object"})
    if kind == "json_schema":
        json_schema = response_format.get("json_schema")
        schema = json_schema.get("schema") if isinstance(json_schema, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequest("response_format.json_schema.schema must be a JSON schema object",
                                 "response_format.json_schema.schema")
        return json_grammar(schema)
    raise InvalidRequest(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                         "response_format.type")


def _check_tools(tools: list[dict]) -> None:
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function" \
                or not isinstance(function.get("name"), str) or not function["name"]:
            raise InvalidRequest(f"tools[{index}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                                 f"tools.{index}")
        if not isinstance(function.get("parameters", {}), dict):
            raise InvalidRequest(f"tools[{index}].function.parameters must be a JSON schema object",
                                 f"tools.{index}.function.parameters")


def tool_choice_plan(parser: ToolCallParser | None, tools: list[dict] | None, tool_choice,
                     parallel_tool_calls: bool | None, auto: bool = True) -> tuple[str | None, ToolCallParser | None]:
    """(grammar, parser reading calls from the output) for a request's tools and tool_choice;
    with `auto` off, tool_choice auto leaves the output as text (vLLM without --enable-auto-tool-choice)."""
    tools = tools or []
    _check_tools(tools)
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if choice == "none":
        return None, None
    if not tools:
        raise InvalidRequest("tool_choice needs tools", "tool_choice")
    if parser is None:
        raise InvalidRequest("tool calls need the server started with --tool-call-parser", "tool_choice")
    parallel = parallel_tool_calls is not False
    if choice == "auto":
        return None, parser if auto else None
    if choice == "required":
        return parser.grammar(tools, parallel), parser
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise InvalidRequest(f"tool_choice must be one of {', '.join(TOOL_CHOICE_MODES)} or "
                             "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    named = [tool for tool in tools if tool["function"]["name"] == name]
    if not named:
        raise InvalidRequest(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return parser.grammar(named, parallel=False), parser


def tools_or_format_grammar(format_grammar: str | None, tool_grammar: str | None, tool_parser: ToolCallParser | None,
                            tools: list[dict] | None, parallel_tool_calls: bool | None) -> str | None:
    """The grammar of a request with both a response format and tools (which vLLM refuses, #16313, and
    the Agents SDK's output_type sends): with tool_choice auto, the output is either calls or the
    formatted answer; a call the request insists on comes first (the answer after its result is formatted)."""
    if format_grammar is None or tool_grammar is not None:
        return tool_grammar or format_grammar
    if tool_parser is None:
        return format_grammar
    calls = tool_parser.grammar(tools, parallel_tool_calls is not False).replace("start:", "tool_calls:", 1)
    return f"start: tool_calls | answer\n{calls}\n{format_grammar.replace('start:', 'answer:', 1)}"
