"""Agent frameworks that speak chat completions, unchanged, against the real stack
(gateway, drafter and verifier processes, SmolLM2): LangChain's `ChatOpenAI`,
plain and streamed, with a tool round trip, and pydantic-ai's structured output
and a tool. SmolLM2 does not call tools by itself, so the calls come from a
required tool_choice, which the grammar enforces; chats render with Qwen2.5's
template (tools_gateway), whose tool messages SmolLM2's own template lacks."""

import json

import pytest
from langchain_core.messages import AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field
from pydantic_ai import Agent, NativeOutput
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m-instruct"
SUFFIX = {"method": "suffix"}


@tool
def get_weather(city: str) -> str:
    """Current weather in a city."""
    return "sunny, 21 C"


def chat_model(stack) -> ChatOpenAI:
    # stream_usage: a streamed reply ends with the usage chunk (stream_options.include_usage), as a whole one has it.
    return ChatOpenAI(model=MODEL, base_url=stack.base_url, api_key="unused", temperature=0, max_tokens=32,
                      max_retries=0, timeout=120, stream_usage=True, extra_body={"speculation": SUFFIX})


def test_langchain_chat_openai_plain_and_streamed(stack):
    question = [HumanMessage("Repeat this code exactly:\n\ndef add(a, b):\n    return a + b\n")]
    whole = chat_model(stack).invoke(question)
    streamed = list(chat_model(stack).stream(question))
    assert whole.content and "".join(chunk.content for chunk in streamed) == whole.content
    assert sum(streamed[1:], streamed[0]).usage_metadata["output_tokens"] == whole.usage_metadata["output_tokens"]


@pytest.mark.parametrize("streamed", [False, True])
def test_langchain_tool_round_trip(tools_gateway, streamed):
    model = chat_model(tools_gateway).bind_tools([get_weather], tool_choice="required", parallel_tool_calls=False)
    history = [HumanMessage("What is the weather in Paris right now?")]
    if streamed:  # the call arrives as an id and name, then argument fragments, which LangChain joins
        chunks = list(model.stream(history))
        call_message = sum(chunks[1:], chunks[0])
        assert isinstance(call_message, AIMessageChunk) and len(call_message.tool_call_chunks) == 1
    else:
        call_message = model.invoke(history)
    [call] = call_message.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    history += [call_message, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    answer = chat_model(tools_gateway).bind_tools([get_weather]).invoke(history)
    assert answer.content and not answer.tool_calls
    assert answer.usage_metadata["input_tokens"] > call_message.usage_metadata["input_tokens"]


class City(BaseModel):
    name: str = Field(max_length=16)
    country: str = Field(max_length=16)


def pydantic_agent(stack, **kwargs) -> Agent:
    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=stack.base_url, api_key="unused"))
    settings = ModelSettings(temperature=0, max_tokens=64, extra_body={"speculation": SUFFIX})
    return Agent(model, model_settings=settings, **kwargs)


def test_pydantic_ai_structured_output_through_its_output_tool(tools_gateway):
    # pydantic-ai's default: the output is a `final_result` tool that the request requires.
    result = pydantic_agent(tools_gateway, output_type=City).run_sync("Name a city in France.")
    assert isinstance(result.output, City) and result.output.name


def test_pydantic_ai_native_structured_output(stack):
    # NativeOutput sends response_format json_schema instead of a tool.
    result = pydantic_agent(stack, output_type=NativeOutput(City)).run_sync("Name a city in France.")
    assert isinstance(result.output, City) and result.output.name


def test_pydantic_ai_calls_a_tool(tools_gateway):
    calls = []
    agent = pydantic_agent(tools_gateway, output_type=City)

    async def until_called(ctx, tool_def):
        # Every request requires a call, of find_city or the output tool: offering find_city only
        # until it has answered once makes the next request end the run, whichever SmolLM2 prefers.
        return None if calls else tool_def

    @agent.tool_plain(prepare=until_called)
    def find_city(country: str) -> str:
        """The capital of a country."""
        calls.append(country)
        return json.dumps({"name": "Paris", "country": country})

    result = agent.run_sync("Use find_city to find the capital of France.",
                            model_settings=ModelSettings(parallel_tool_calls=False))
    assert isinstance(result.output, City)
    called = [part.tool_name for message in result.all_messages() for part in message.parts
              if part.part_kind == "tool-call"]
    assert called == ["find_city", "final_result"] and len(calls) == 1
