"""Reasoning in the model's output, split off as vLLM's `--reasoning-parser`
splits it: the `<think>` part goes to `reasoning` (chat completions' `reasoning`
and `reasoning_content`, Responses' reasoning items, Messages' thinking blocks),
the rest is the answer, where tool calls are then looked for.

`qwen3`: the output thinks if it starts with `<think>`, or if the prompt ends
inside an open `<think>` block (templates of thinking-only models open it
themselves); `enable_thinking: false` closes the block in the prompt, and the
output is all answer. `deepseek_r1`: the output thinks from its start (an
opening `<think>` is optional) up to `</think>`. Like the tool-call streams,
the split depends on the text alone, never on how it was cut into steps.
"""

from dataclasses import dataclass

from gateway.tool_calls import Content, Reasoning, held_back

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    thinks_from_start: bool  # without an opening <think>, the output still starts in reasoning

    def stream(self, prompt_text: str = "") -> "ReasoningStream":
        # Only an opening tag after the last closing one leaves the prompt inside a block.
        opened = prompt_text.rfind(THINK_START) > prompt_text.rfind(THINK_END)
        return ReasoningStream(self.thinks_from_start or opened)


REASONING_PARSERS = {
    "qwen3": ReasoningParser("qwen3", thinks_from_start=False),
    "deepseek_r1": ReasoningParser("deepseek_r1", thinks_from_start=True),
}


class ReasoningStream:
    """Splits streamed text into Reasoning and Content events."""

    def __init__(self, thinking: bool):
        self._buffer = ""
        self._mode = "start"  # start (an opening <think> may come) | think | answer
        self._default = "think" if thinking else "answer"  # the mode when no <think> opens the output
        self._answer_started = False  # whitespace right after </think> is dropped

    def push(self, text: str) -> list:
        self._buffer += text
        events = []
        if self._mode == "start":
            stripped = self._buffer.lstrip()
            if not stripped or (THINK_START.startswith(stripped) and stripped != THINK_START):
                return []  # undecided
            if stripped.startswith(THINK_START):
                self._mode, self._buffer = "think", stripped[len(THINK_START):]
            else:
                self._mode = self._default
                if self._mode == "think":
                    self._buffer = stripped
        if self._mode == "think":
            end = self._buffer.find(THINK_END)
            if end < 0:
                keep = held_back(self._buffer, THINK_END)
                if reasoning := self._buffer[:len(self._buffer) - keep]:
                    events.append(Reasoning(reasoning))
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return events
            if end:
                events.append(Reasoning(self._buffer[:end]))
            self._mode, self._buffer = "answer", self._buffer[end + len(THINK_END):]
            self._answer_started = False
        if self._mode == "answer":
            text, self._buffer = self._buffer, ""
            if not self._answer_started:
                text = text.lstrip()
                self._answer_started = bool(text)
            if text:
                events.append(Content(text))
        return events

    def finish(self) -> list:
        rest, self._buffer = self._buffer, ""
        if not rest.strip():
            return []
        if self._mode == "start":
            stripped = rest.lstrip()
            return [Reasoning(stripped) if self._default == "think" else Content(rest)]
        return [Reasoning(rest)] if self._mode == "think" else [Content(rest)]
