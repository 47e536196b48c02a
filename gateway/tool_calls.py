"""Tool calls in the model's output, read as vLLM's `--tool-call-parser` reads
them, and the grammars that make a model call a tool when the request insists.

`hermes`: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
the format Qwen2.5, Qwen3 and Hermes models are trained on. `json`: the whole
output is one such object, or a list of them ("parameters" may stand for
"arguments"). Text streams through as content until a call starts; a call is
sent whole, in one delta, once it is complete.
"""

import json
import uuid
from dataclasses import dataclass

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _calls_from_json(text: str) -> list[ToolCall] | None:
    """The calls in a JSON object or list of objects with a name; None if it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    objects = value if isinstance(value, list) else [value]
    calls = []
    for item in objects:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        calls.append(ToolCall(new_call_id(), item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls


def _held_back(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could be the start of `marker`."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


class HermesStream:
    """Splits streamed text into content and the complete <tool_call> blocks."""

    def __init__(self):
        self._buffer = ""
        self._in_call = False
        self._seen_call = False

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buffer += text
        content, calls = [], []
        while True:
            if self._in_call:
                end = self._buffer.find(HERMES_END)
                if end < 0:
                    break
                calls.extend(_calls_from_json(self._buffer[:end]) or [])
                self._buffer, self._in_call = self._buffer[end + len(HERMES_END):], False
                continue
            start = self._buffer.find(HERMES_START)
            if start < 0:
                keep = _held_back(self._buffer, HERMES_START)
                content.append(self._content(self._buffer[:len(self._buffer) - keep]))
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            content.append(self._content(self._buffer[:start]))
            self._buffer, self._in_call, self._seen_call = self._buffer[start + len(HERMES_START):], True, True
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The rest: a call cut short (e.g. by max_tokens) counts if its JSON is whole."""
        rest, self._buffer = self._buffer, ""
        if self._in_call:
            calls = _calls_from_json(rest)
            return ("", calls) if calls else (self._content(HERMES_START + rest), [])
        return self._content(rest), []

    def _content(self, text: str) -> str:
        # What the model writes between and after calls is layout, not an answer.
        return "" if self._seen_call and not text.strip() else text


class JsonStream:
    """Content unless the output starts as JSON; then the whole output is read as calls."""

    def __init__(self):
        self._buffer = ""
        self._json: bool | None = None  # undecided until the first non-blank character

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        if self._json is None:
            self._buffer += text
            stripped = self._buffer.lstrip()
            if not stripped:
                return "", []
            self._json = stripped[0] in "[{"
            text, self._buffer = self._buffer, ""
        if self._json:
            self._buffer += text
            return "", []
        return text, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self._buffer = self._buffer, ""
        calls = _calls_from_json(rest) if self._json else None
        return ("", calls) if calls else (rest, [])


def _call_schema(tool: dict) -> dict:
    function = tool["function"]
    parameters = function.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def _hermes_grammar(schema: dict, parallel: bool) -> str:
    call = f'"{HERMES_START}\\n" %json {json.dumps(schema)} "\\n{HERMES_END}"'
    return f"start: call (\"\\n\" call)*\ncall: {call}" if parallel else f"start: {call}"


def _json_grammar(schema: dict, parallel: bool) -> str:
    return "start: %json " + json.dumps({"type": "array", "items": schema, "minItems": 1} if parallel else schema)


@dataclass(frozen=True)
class ToolCallParser:
    name: str
    stream: type
    grammar_for: object  # (call schema, parallel) -> llguidance Lark grammar

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        """A grammar that admits only calls of `tools` (tool_choice required, or one named tool)."""
        schemas = [_call_schema(tool) for tool in tools]
        return self.grammar_for(schemas[0] if len(schemas) == 1 else {"anyOf": schemas}, parallel)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        stream = self.stream()
        content, calls = stream.push(text)
        rest, more = stream.finish()
        return content + rest, calls + more


class ToolCallReader:
    """One choice's output as the front ends send it: text split into content and
    calls as it streams, and "tool_calls" as the finish reason of an output that
    called one. Without a parser the text passes through."""

    def __init__(self, parser: ToolCallParser | None):
        self._stream = parser.stream() if parser is not None else None
        self.num_calls = 0

    def read(self, text: str, finish_reason: str | None) -> tuple[str, list[ToolCall], str | None]:
        if self._stream is None:
            return text, [], finish_reason
        text, calls = self._stream.push(text)
        if finish_reason:
            rest, more = self._stream.finish()
            text, calls = text + rest, calls + more
        self.num_calls += len(calls)
        return text, calls, "tool_calls" if self.num_calls and finish_reason == "stop" else finish_reason


TOOL_CALL_PARSERS = {
    "hermes": ToolCallParser("hermes", HermesStream, _hermes_grammar),
    "json": ToolCallParser("json", JsonStream, _json_grammar),
}
