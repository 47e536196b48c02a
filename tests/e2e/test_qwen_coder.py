"""The packaged model that calls tools by itself: `speclane serve
qwen2.5-coder-0.5b-instruct --tool-call-parser json`, with `tool_choice: "auto"`,
answers a weather question with a real tool call, streamed name first, and takes
the tool's result back. Skipped until `speclane pull qwen2.5-coder-0.5b-instruct` has run (2.5 GB)."""

import json

import openai
import pytest

from speclane.models import pulled_model_dir
from tests.e2e.stack import speclane_serve

MODEL = "qwen2.5-coder-0.5b-instruct"
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not (pulled_model_dir(MODEL) / "config.json").is_file(),
                                                  reason=f"run `speclane pull {MODEL}` first")]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_an_auto_tool_choice_gets_a_real_call_and_then_an_answer(tmp_path):
    with speclane_serve([MODEL, "--tool-call-parser", "json"], tmp_path / "serve.log") as (_, port):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
        ask = [{"role": "user", "content": "What is the weather in Paris right now?"}]
        first = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER], tool_choice="auto",
                                               max_tokens=64, temperature=0)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
        # Streamed, one token a step: the call's name goes out first, then its arguments in fragments.
        chunks = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER], tool_choice="auto",
                                                max_tokens=64, temperature=0, stream=True,
                                                extra_body={"speculation": {"method": "none"}})
        calls = [delta.tool_calls[0] for chunk in chunks if chunk.choices
                 and (delta := chunk.choices[0].delta).tool_calls]
        assert calls[0].function.name == "get_weather"
        fragments = [streamed.function.arguments for streamed in calls if streamed.function.arguments]
        assert len(fragments) >= 2 and json.loads("".join(fragments)) == {"city": "Paris"}
        history = [*ask, choice.message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21, "sky": "sunny"}'}]
        answer = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=48,
                                                temperature=0).choices[0]
    # This 0.5B model answers the tool's result by calling the tool again, a JSON object a line (then an echo of
    # the result): read as calls of the declared tool, the echo dropped, never as the raw JSON in the content.
    assert answer.finish_reason == "tool_calls" and not answer.message.content
    assert {call.function.name for call in answer.message.tool_calls} == {"get_weather"}
