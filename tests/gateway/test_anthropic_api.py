"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) read back
with the official anthropic client, over the real app and serving layer with a
scripted engine: content blocks, tools, thinking, stop reasons, streaming
events, keys, and errors in Anthropic's shape."""

import dataclasses
import json

import anthropic
import httpx
import httpx2
import pytest

from gateway.auth import Keyring
from gateway.openai_api import create_app
from gateway.reasoning import REASONING_PARSERS
from tests.gateway.fakes import FAKE_CACHED_TOKENS, MODEL_NAME, ScriptedEngine, make_context

pytestmark = pytest.mark.anyio
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def scripted(tokenizer, completion: str, **kwargs):
    engine = ScriptedEngine(tokenizer, completion, step_size=kwargs.pop("step_size", 3))
    return engine, dataclasses.replace(make_context(tokenizer, engine), **kwargs)


def client(ctx, api_key: str = "none") -> anthropic.AsyncAnthropic:
    transport = httpx2.ASGITransport(app=create_app(ctx))  # the SDK's own httpx fork
    return anthropic.AsyncAnthropic(api_key=api_key, base_url="http://gateway",
                                    http_client=httpx2.AsyncClient(transport=transport), max_retries=0)


def post(ctx, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    async def send():
        transport = httpx.ASGITransport(app=create_app(ctx))
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
            return await http.post(path, json=body, headers=headers or {})
    return send()


async def test_text_reply_with_usage_and_end_turn(tiny_tokenizer):
    engine, ctx = scripted(tiny_tokenizer, "Hello world!")
    reply = await client(ctx).messages.create(model=MODEL_NAME, max_tokens=200, system="Be brief.", messages=ASK,
                                              stop_sequences=["zzz"], extra_body={"temperature": 0})
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert [block.type for block in reply.content] == ["text"] and reply.content[0].text == "Hello world!"
    assert reply.stop_reason == "end_turn" and reply.stop_sequence is None
    # Anthropic's input_tokens leave out the prompt tokens read from the cache.
    assert reply.usage.cache_read_input_tokens == FAKE_CACHED_TOKENS
    assert reply.usage.input_tokens == len(engine.requests[0].prompt_token_ids) - FAKE_CACHED_TOKENS
    assert reply.usage.output_tokens == len(engine.token_ids)
    prompt = tiny_tokenizer.decode(engine.requests[0].prompt_token_ids)
    assert "<|im_start|>system\nBe brief." in prompt and "Weather in Paris?" in prompt


async def test_stop_sequence_and_max_tokens_stop_reasons(tiny_tokenizer):
    _, ctx = scripted(tiny_tokenizer, "Hello world! The quick brown fox")
    reply = await client(ctx).messages.create(model=MODEL_NAME, max_tokens=200, messages=ASK,
                                              stop_sequences=["quick", "world"])
    assert (reply.stop_reason, reply.stop_sequence, reply.content[0].text) == ("stop_sequence", "world", "Hello ")
    reply = await client(ctx).messages.create(model=MODEL_NAME, max_tokens=2, messages=ASK)
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 2


async def test_a_large_max_tokens_is_capped_by_the_context(tiny_tokenizer):
    engine, ctx = scripted(tiny_tokenizer, "Hi")
    await client(ctx).messages.create(model=MODEL_NAME, max_tokens=20000, messages=ASK)
    assert engine.requests[0].max_tokens == ctx.max_context_len - len(engine.requests[0].prompt_token_ids)


async def test_a_tool_call_is_a_tool_use_block(tiny_tokenizer):
    engine, ctx = scripted(tiny_tokenizer, "Checking." + CALL)
    reply = await client(ctx).messages.create(model=MODEL_NAME, max_tokens=200, messages=ASK, tools=[WEATHER])
    assert reply.stop_reason == "tool_use"
    text, call = reply.content
    assert text.text == "Checking." and call.type == "tool_use" and call.name == "get_weather"
    assert call.input == {"city": "Paris"} and call.id.startswith("call_")
    assert engine.requests[0].grammar is None  # auto


async def test_tool_choice_maps_to_a_grammar(tiny_tokenizer):
    engine, ctx = scripted(tiny_tokenizer, CALL)
    await client(ctx).messages.create(model=MODEL_NAME, max_tokens=200, messages=ASK, tools=[WEATHER],
                                      tool_choice={"type": "any", "disable_parallel_tool_use": True})
    await client(ctx).messages.create(model=MODEL_NAME, max_tokens=200, messages=ASK, tools=[WEATHER],
                                      tool_choice={"type": "tool", "name": "get_weather"})
    none = await client(ctx).messages.create(model=MODEL_NAME, max_tokens=200, messages=ASK, tools=[WEATHER],
                                             tool_choice={"type": "none"})
    single, named, _ = (request.grammar for request in engine.requests)
    assert "get_weather" in single and "call (" not in single  # one call only: no repetition
    assert "get_weather" in named
    assert none.content[0].type == "text" and none.stop_reason == "end_turn"


async def test_a_tool_round_trip_renders_the_call_and_its_result(tiny_tokenizer):
    engine, ctx = scripted(tiny_tokenizer, "It is sunny.")
    history = [*ASK, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "I should call it.", "signature": "x"},
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "sunny, 21 C"}]}]}]
    reply = await client(ctx).messages.create(model=MODEL_NAME, max_tokens=200, messages=history, tools=[WEATHER])
    assert reply.content[0].text == "It is sunny."
    prompt = tiny_tokenizer.decode(engine.requests[0].prompt_token_ids)
    assert "Let me look." in prompt and "<|im_start|>tool\nsunny, 21 C" in prompt


