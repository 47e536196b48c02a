"""Tool calls in the model's output, read as vLLM's `--tool-call-parser` reads
them, and the grammars that make a model call a tool when the request insists.

`hermes`: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
the format Qwen2.5, Qwen3 and Hermes models are trained on. A call streams as
OpenAI streams one: its id and name as soon as the name is complete, then its
arguments' JSON text as it comes. The stream is a function of the text alone,
never of how it was cut into steps (a speculative step commits many tokens at
once, which is where peers' streamed parsers break). `json`: the output is
such objects one after another, streamed the same way, or a list of them, read
once it is complete ("parameters" may stand for "arguments"); a ```json fence
around it is allowed (small models trained on hermes often answer a call as a
bare or fenced object).
"""

import json
import re
import uuid
from dataclasses import dataclass

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
JSON_FENCE, FENCE_END = "```json", "```"
# A call's head up to the first character of its arguments' value: from here on they stream.
_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\<]*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


# What an output stream yields: the events every API's stream is written from.
@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    delta: str  # a fragment of the arguments' JSON text


@dataclass(frozen=True)
class CallEnd:
    index: int
    call: ToolCall  # whole: its arguments are the fragments streamed, joined


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _calls_from_json(text: str) -> list[tuple[str, str]] | None:
    """(name, arguments) of the calls in a JSON object or list of objects with a name; None if it is not one."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    objects = value if isinstance(value, list) else [value]
    calls = []
    for item in objects:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        calls.append((item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls


def held_back(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could be the start of `marker`."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


class _ValueScanner:
    """Finds where a JSON value ends in text that arrives piece by piece."""

    def __init__(self):
        self.depth, self.in_string, self.escape, self.done = 0, False, False, False

    def take(self, text: str) -> str:
        """The part of `text` that belongs to the value."""
        for position, char in enumerate(text):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif char == "\\":
                    self.escape = True
                elif char == '"':
                    self.in_string = False
                    self.done = self.depth == 0
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                if self.depth == 0:  # the call object's own brace after a bare number or literal
                    self.done = True
                    return text[:position]
                self.depth -= 1
                self.done = self.depth == 0
            elif self.depth == 0 and (char == "," or char.isspace()):
                self.done = True
                return text[:position]
            if self.done:
                return text[:position + 1]
        return text


class _CallBody:
    """One call object's text as it arrives: its start once the name is whole, then its arguments' JSON text
    in fragments as they come."""

    def __init__(self, index: int):
        self.index, self.text, self.started, self._value, self._arguments = index, "", False, _ValueScanner(), []

    def push(self, text: str) -> list:
        self.text += text
        events = []
        if not self.started:
            head = _HERMES_HEAD.match(self.text)
            if head is None:
                return []  # not yet, or not in the usual order: read whole at its end
            self.started, self._id, self._name = True, new_call_id(), head.group(1)
            text = self.text[head.end():]
            events.append(CallStart(self.index, self._id, self._name))
        if not self._value.done and (fragment := self._value.take(text)):
            self._arguments.append(fragment)
            events.append(CallArguments(self.index, fragment))
        return events

    def end(self) -> CallEnd:
        return CallEnd(self.index, ToolCall(self._id, self._name, "".join(self._arguments)))


class HermesStream:
    """Splits streamed text into content and <tool_call> blocks, streaming each call's arguments."""

    def __init__(self):
        self._buffer = ""
        self._in_call = False
        self._calls = 0
        self._pending_space = ""  # whitespace after a call, dropped unless text follows it

    def push(self, text: str) -> list:
        self._buffer += text
        events = []
        while True:
            if self._in_call:
                end = self._buffer.find(HERMES_END)
                usable = end if end >= 0 else len(self._buffer) - held_back(self._buffer, HERMES_END)
                events += self._body.push(self._buffer[self._body_used:usable])
                self._body_used = usable
                if end < 0:
                    break
                events += self._end_call()
                self._buffer, self._in_call = self._buffer[end + len(HERMES_END):], False
                continue
            start = self._buffer.find(HERMES_START)
            if start < 0:
                keep = held_back(self._buffer, HERMES_START)
                events += self._content(self._buffer[:len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            events += self._content(self._buffer[:start])
            self._pending_space = ""
            self._buffer, self._in_call = self._buffer[start + len(HERMES_START):], True
            self._body, self._body_used = _CallBody(self._calls), 0
        return events

    def finish(self) -> list:
        """The rest: a call cut short (e.g. by max_tokens) counts once its name is whole."""
        rest, self._buffer = self._buffer, ""
        if not self._in_call:
            return self._content(rest)
        events = self._body.push(rest[self._body_used:])
        if self._body.started or _calls_from_json(self._body.text):
            return events + self._end_call()
        return [Content(HERMES_START + rest)]

    def _end_call(self) -> list:
        if self._body.started:
            self._calls += 1
            return [self._body.end()]
        events = []
        for name, arguments in _calls_from_json(self._body.text) or []:  # not a call: dropped, as vLLM does
            call = ToolCall(new_call_id(), name, arguments)
            events += [CallStart(self._calls, call.id, name), CallArguments(self._calls, arguments),
                       CallEnd(self._calls, call)]
            self._calls += 1
        return events

    def _content(self, text: str) -> list:
        if not self._calls:
            return [Content(text)] if text else []
        # Between and after calls, whitespace is layout, not an answer: it goes out only before more text.
        text = self._pending_space + text
        kept = text.rstrip()
        self._pending_space = text[len(kept):]
        return [Content(kept)] if kept else []


def _unfenced(text: str) -> str:
    stripped = text.strip()
    if stripped.startswith(JSON_FENCE) and stripped.endswith(FENCE_END) and len(stripped) > 2 * len(FENCE_END):
        return stripped[len(JSON_FENCE):-len(FENCE_END)]
    return text


class JsonStream:
    """Content unless the output starts as JSON (or a ```json fence). Then call objects, one after another (small
    models write parallel calls a line each), stream as hermes calls do: each one's id and name once the name is
    whole, then its arguments' text. Whatever follows the last call is dropped. Anything else JSON-shaped (a list
    of calls, an object that is not a call first) is read whole at the end."""

    def __init__(self):
        self._buffer = ""
        self._json: bool | None = None  # undecided until the start is JSON, a fence or neither
        self._streaming = True  # until something other than a call object comes
        self._object: _ValueScanner | None = None  # the bounds of the object being read
        self._body: _CallBody | None = None  # that object, read as a call
        self._calls = 0  # calls ended

    def push(self, text: str) -> list:
        if self._json is None:
            self._buffer += text
            stripped = self._buffer.lstrip()
            if not stripped or (JSON_FENCE.startswith(stripped) and stripped != JSON_FENCE):
                return []
            self._json = stripped[0] in "[{" or stripped.startswith(JSON_FENCE)
            if not self._json:
                text, self._buffer = self._buffer, ""
                return [Content(text)]
            return self._stream(stripped.removeprefix(JSON_FENCE))
        if self._json:
            self._buffer += text
            return self._stream(text)
        return [Content(text)] if text else []

    def _stream(self, text: str) -> list:
        events = []
        while self._streaming and text:
            if self._object is None:
                text = text.lstrip()
                if not text:
                    break
                if text[0] != "{":
                    self._streaming = False
                    break
                self._object, self._body = _ValueScanner(), _CallBody(self._calls)
            part = self._object.take(text)
            text = text[len(part):]
            events += self._body.push(part)
            if self._object.done:
                self._object = None
                if not self._body.started:
                    self._streaming = False
                    break
                events.append(self._body.end())
                self._calls += 1
        return events

    def finish(self) -> list:
        rest, self._buffer = self._buffer, ""
        if self._object is not None and self._body.started:  # a call cut short (e.g. by max_tokens)
            return [self._body.end()]
        if self._calls:
            return []
        calls = _calls_from_json(_unfenced(rest)) if self._json else None
        if not calls:
            return [Content(rest)] if rest else []
        events = []
        for index, (name, arguments) in enumerate(calls):
            call = ToolCall(new_call_id(), name, arguments)
            events += [CallStart(index, call.id, name), CallArguments(index, arguments), CallEnd(index, call)]
        return events


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
        events = stream.push(text) + stream.finish()
        return ("".join(event.text for event in events if isinstance(event, Content)),
                [event.call for event in events if isinstance(event, CallEnd)])


TOOL_CALL_PARSERS = {
    "hermes": ToolCallParser("hermes", HermesStream, _hermes_grammar),
    "json": ToolCallParser("json", JsonStream, _json_grammar),
}
