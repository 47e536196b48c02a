"""The shared output stream (reasoning, content, tool calls) under every cut: a
speculative step commits several tokens at once, which is where peers' streamed
tool-call parsers break. Whatever the steps, each API's stream adds up to the
same final message, and to what the same output sent whole gives."""

import dataclasses
import json

from hypothesis import given
from hypothesis import strategies as st

from gateway.anthropic_api import MessageWriter
from gateway.assistant_stream import AssistantMessage, AssistantStream
from gateway.openai_responses import CHAT, ResponseWriter, UsageTally
from gateway.reasoning import REASONING_PARSERS
from gateway.responses_api import ResponseBuilder, ResponsesRequest
from gateway.serving import TextDelta
from gateway.tool_calls import TOOL_CALL_PARSERS
from tests.gateway.fakes import ScriptedEngine, make_context

HERMES, QWEN3 = TOOL_CALL_PARSERS["hermes"], REASONING_PARSERS["qwen3"]
OUTPUT = ('<think>Paris is in France; "quote" {brace}.</think>\n\nLet me check <b>both</b>.\n'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris", "days": [1, 2]}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n')
EXPECTED = ("Paris is in France; \"quote\" {brace}.", "Let me check <b>both</b>.\n",
            [("get_weather", '{"city": "Pa\\"ris", "days": [1, 2]}'), ("get_time", "{}")])


def pieces(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [text[start:end] for start, end in zip(bounds, bounds[1:]) if end > start]


def deltas(text: str, cuts: list[int]) -> list[TextDelta]:
    parts = pieces(text, cuts)
    return [TextDelta([1], part, "stop" if index == len(parts) - 1 else None) for index, part in enumerate(parts)]


def ctx(tiny_tokenizer):
    return dataclasses.replace(make_context(tiny_tokenizer, ScriptedEngine(tiny_tokenizer)), reasoning_parser=QWEN3)


def via_chat(context, steps) -> tuple:
    writer = ResponseWriter(context, CHAT, "chatcmpl-1", 1, UsageTally(1), tool_parser=HERMES)
    reasoning, content, calls = "", "", {}
    for step in steps:
        chunk = writer.delta_event(0, step, False)
        if chunk is None:
            continue
        delta = json.loads(chunk.removeprefix("data: "))["choices"][0]["delta"]
        assert delta.get("reasoning") == delta.get("reasoning_content")
        reasoning += delta.get("reasoning") or ""
        content += delta.get("content") or ""
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], [call["function"].get("name"), ""])
            entry[1] += call["function"]["arguments"]
    return reasoning, content, [tuple(entry) for entry in calls.values()]


def via_messages(context, steps) -> tuple:
    writer = MessageWriter(context, "msg_1", UsageTally(1), AssistantStream(HERMES, QWEN3))
    blocks = []
    for step in steps:
        for event in writer.read(step):
            if event["type"] == "content_block_start":
                blocks.append(dict(event["content_block"], partial=""))
            elif event["type"] == "content_block_delta":
                delta = event["delta"]
                key = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial"}[delta["type"]]
                blocks[event["index"]][key] += delta.get(key, delta.get("partial_json"))
    assert writer.stop_reason == "tool_use"
    assert [dict(b, partial="") if b["type"] != "tool_use" else dict(b, input=json.loads(b["partial"]), partial="")
            for b in blocks] == [dict(b, partial="") for b in writer.body()["content"]]
    return ("".join(b["thinking"] for b in blocks if b["type"] == "thinking"),
            "".join(b["text"] for b in blocks if b["type"] == "text"),
            [(b["name"], b["partial"]) for b in blocks if b["type"] == "tool_use"])


def via_responses(context, steps) -> tuple:
    builder = ResponseBuilder(context, "resp_1", ResponsesRequest(input="x"), UsageTally(1),
                              AssistantStream(HERMES, QWEN3))
    reasoning, content, calls = "", "", {}
    for step in steps:
        for event in builder.read(step):
            if event["type"] == "response.reasoning_text.delta":
                reasoning += event["delta"]
            elif event["type"] == "response.output_text.delta":
                content += event["delta"]
            elif event["type"] == "response.output_item.added" and event["item"]["type"] == "function_call":
                calls[event["output_index"]] = [event["item"]["name"], ""]
            elif event["type"] == "response.function_call_arguments.delta":
                calls[event["output_index"]][1] += event["delta"]
    output = builder.response()["output"]
    assert [(item["name"], item["arguments"]) for item in output if item["type"] == "function_call"] == \
        [tuple(entry) for entry in calls.values()]
    return reasoning, content, [tuple(entry) for entry in calls.values()]


@given(cuts=st.lists(st.integers(min_value=1, max_value=len(OUTPUT) - 1), max_size=40))
def test_every_api_streams_the_same_message_however_the_output_is_cut(tiny_tokenizer, cuts):
    context = ctx(tiny_tokenizer)
    for api in (via_chat, via_messages, via_responses):
        assert api(context, deltas(OUTPUT, cuts)) == EXPECTED, api.__name__


def test_the_whole_output_in_one_step_gives_the_same_message():
    stream, message = AssistantStream(HERMES, QWEN3), AssistantMessage()
    message.add(stream.read(OUTPUT, "stop")[0])
    assert (message.reasoning, message.content, [(c.name, c.arguments) for c in message.calls]) == EXPECTED


def test_calls_inside_the_reasoning_are_not_calls():
    stream, message = AssistantStream(HERMES, QWEN3), AssistantMessage()
    message.add(stream.read('<think>maybe <tool_call>{"name": "x", "arguments": {}}</tool_call></think>Done.',
                            "stop")[0])
    assert message.calls == [] and "tool_call" in message.reasoning and message.content == "Done."


def test_qwen3_thinks_only_when_the_output_or_the_prompt_opens_a_block():
    def split(parser, text, prompt=""):
        stream, message = AssistantStream(reasoning_parser=parser, prompt_text=prompt), AssistantMessage()
        message.add(stream.read(text, "stop")[0])
        return message.reasoning, message.content

    assert split(QWEN3, "No thinking here.") == ("", "No thinking here.")
    assert split(QWEN3, "Hmm.</think>Yes.", prompt="<|im_start|>assistant\n<think>\n") == ("Hmm.", "Yes.")
    # enable_thinking false: the template closes an empty block in the prompt.
    assert split(QWEN3, "Yes.", prompt="<think>\n\n</think>\n\n") == ("", "Yes.")
    assert split(REASONING_PARSERS["deepseek_r1"], "Hmm.</think>Yes.") == ("Hmm.", "Yes.")
    assert split(REASONING_PARSERS["deepseek_r1"], "Still thinking") == ("Still thinking", "")