async def test_thinking_becomes_a_thinking_block(tiny_tokenizer):
    _, ctx = scripted(tiny_tokenizer, "<think>Paris is in France.</think>\n\nSunny." + CALL,
                      reasoning_parser=REASONING_PARSERS["qwen3"])
    reply = await client(ctx).messages.create(model=MODEL_NAME, max_tokens=200, messages=ASK, tools=[WEATHER])
    assert [block.type for block in reply.content] == ["thinking", "text", "tool_use"]
    assert reply.content[0].thinking == "Paris is in France." and reply.content[1].text == "Sunny."


async def test_the_stream_builds_the_same_message(tiny_tokenizer):
    completion = "<think>Paris is in France.</think>\n\nChecking." + CALL
    _, ctx = scripted(tiny_tokenizer, completion, step_size=2, reasoning_parser=REASONING_PARSERS["qwen3"])
    whole = await client(ctx).messages.create(model=MODEL_NAME, max_tokens=200, messages=ASK, tools=[WEATHER])
    async with client(ctx).messages.stream(model=MODEL_NAME, max_tokens=200, messages=ASK, tools=[WEATHER]) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_message()
    assert [b.model_dump(exclude={"id"}) for b in final.content] == \
        [b.model_dump(exclude={"id"}) for b in whole.content]
    assert final.stop_reason == "tool_use" and final.usage.output_tokens == whole.usage.output_tokens
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    deltas = [event.delta.type for event in events if event.type == "content_block_delta"]
    assert {"thinking_delta", "text_delta", "input_json_delta"} <= set(deltas)
    assert deltas.count("input_json_delta") > 1  # the arguments stream in fragments


async def test_count_tokens_counts_the_rendered_prompt(tiny_tokenizer):
    engine, ctx = scripted(tiny_tokenizer, "Hi")
    counted = await client(ctx).messages.count_tokens(model=MODEL_NAME, messages=ASK, system="Be brief.")
    await client(ctx).messages.create(model=MODEL_NAME, max_tokens=8, messages=ASK, system="Be brief.")
    assert counted.input_tokens == len(engine.requests[0].prompt_token_ids)


async def test_keys_are_taken_from_x_api_key_and_refused_in_anthropics_shape(tiny_tokenizer):
    _, ctx = scripted(tiny_tokenizer, "Hi", keyring=Keyring.load(("secret",)))
    reply = await client(ctx, api_key="secret").messages.create(model=MODEL_NAME, max_tokens=8, messages=ASK)
    assert reply.content[0].text == "Hi"
    with pytest.raises(anthropic.AuthenticationError) as refused:
        await client(ctx, api_key="wrong").messages.create(model=MODEL_NAME, max_tokens=8, messages=ASK)
    assert refused.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                             "message": refused.value.body["error"]["message"]}}
    bearer = await post(ctx, "/v1/messages", {"model": MODEL_NAME, "max_tokens": 8, "messages": ASK},
                        {"authorization": "Bearer secret"})
    assert bearer.status_code == 200, bearer.text


BAD = {
    "no max_tokens": {"model": MODEL_NAME, "messages": ASK},
    "unknown block type": {"model": MODEL_NAME, "max_tokens": 8, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {}}]}]},
    "tool_result for an unknown id": {"model": MODEL_NAME, "max_tokens": 8, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}]},
    "bad tool_choice": {"model": MODEL_NAME, "max_tokens": 8, "messages": ASK, "tools": [WEATHER],
                        "tool_choice": {"type": "sometimes"}},
    "temperature above 1": {"model": MODEL_NAME, "max_tokens": 8, "messages": ASK, "temperature": 1.5},
    "server tool": {"model": MODEL_NAME, "max_tokens": 8, "messages": ASK,
                    "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
    "wrong role": {"model": MODEL_NAME, "max_tokens": 8, "messages": [{"role": "system", "content": "x"}]},
    "not json": b"{",
}


@pytest.mark.parametrize("name", BAD)
async def test_bad_input_gets_a_4xx_in_anthropics_shape(tiny_tokenizer, name):
    _, ctx = scripted(tiny_tokenizer, "Hi")
    body = BAD[name]
    transport = httpx.ASGITransport(app=create_app(ctx))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        response = await http.post("/v1/messages", content=body if isinstance(body, bytes) else json.dumps(body),
                                   headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
    assert error["error"]["type"] == "invalid_request_error"


async def test_an_unknown_model_is_not_found(tiny_tokenizer):
    _, ctx = scripted(tiny_tokenizer, "Hi")
    with pytest.raises(anthropic.NotFoundError) as refused:
        await client(ctx).messages.create(model="claude-unknown", max_tokens=8, messages=ASK)
    assert refused.value.body["error"]["type"] == "not_found_error"
