"""Tool calls, logprobs and predicted-output usage in the OpenAI API's bodies
and streams, read back with the official client."""

import dataclasses
import json

import httpx
import openai
import pytest

from gateway.openai_api import create_app
from gateway.reasoning import REASONING_PARSERS
from gateway.types import SpeculationUsage
from tests.gateway.fakes import MODEL_NAME, ScriptedEngine, make_context

pytestmark = pytest.mark.anyio
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def openai_client(ctx) -> openai.AsyncOpenAI:
    transport = httpx.ASGITransport(app=create_app(ctx))
    return openai.AsyncOpenAI(api_key="none", base_url="http://gateway/v1",
                              http_client=httpx.AsyncClient(transport=transport), max_retries=0)


def scripted(tokenizer, completion: str, **kwargs):
    engine = ScriptedEngine(tokenizer, completion, **kwargs)
    return engine, make_context(tokenizer, engine)


async def test_a_tool_call_comes_back_as_tool_calls(tiny_tokenizer):
    engine, ctx = scripted(tiny_tokenizer, CALL)
    reply = await openai_client(ctx).chat.completions.create(model=MODEL_NAME, messages=ASK, tools=[WEATHER])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert engine.requests[0].grammar is None  # auto: the model chooses
    prompt = tiny_tokenizer.decode(engine.requests[0].prompt_token_ids)
    assert "Weather in Paris?" in prompt


async def test_tool_calls_stream_as_deltas(tiny_tokenizer):
    _, ctx = scripted(tiny_tokenizer, "Checking." + CALL, step_size=2)
    stream = await openai_client(ctx).chat.completions.create(model=MODEL_NAME, messages=ASK, tools=[WEATHER],
                                                              stream=True)
    chunks = [chunk async for chunk in stream]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [call for c in chunks if c.choices for call in (c.choices[0].delta.tool_calls or [])]
    assert content == "Checking."
    # As OpenAI streams a call: id and name first, then the arguments in fragments.
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
    assert len(calls) > 2 and all(c.index == 0 and c.id is None and c.function.name is None for c in calls[1:])
    assert json.loads("".join(c.function.arguments for c in calls)) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


async def test_tool_choice_none_leaves_the_text_alone(tiny_tokenizer):
    _, ctx = scripted(tiny_tokenizer, CALL)
    reply = await openai_client(ctx).chat.completions.create(model=MODEL_NAME, messages=ASK, tools=[WEATHER],
                                                             tool_choice="none")
    assert reply.choices[0].message.content == CALL and reply.choices[0].finish_reason == "stop"


async def test_required_tool_choice_sends_a_grammar(tiny_tokenizer):
    engine, ctx = scripted(tiny_tokenizer, CALL)
    await openai_client(ctx).chat.completions.create(model=MODEL_NAME, messages=ASK, tools=[WEATHER],
                                                     tool_choice="required")
    assert "<tool_call>" in engine.requests[0].grammar and '"get_weather"' in engine.requests[0].grammar


async def test_a_tool_round_renders_the_call_and_its_result(tiny_tokenizer):
    engine, ctx = scripted(tiny_tokenizer, "Sunny.")
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C and sunny"}]
    template = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% for c in m.tool_calls or [] %}"
                "<call {{ c.function.name }} {{ c.function.arguments | tojson }}>{% endfor %}{% endfor %}[assistant]")
    ctx.chat_template = template
    reply = await openai_client(ctx).chat.completions.create(model=MODEL_NAME, messages=messages, tools=[WEATHER])
    assert reply.choices[0].message.content == "Sunny."
    prompt = tiny_tokenizer.decode(engine.requests[0].prompt_token_ids)
    assert prompt == ('[user]Weather in Paris?[assistant]<call get_weather {"city": "Paris"}>'
                      "[tool]21 C and sunny[assistant]")


async def test_chat_logprobs(tiny_tokenizer):
    engine, ctx = scripted(tiny_tokenizer, "Hello world!")
    reply = await openai_client(ctx).chat.completions.create(model=MODEL_NAME, messages=ASK, logprobs=True,
                                                             top_logprobs=2)
    entries = reply.choices[0].logprobs.content
    assert engine.requests[0].logprobs == 2
    assert [e.logprob for e in entries] == [-t / 1000 for t in engine.token_ids]
    assert "".join(e.token for e in entries[:-1]) == "Hello world!"
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == e.logprob for e in entries)
    assert bytes(entries[0].bytes).decode() == entries[0].token


