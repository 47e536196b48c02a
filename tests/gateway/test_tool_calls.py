import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.errors import InvalidRequest
from gateway.structured_output import response_format_grammar, tool_choice_plan
from gateway.tool_calls import TOOL_CALL_PARSERS, CallArguments, CallEnd, CallStart, Content, HermesStream

HERMES = TOOL_CALL_PARSERS["hermes"]
JSON = TOOL_CALL_PARSERS["json"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TWO_CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_hermes_reads_calls_and_keeps_the_text_before_them():
    content, calls = HERMES.parse(TWO_CALLS)
    assert content == "Let me check.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                  ("get_time", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


def test_hermes_plain_text_is_content():
    assert HERMES.parse("Paris is sunny. Use <b>tags</b> freely.") == ("Paris is sunny. Use <b>tags</b> freely.", [])


def test_hermes_call_cut_short_counts_only_when_its_json_is_whole():
    content, calls = HERMES.parse('<tool_call>\n{"name": "get_time", "arguments": {}}')
    assert content == "" and [c.name for c in calls] == ["get_time"]
    content, calls = HERMES.parse('<tool_call>\n{"name": "get_ti')
    assert calls == [] and content == '<tool_call>\n{"name": "get_ti'


@given(st.lists(st.integers(min_value=1, max_value=len(TWO_CALLS)), max_size=30))
def test_hermes_streaming_gives_the_same_result_however_the_text_is_cut(cuts):
    stream, events = HermesStream(), []
    bounds = [0, *sorted(set(cuts)), len(TWO_CALLS)]
    for start, end in zip(bounds, bounds[1:]):
        events += stream.push(TWO_CALLS[start:end])
    events += stream.finish()
    assert "".join(e.text for e in events if isinstance(e, Content)) == "Let me check.\n"
    calls = [e.call for e in events if isinstance(e, CallEnd)]
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    # The arguments stream in fragments that add up to each call's, after its start.
    for call_index, call in enumerate(calls):
        mine = [e for e in events if getattr(e, "index", None) == call_index]
        assert isinstance(mine[0], CallStart) and mine[0].name == call.name and mine[0].id == call.id
        assert "".join(e.delta for e in mine if isinstance(e, CallArguments)) == call.arguments


def test_hermes_streams_arguments_before_the_call_is_complete():
    stream = HermesStream()
    events = stream.push('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert [type(e) for e in events] == [CallStart, CallArguments] and events[1].delta == '{"city": "Pa'
    assert stream.push('ris"}}\n</tool') == [CallArguments(0, 'ris"}')]


def test_hermes_stream_holds_back_what_may_start_a_call():
    stream = HermesStream()
    assert stream.push("Sure <tool") == [Content("Sure ")]
    assert stream.push("tip> ok") == [Content("<tooltip> ok")]


def test_json_parser_reads_one_call_or_a_list_and_leaves_prose_alone():
    _, calls = JSON.parse('{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    _, calls = JSON.parse('[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]')
    assert [c.name for c in calls] == ["a", "b"]
    assert JSON.parse("The answer is {42}.") == ("The answer is {42}.", [])
    assert JSON.parse('{"not": "a call"}') == ('{"not": "a call"}', [])
    fenced = '```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Oslo"}\n}\n```'
    assert [(c.name, json.loads(c.arguments)) for c in JSON.parse(fenced)[1]] == [("get_weather", {"city": "Oslo"})]
    assert JSON.parse("```json\n[1, 2]\n```") == ("```json\n[1, 2]\n```", [])  # fenced, but no call
    assert JSON.parse("```python\nprint(1)\n```") == ("```python\nprint(1)\n```", [])


def test_json_stream_streams_other_fences_and_holds_a_json_fence_by_any_cut():
    text = '```json\n{"name": "a", "arguments": {}}\n```'
    for cut in range(1, len(text)):
        stream = TOOL_CALL_PARSERS["json"].stream()
        events = stream.push(text[:cut]) + stream.push(text[cut:]) + stream.finish()
        assert [e.call.name for e in events if isinstance(e, CallEnd)] == ["a"], cut
    stream = TOOL_CALL_PARSERS["json"].stream()
    assert stream.push("``") == [] and stream.push("`py") == [Content("```py")]


FENCED_CALL = '```json\n{"name": "write_file", "arguments": {"path": "a.py", "content": "x = {1: \\"}\\"}"}}\n```'


@given(st.lists(st.integers(min_value=1, max_value=len(FENCED_CALL)), max_size=30))
def test_json_streaming_gives_the_same_call_however_the_text_is_cut(cuts):
    stream, events = JSON.stream(), []
    bounds = [0, *sorted(set(cuts)), len(FENCED_CALL)]
    for start, end in zip(bounds, bounds[1:]):
        events += stream.push(FENCED_CALL[start:end])
    events += stream.finish()
    [call] = [e.call for e in events if isinstance(e, CallEnd)]
    assert (call.name, json.loads(call.arguments)) == ("write_file", {"path": "a.py", "content": 'x = {1: "}"}'})
    assert isinstance(events[0], CallStart) and events[0].id == call.id
    assert not any(isinstance(e, Content) for e in events)
    assert "".join(e.delta for e in events if isinstance(e, CallArguments)) == call.arguments


def test_json_streams_a_call_before_it_is_complete():
    stream = JSON.stream()
    events = stream.push('{"name": "get_weather", "arguments": {"ci')
    assert [type(e) for e in events] == [CallStart, CallArguments] and events[0].name == "get_weather"
    arguments, end = stream.push('ty": "Oslo"}}')
    assert arguments == CallArguments(0, 'ty": "Oslo"}') and end.call.arguments == '{"city": "Oslo"}'
    assert stream.finish() == []
    # A list of calls is read whole at its end.
    stream = JSON.stream()
    assert stream.push('[{"name": "a", "arguments": {}}') == []
    assert [e.call.name for e in stream.push("]") + stream.finish() if isinstance(e, CallEnd)] == ["a"]


def test_json_reads_calls_a_line_each_and_drops_what_follows_them():
    lines = '{"name": "a", "arguments": {"x": 1}}\n{"name": "b", "arguments": {}}\n{"temperature_c": 21}'
    content, calls = JSON.parse(lines)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("a", '{"x": 1}'), ("b", "{}")]
    # An object that is not a call first: nothing streams, and the whole output is read at the end.
    assert JSON.parse('{"temperature_c": 21}\n{"name": "a", "arguments": {}}')[1] == []


def test_tool_choice_plan():
    assert tool_choice_plan(HERMES, None, None, None) == (None, None)
    assert tool_choice_plan(HERMES, [WEATHER], None, None) == (None, HERMES)  # auto
    assert tool_choice_plan(HERMES, [WEATHER], "auto", None, auto=False) == (None, None)
    assert tool_choice_plan(HERMES, [WEATHER], "none", None) == (None, None)
    grammar, parser = tool_choice_plan(HERMES, [WEATHER, TIME], "required", None)
    assert parser is HERMES and '"get_weather"' in grammar and '"get_time"' in grammar and "call)*" in grammar
    grammar, _ = tool_choice_plan(HERMES, [WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}},
                                  None)
    assert '"get_time"' in grammar and "get_weather" not in grammar
    with pytest.raises(InvalidRequest, match="--tool-call-parser"):
        tool_choice_plan(None, [WEATHER], "auto", None)
    with pytest.raises(InvalidRequest, match="must be one of"):
        tool_choice_plan(HERMES, [WEATHER], "sometimes", None)


def test_response_format_grammar():
    assert response_format_grammar(None) is None
    assert response_format_grammar({"type": "text"}) is None
    assert response_format_grammar({"type": "json_object"}) == 'start: %json {"type": "object"}'
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    assert response_format_grammar({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}) \
        == "start: %json " + json.dumps(schema)
