"""The Responses API (/v1/responses) read back with the official openai client's
`responses.create`, over the real app and serving layer with a scripted
engine: items in and out, tools, reasoning, the event stream, the store and
previous_response_id, and errors in OpenAI's shape."""

import dataclasses
import json

import httpx
import openai
import pytest

from gateway.openai_api import create_app
from gateway.reasoning import REASONING_PARSERS
from gateway.response_store import ResponseStore
from tests.gateway.fakes import FAKE_CACHED_TOKENS, MODEL_NAME, ScriptedEngine, make_context

pytestmark = pytest.mark.anyio
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def scripted(tokenizer, completion: str, step_size: int = 3, **fields):
    engine = ScriptedEngine(tokenizer, completion, step_size=step_size)
    return engine, dataclasses.replace(make_context(tokenizer, engine), **fields)


def client(ctx) -> openai.AsyncOpenAI:
    transport = httpx.ASGITransport(app=create_app(ctx))
    return openai.AsyncOpenAI(api_key="none", base_url="http://gateway/v1",
                              http_client=httpx.AsyncClient(transport=transport), max_retries=0)


async def test_a_string_input_gets_a_message_item_and_usage(tiny_tokenizer):
    engine, ctx = scripted(tiny_tokenizer, "Hello world!")
    reply = await client(ctx).responses.create(model=MODEL_NAME, input="Say hello", instructions="Be brief.",
                                               temperature=0, max_output_tokens=64)
    assert reply.status == "completed" and reply.output_text == "Hello world!"
    [item] = reply.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert reply.usage.input_tokens == len(engine.requests[0].prompt_token_ids)
    assert reply.usage.input_tokens_details.cached_tokens == FAKE_CACHED_TOKENS
    assert reply.usage.output_tokens == len(engine.token_ids)
    prompt = tiny_tokenizer.decode(engine.requests[0].prompt_token_ids)
    assert "<|im_start|>system\nBe brief." in prompt and "Say hello" in prompt
    truncated = await client(ctx).responses.create(model=MODEL_NAME, input="Say hello", max_output_tokens=2)
    assert truncated.status == "incomplete" and truncated.incomplete_details.reason == "max_output_tokens"


async def test_a_tool_call_is_a_function_call_item_and_its_output_goes_back(tiny_tokenizer):
    engine, ctx = scripted(tiny_tokenizer, "Checking." + CALL)
    reply = await client(ctx).responses.create(model=MODEL_NAME, input="Weather in Paris?", tools=[WEATHER],
                                               max_output_tokens=200)
    message, call = reply.output
    assert message.content[0].text == "Checking."
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
    engine.token_ids = tiny_tokenizer.encode("Sunny.") + [tiny_tokenizer.eos_token_id]
    items = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(),
             {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    final = await client(ctx).responses.create(model=MODEL_NAME, input=items, tools=[WEATHER])
    assert final.output_text == "Sunny."
    assert "<|im_start|>tool\nsunny, 21 C" in tiny_tokenizer.decode(engine.requests[-1].prompt_token_ids)


async def test_the_stream_builds_the_same_response(tiny_tokenizer):
    completion = "<think>It is in France.</think>Checking." + CALL
    _, ctx = scripted(tiny_tokenizer, completion, step_size=2, reasoning_parser=REASONING_PARSERS["qwen3"])
    whole = await client(ctx).responses.create(model=MODEL_NAME, input="Weather?", tools=[WEATHER],
                                               max_output_tokens=200)
    events = [event async for event in await client(ctx).responses.create(
        model=MODEL_NAME, input="Weather?", tools=[WEATHER], max_output_tokens=200, stream=True)]
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert {"response.reasoning_text.delta", "response.output_text.delta",
            "response.function_call_arguments.delta", "response.function_call_arguments.done"} <= set(kinds)
    assert kinds.count("response.function_call_arguments.delta") > 1
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    strip = {"id", "call_id"}
    assert [item.model_dump(exclude=strip) for item in final.output] == \
        [item.model_dump(exclude=strip) for item in whole.output]
    assert final.output[0].content[0].text == "It is in France."


async def test_previous_response_id_continues_a_stored_conversation(tiny_tokenizer):
    engine, ctx = scripted(tiny_tokenizer, "Hello world!")
    first = await client(ctx).responses.create(model=MODEL_NAME, input="Say hello")
    second = await client(ctx).responses.create(model=MODEL_NAME, input="Again", previous_response_id=first.id)
    prompt = tiny_tokenizer.decode(engine.requests[-1].prompt_token_ids)
    assert "Say hello" in prompt and "Hello world!" in prompt and "Again" in prompt
    assert second.previous_response_id == first.id
    fetched = await client(ctx).responses.retrieve(first.id)
    assert fetched.id == first.id and fetched.output_text == "Hello world!"
    await client(ctx).responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as missing:
        await client(ctx).responses.retrieve(first.id)
    assert missing.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError) as missing:
        await client(ctx).responses.create(model=MODEL_NAME, input="x", previous_response_id=first.id)
    assert missing.value.body["param"] == "previous_response_id"


async def test_the_store_is_bounded_and_store_false_keeps_nothing(tiny_tokenizer):
    _, ctx = scripted(tiny_tokenizer, "Hi", responses=ResponseStore(2))
    ids = [(await client(ctx).responses.create(model=MODEL_NAME, input="x")).id for _ in range(3)]
    unstored = await client(ctx).responses.create(model=MODEL_NAME, input="x", store=False)
    assert [ctx.responses.get(i) is not None for i in [*ids, unstored.id]] == [False, True, True, False]


async def test_text_format_with_tools_is_calls_or_the_formatted_answer(tiny_tokenizer):
    engine, ctx = scripted(tiny_tokenizer, '{"a": "b"}')
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": {"type": "object"}}}
    await client(ctx).responses.create(model=MODEL_NAME, input="x", tools=[WEATHER], text=fmt)
    await client(ctx).responses.create(model=MODEL_NAME, input="x", text=fmt)
    both, alone = (request.grammar for request in engine.requests)
    assert both.startswith("start: tool_calls | answer") and "get_weather" in both
    assert alone == 'start: %json {"type": "object"}'


BAD = {
    "unknown item type": {"input": [{"type": "image_generation_call"}]},
    "function_call_output for an unknown call": {"input": [{"type": "function_call_output", "call_id": "nope",
                                                            "output": "x"}]},
    "bad content part": {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
    "built-in tool": {"input": "x", "tools": [{"type": "web_search"}]},
    "no input": {},
    "bad tool_choice": {"input": "x", "tools": [WEATHER], "tool_choice": {"type": "file_search"}},
}


@pytest.mark.parametrize("name", BAD)
async def test_bad_input_gets_a_400_in_openais_shape(tiny_tokenizer, name):
    _, ctx = scripted(tiny_tokenizer, "Hi")
    with pytest.raises(openai.BadRequestError) as refused:
        await client(ctx).post("/responses", body={"model": MODEL_NAME, **BAD[name]}, cast_to=object)
    assert set(refused.value.body) == {"message", "type", "param", "code"}  # the client unwraps "error"