async def test_streamed_logprobs_cover_every_token_once(tiny_tokenizer):
    engine, ctx = scripted(tiny_tokenizer, "Hello world!", step_size=2)
    stream = await openai_client(ctx).chat.completions.create(model=MODEL_NAME, messages=ASK, logprobs=True,
                                                              stream=True)
    entries = [e for c in [c async for c in stream] if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
    assert [e.logprob for e in entries] == [-t / 1000 for t in engine.token_ids]
    assert all(e.top_logprobs == [] for e in entries)


async def test_text_completion_logprobs_are_cut_with_a_stop_string(tiny_tokenizer):
    engine, ctx = scripted(tiny_tokenizer, "Hello world! The fox")
    reply = await openai_client(ctx).completions.create(model=MODEL_NAME, prompt="Say", logprobs=1, stop=["!"],
                                                        max_tokens=20)
    logprobs = reply.choices[0].logprobs
    assert reply.choices[0].text == "Hello world"
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == reply.usage.completion_tokens
    assert "".join(logprobs.tokens).startswith("Hello world")
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset[1] == len(logprobs.tokens[0])
    assert [list(top) for top in logprobs.top_logprobs] == [[token] for token in logprobs.tokens]


async def test_prediction_is_tokenized_and_its_usage_reported(tiny_tokenizer):
    engine, ctx = scripted(tiny_tokenizer, "Hello world!")
    engine.usage = lambda steps: SpeculationUsage(10, 7, steps, prediction_draft_tokens=8,
                                                  prediction_accepted_tokens=6)
    reply = await openai_client(ctx).chat.completions.create(
        model=MODEL_NAME, messages=ASK, prediction={"type": "content", "content": "Hello world!"})
    assert engine.requests[0].prediction_token_ids == tuple(tiny_tokenizer.encode("Hello world!",
                                                                                  add_special_tokens=False))
    details = reply.usage.completion_tokens_details
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (6, 2)


async def test_logit_controls_reach_the_engine(tiny_tokenizer):
    engine, ctx = scripted(tiny_tokenizer, "Hello")
    await openai_client(ctx).chat.completions.create(
        model=MODEL_NAME, messages=ASK, presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={"7": -100},
        extra_body={"repetition_penalty": 1.2, "min_p": 0.1, "min_tokens": 2})
    controls = engine.requests[0].logit_controls
    assert (controls.presence_penalty, controls.frequency_penalty, controls.repetition_penalty, controls.min_p,
            controls.min_tokens, controls.logit_bias) == (0.5, -0.5, 1.2, 0.1, 2, ((7, -100.0),))


async def test_response_format_and_template_switches_reach_the_engine(tiny_tokenizer):
    engine, ctx = scripted(tiny_tokenizer, "{}")
    ctx.chat_template = "{{ flavour }}:{% for m in messages %}{{ m.content }}{% endfor %}"
    await openai_client(ctx).chat.completions.create(
        model=MODEL_NAME, messages=[*ASK, {"role": "assistant", "content": "It is"}],
        response_format={"type": "json_object"},
        extra_body={"chat_template_kwargs": {"flavour": "salty"}, "add_generation_prompt": False,
                    "continue_final_message": True})
    request = engine.requests[0]
    assert request.grammar == 'start: %json {"type": "object"}'
    assert tiny_tokenizer.decode(request.prompt_token_ids) == "salty:Weather in Paris?It is"


async def test_reasoning_is_split_off_with_a_reasoning_parser(tiny_tokenizer):
    _, ctx = scripted(tiny_tokenizer, "<think>Paris is in France.</think>\n\nSunny.")
    ctx = dataclasses.replace(ctx, reasoning_parser=REASONING_PARSERS["qwen3"])
    reply = await openai_client(ctx).chat.completions.create(model=MODEL_NAME, messages=ASK)
    message = reply.choices[0].message
    assert message.content == "Sunny."
    assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"] == "Paris is in France."
    chunks = [c async for c in await openai_client(ctx).chat.completions.create(model=MODEL_NAME, messages=ASK,
                                                                                 stream=True)]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "Paris is in France."
    assert "".join(d.content or "" for d in deltas) == "Sunny."
