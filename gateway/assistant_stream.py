"""One generation's text as the events every API streams from: reasoning, then
content and tool calls (id and name first, then argument fragments). The same
stream, and so the same final message, for chat completions, Responses and
Messages, whether the output is sent whole or streamed, and however the
speculative steps cut it."""

from dataclasses import dataclass, field

from gateway.reasoning import ReasoningParser
from gateway.tool_calls import CallArguments, CallEnd, Content, Reasoning, ToolCall, ToolCallParser


class _PassThrough:
    """The stream of a generation whose text is all content."""

    @staticmethod
    def push(text: str) -> list:
        return [Content(text)] if text else []

    finish = staticmethod(list)


def _coalesce(events: list) -> list:
    """Adjacent text of one kind, and adjacent fragments of one call's arguments, as one event."""
    merged = []
    for event in events:
        last = merged[-1] if merged else None
        if type(event) is type(last) and isinstance(event, Content | Reasoning):
            merged[-1] = type(event)(last.text + event.text)
        elif isinstance(event, CallArguments) and isinstance(last, CallArguments) and last.index == event.index:
            merged[-1] = CallArguments(event.index, last.delta + event.delta)
        elif not (isinstance(event, CallArguments) and not event.delta):
            merged.append(event)
    return merged


class AssistantStream:
    """Text in, events out: reasoning is split off first, and tool calls are read
    only from what follows it."""

    def __init__(self, tool_parser: ToolCallParser | None = None, reasoning_parser: ReasoningParser | None = None,
                 prompt_text: str = ""):
        self._reasoning = reasoning_parser.stream(prompt_text) if reasoning_parser is not None else _PassThrough()
        self._tools = tool_parser.stream() if tool_parser is not None else None
        self.num_calls = 0

    def push(self, text: str) -> list:
        return self._counted(self._route(self._reasoning.push(text) if text else []))

    def finish(self) -> list:
        events = self._route(self._reasoning.finish())
        return self._counted(_coalesce(events + self._tools.finish()) if self._tools is not None else events)

    def read(self, text: str, finish_reason: str | None) -> tuple[list, str | None]:
        """A delta's events, and its finish reason: "tool_calls" for an output that called a tool."""
        events = self.push(text)
        if finish_reason:
            events = _coalesce(events + self.finish())
        return events, ("tool_calls" if self.num_calls and finish_reason == "stop" else finish_reason)

    def _counted(self, events: list) -> list:
        self.num_calls += sum(isinstance(event, CallEnd) for event in events)
        return events

    def _route(self, events: list) -> list:
        if self._tools is None:
            return _coalesce(events)
        routed = []
        for event in events:
            routed += self._tools.push(event.text) if isinstance(event, Content) else [event]
        return _coalesce(routed)


@dataclass
class AssistantMessage:
    """The whole message the events add up to."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def add(self, events: list) -> None:
        for event in events:
            if isinstance(event, Reasoning):
                self.reasoning += event.text
            elif isinstance(event, Content):
                self.content += event.text
            elif isinstance(event, CallEnd):
                self.calls.append(event.call)
