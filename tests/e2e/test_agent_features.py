"""What agent frameworks and vLLM users rely on, through the real stack with the
official openai client: a tool-calling loop (with Qwen2.5's chat template),
predicted outputs, logprobs, logit controls and structured output, each the
same with speculation as without (greedy)."""

import json

import openai
import pytest

from gateway.client import GenerationClient

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m-instruct"
NONE, SUFFIX, NGRAM = {"method": "none"}, {"method": "suffix"}, {"method": "ngram"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
CODE = [{"role": "user", "content": "Repeat this code exactly:\n\ndef add(a, b):\n    return a + b\n\n"
                                    "def sub(a, b):\n    return a - b\n"}]


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tools_client(tools_gateway):
    return openai.OpenAI(base_url=tools_gateway.base_url, api_key="unused", max_retries=0, timeout=120)


def chat(client, speculation=NONE, **kwargs):
    kwargs = {"model": MODEL, "temperature": 0, "max_tokens": 48, **kwargs}
    return client.chat.completions.create(extra_body={"speculation": speculation}, **kwargs)


def test_an_agent_loop_with_tools(tools_client):
    first = chat(tools_client, SUFFIX, messages=ASK, tools=[WEATHER], tool_choice="required",
                 parallel_tool_calls=False)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    # Greedy, with or without speculation: the same call.
    plain = chat(tools_client, NONE, messages=ASK, tools=[WEATHER], tool_choice="required",
                 parallel_tool_calls=False).choices[0]
    assert plain.message.tool_calls[0].function.arguments == call.function.arguments
    messages = [*ASK, choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21, "sky": "sunny"}'}]
    final = chat(tools_client, SUFFIX, messages=messages, tools=[WEATHER], max_tokens=32)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    assert final.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result were rendered


def test_streamed_tool_calls_equal_the_whole_response(tools_client):
    whole = chat(tools_client, SUFFIX, messages=ASK, tools=[WEATHER], tool_choice="required",
                 parallel_tool_calls=False)
    chunks = list(chat(tools_client, SUFFIX, messages=ASK, tools=[WEATHER], tool_choice="required",
                   parallel_tool_calls=False, stream=True))
    calls = {}  # index -> [name, arguments], from the id-and-name delta and the argument fragments after it
    for fragment in (call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []):
        name, arguments = calls.setdefault(fragment.index, [fragment.function.name, ""])
        calls[fragment.index][1] = arguments + fragment.function.arguments
    assert [tuple(call) for call in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_named_tool_choice_forces_that_tool(tools_client):
    time_tool = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"timezone": {"type": "string", "maxLength": 16}}, "required": ["timezone"],
        "additionalProperties": False}}}
    reply = chat(tools_client, SUFFIX, messages=ASK, tools=[WEATHER, time_tool],
                 tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert [c.function.name for c in reply.choices[0].message.tool_calls] == ["get_time"]


def test_the_grpc_api_calls_tools_and_reports_logprobs(tools_gateway, tools_client):
    openai_call = chat(tools_client, SUFFIX, messages=ASK, tools=[WEATHER], tool_choice="required",
                       parallel_tool_calls=False).choices[0].message.tool_calls[0]
    with GenerationClient(tools_gateway.gateway.grpc_address) as client:
        result = client.generate(messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                                 max_tokens=48, temperature=0, logprobs=2, speculation=SUFFIX)
        [call] = result.tool_calls
        assert (call.name, call.arguments) == (openai_call.function.name, openai_call.function.arguments)
        assert result.finish_reason == "tool_calls" and result.text == ""
        assert len(result.logprobs) == len(result.token_ids) and all(len(e.top) == 2 for e in result.logprobs)
        # The tool's answer goes back as a tool message, the call as the assistant's.
        answer = client.generate(messages=[*ASK, {"role": "assistant", "tool_calls": [
            {"id": call.id, "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}], tools=[WEATHER], max_tokens=16,
            temperature=0)
    assert answer.text and answer.usage.prompt_tokens > result.usage.prompt_tokens


def test_structured_output_is_valid_and_lossless(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    messages = [{"role": "user", "content": "Invent a person. Answer in JSON with name and age."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    runs = [chat(client, spec, messages=messages, response_format=fmt, max_tokens=40) for spec in (NONE, SUFFIX)]
    person = json.loads(runs[0].choices[0].message.content)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert runs[1].choices[0].message.content == runs[0].choices[0].message.content


def test_predicted_output_is_drafted_from_and_changes_nothing(client):
    plain = chat(client, NONE, messages=CODE, max_tokens=40)
    expected = plain.choices[0].message.content
    matching = chat(client, NONE, messages=CODE, max_tokens=40, prediction={"type": "content", "content": expected})
    wrong = chat(client, NONE, messages=CODE, max_tokens=40,
                 prediction={"type": "content", "content": "SELECT name FROM users WHERE age > 30;"})
    assert matching.choices[0].message.content == expected == wrong.choices[0].message.content
    details = matching.usage.completion_tokens_details
    assert details.accepted_prediction_tokens >= matching.usage.completion_tokens // 2
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens > 0
    assert matching.usage.model_extra["speculation"]["verify_steps"] < plain.usage.model_extra["speculation"][
        "verify_steps"]
    assert wrong.usage.completion_tokens_details.accepted_prediction_tokens == 0


def test_logprobs_are_the_same_with_and_without_speculation(client):
    runs = [chat(client, spec, messages=CODE, max_tokens=32, logprobs=True, top_logprobs=3)
            for spec in (NONE, SUFFIX)]
    plain, speculative = (run.choices[0].logprobs.content for run in runs)
    assert [e.token for e in plain] == [e.token for e in speculative]
    assert runs[1].usage.model_extra["speculation"]["accepted_tokens"] > 0
    for a, b in zip(plain, speculative):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]
        assert a.top_logprobs[0].logprob >= a.logprob - 1e-6  # greedy: the chosen token is the most likely


def test_logit_controls_are_lossless(client):
    controls = {"presence_penalty": 0.8, "frequency_penalty": 0.3, "logit_bias": {"28": -5.0}}
    extra = {"repetition_penalty": 1.3, "min_tokens": 24}
    runs = [client.chat.completions.create(model=MODEL, messages=CODE, temperature=0, max_tokens=40, **controls,
                                           extra_body={"speculation": spec, **extra})
            for spec in (NONE, SUFFIX, NGRAM)]
    texts = [run.choices[0].message.content for run in runs]
    assert texts[1] == texts[0] and texts[2] == texts[0]
    unpenalised = chat(client, NONE, messages=CODE, max_tokens=40).choices[0].message.content
    assert texts[0] != unpenalised  # the controls did something
    assert runs[0].usage.completion_tokens >= 24
