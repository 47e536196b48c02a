"""The official openai client against the running gateway."""

import urllib.request

import openai
import pytest

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m-instruct"
HELLO = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)


def test_lists_the_served_model(client):
    assert [m.id for m in client.models.list()] == [MODEL]


def test_chat_completion(client):
    reply = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=16, temperature=0)
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens <= 16
    assert reply.usage.prompt_tokens > 0
    speculation = reply.usage.model_extra["speculation"]
    assert speculation["verify_steps"] >= 1
    assert set(speculation) == {"draft_tokens", "accepted_tokens", "verify_steps", "drafter_steps", "head_steps",
                                "next_round_steps"}


def test_a_repeated_prompt_reports_the_tokens_the_prefix_cache_held(client):
    # A salt of its own: no other test's prompt is in the cache under it.
    messages = [{"role": "system", "content": "You answer questions about colors, briefly. " * 6}, *HELLO]
    first, second = (client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                                    extra_body={"cache_salt": "cached-tokens-test"})
                     for _ in range(2))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    # To the token: all of the prompt but its last token, which the first step computes.
    assert cached == second.usage.prompt_tokens - 1


def test_streaming_matches_non_streaming_and_reports_usage(client):
    whole = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert "speculation" in chunks[-1].usage.model_extra
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]


def test_stop_string_is_excluded_and_ends_generation(client):
    messages = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0)
    text = full.choices[0].message.content
    assert "5" in text, text
    stopped = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0,
                                             stop=["5"])
    assert stopped.choices[0].message.content == text[:text.index("5")]
    assert stopped.choices[0].finish_reason == "stop"


def test_completions_endpoint(client):
    reply = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=12, temperature=0)
    assert reply.choices[0].text
    assert reply.usage.completion_tokens <= 12


@pytest.mark.parametrize("kwargs", [
    {"max_tokens": -1},
    {"messages": []},
    {"temperature": -0.5},
    {"extra_body": {"speculation": {"method": "eagle9"}}},
], ids=["negative-max-tokens", "empty-messages", "negative-temperature", "unknown-speculation-method"])
def test_bad_input_is_a_400_with_an_openai_error_body(client, kwargs):
    request = {"model": MODEL, "messages": HELLO, **kwargs}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**request)
    error = caught.value.body
    assert error["type"] == "invalid_request_error"
    assert error["message"]


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-17", messages=HELLO, max_tokens=4)
    assert "gpt-17" in caught.value.body["message"]


def test_metrics_expose_spec_decode_counters(stack, client):
    client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0)
    with urllib.request.urlopen(stack.base_url.removesuffix("/v1") + "/metrics") as reply:
        text = reply.read().decode()
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", "speclane:verify_steps_total"):
        assert name in text
