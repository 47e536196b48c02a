"""The agent clients' APIs through the real stack (gateway, drafter and verifier
processes over gRPC, SmolLM2) with their official clients: the Anthropic
Messages API (`anthropic`) and the Responses API (`openai`'s
`client.responses.create`, the OpenAI Agents SDK's default model). Tool round
trips use Qwen2.5's chat template (tools_gateway), and greedy output is the
same with and without speculation in every API."""

import asyncio

import agents
import anthropic
import httpx2
import openai
import pytest

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m-instruct"
NONE, SUFFIX = {"method": "none"}, {"method": "suffix"}
WEATHER_INPUT = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                 "required": ["city"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
CODE = [{"role": "user", "content": "Repeat this code exactly:\n\ndef add(a, b):\n    return a + b\n\n"
                                    "def sub(a, b):\n    return a - b\n"}]


def anthropic_client(stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.base_url.removesuffix("/v1"), api_key="unused", max_retries=0,
                               http_client=httpx2.Client(timeout=120))


def message(client, speculation=NONE, **kwargs):
    kwargs = {"model": MODEL, "max_tokens": 48, "messages": CODE, **kwargs}
    return client.messages.create(extra_body={"temperature": 0, "speculation": speculation}, **kwargs)


def test_messages_greedy_output_is_the_same_with_and_without_speculation(stack):
    client = anthropic_client(stack)
    plain, speculated = message(client, NONE), message(client, SUFFIX)
    assert plain.content[0].text and plain.content[0].text == speculated.content[0].text
    assert plain.stop_reason == speculated.stop_reason and plain.usage.output_tokens == speculated.usage.output_tokens
    assert speculated.usage.model_extra["speculation"]["accepted_tokens"] > 0


def test_messages_stream_equals_the_whole_message(stack):
    client = anthropic_client(stack)
    whole = message(client, SUFFIX, system="You copy code.")
    with client.messages.stream(model=MODEL, max_tokens=48, messages=CODE, system="You copy code.",
                                extra_body={"temperature": 0, "speculation": SUFFIX}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason


def test_messages_tool_round_trip(tools_gateway):
    client = anthropic_client(tools_gateway)
    tools = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER_INPUT}]
    first = message(client, SUFFIX, messages=ASK, tools=tools, tool_choice={"type": "any",
                                                                            "disable_parallel_tool_use": True})
    assert first.stop_reason == "tool_use", first
    [call] = [block for block in first.content if block.type == "tool_use"]
    assert call.name == "get_weather" and isinstance(call.input["city"], str)
    # Streamed, the call arrives as input_json_delta fragments that add up to the same input.
    with client.messages.stream(model=MODEL, max_tokens=48, messages=ASK, tools=tools,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                extra_body={"temperature": 0, "speculation": SUFFIX}) as stream:
        fragments = [event.delta.partial_json for event in stream
                     if event.type == "content_block_delta" and event.delta.type == "input_json_delta"]
        streamed = stream.get_final_message()
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [call.input] and fragments
    history = [*ASK, {"role": "assistant", "content": [block.model_dump() for block in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": '{"temperature_c": 21, "sky": "sunny"}'}]}]
    final = message(client, SUFFIX, messages=history, tools=tools, max_tokens=32)
    assert final.stop_reason in ("end_turn", "max_tokens") and final.content[0].type == "text"
    def prompt_tokens(usage):  # Anthropic counts cache reads apart
        return usage.input_tokens + usage.cache_read_input_tokens

    assert prompt_tokens(final.usage) > prompt_tokens(first.usage)  # the call and its result were rendered
    assert final.usage.cache_read_input_tokens > 0  # the first request's prompt
    counted = client.messages.count_tokens(model=MODEL, messages=history, tools=tools)
    assert counted.input_tokens == prompt_tokens(final.usage)


def openai_client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)


def respond(client, speculation=NONE, **kwargs):
    kwargs = {"model": MODEL, "max_output_tokens": 48, "input": CODE, "temperature": 0, **kwargs}
    return client.responses.create(extra_body={"speculation": speculation}, **kwargs)


def test_responses_greedy_output_is_the_same_with_and_without_speculation(stack):
    client = openai_client(stack)
    plain, speculated = respond(client, NONE), respond(client, SUFFIX)
    assert plain.output_text and plain.output_text == speculated.output_text
    assert plain.usage.output_tokens == speculated.usage.output_tokens
    assert speculated.usage.model_extra["speculation"]["accepted_tokens"] > 0
    # The same greedy text as the other two APIs give for the same conversation.
    chat = client.chat.completions.create(model=MODEL, messages=CODE, max_tokens=48, temperature=0,
                                          extra_body={"speculation": SUFFIX})
    assert chat.choices[0].message.content == plain.output_text == message(anthropic_client(stack)).content[0].text


def test_responses_stream_and_previous_response_id(stack):
    client = openai_client(stack)
    whole = respond(client, SUFFIX)
    events = list(respond(client, SUFFIX, stream=True))
    # The stream ends as the whole response did: completed, or incomplete where max_output_tokens cut it.
    assert events[0].type == "response.created" and events[-1].type == f"response.{whole.status}"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    follow_up = respond(client, SUFFIX, input="Now repeat only the first function.", previous_response_id=whole.id,
                        max_output_tokens=16)
    assert follow_up.usage.input_tokens > whole.usage.input_tokens + whole.usage.output_tokens
    assert client.responses.retrieve(whole.id).output_text == whole.output_text


def test_the_agents_sdks_default_responses_model_drives_a_tool_call(tools_gateway):
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return "sunny, 21 C"

    async def run():
        # Closed in the loop that opened it: left to the garbage collector, its connections would be
        # closed later from another test's event loop, which fails that test.
        async with openai.AsyncOpenAI(base_url=tools_gateway.base_url, api_key="unused", max_retries=0,
                                      timeout=120) as client:
            agent = agents.Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
                                 model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
                                 model_settings=agents.ModelSettings(temperature=0, max_tokens=200,
                                                                     tool_choice="required",
                                                                     parallel_tool_calls=False),
                                 tool_use_behavior="stop_on_first_tool")
            return await agents.Runner.run(agent, "What is the weather in Paris?",
                                           run_config=agents.RunConfig(tracing_disabled=True))

    result = asyncio.run(run())
    assert len(calls) == 1 and isinstance(calls[0], str)
    assert result.final_output == "sunny, 21 C"
    assert any(item.type == "tool_call_item" for item in result.new_items)
