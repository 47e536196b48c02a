import asyncio
import json

import httpx
import openai
import pytest

from gateway.errors import Overloaded
from gateway.openai_api import create_app
from gateway.types import TokenDelta
from tests.gateway.fakes import COMPLETION, FAKE_CACHED_TOKENS, MODEL_NAME, ScriptedEngine, call_asgi, make_context

pytestmark = pytest.mark.anyio
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Say hello"}]}


def client_for(ctx) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=create_app(ctx), raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://gateway")


async def post(ctx, body, path="/v1/chat/completions", **kwargs) -> httpx.Response:
    async with client_for(ctx) as client:
        return await client.post(path, json=body, **kwargs)


def sse_events(response: httpx.Response) -> list:
    lines = [line for line in response.text.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def steps_of(engine) -> int:
    return -(-len(engine.token_ids) // engine.step_size)


async def test_chat_completion(ctx, engine):
    response = await post(ctx, CHAT)
    assert response.status_code == 200
    body = response.json()
    assert body["id"].startswith("chatcmpl-") and response.headers["x-request-id"] == body["id"]
    assert body["object"] == "chat.completion" and body["model"] == MODEL_NAME
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": COMPLETION},
                                "logprobs": None, "finish_reason": "stop"}]
    prompt_tokens = len(engine.requests[0].prompt_token_ids)
    usage = engine.usage(steps_of(engine))
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens, "completion_tokens": len(engine.token_ids),
        "total_tokens": prompt_tokens + len(engine.token_ids),
        "prompt_tokens_details": {"cached_tokens": FAKE_CACHED_TOKENS},
        "completion_tokens_details": {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0},
        "speculation": {"draft_tokens": usage.draft_tokens, "accepted_tokens": usage.accepted_tokens,
                        "verify_steps": usage.verify_steps, "drafter_steps": usage.drafter_steps,
                        "head_steps": usage.head_steps, "next_round_steps": usage.next_round_steps}}
    assert engine.requests[0].request_id == body["id"]


@pytest.mark.parametrize("sent, kept", [(b"trace-42/a:b", True), (b"", False), (b"x" * 257, False),
                                        ("naïve".encode(), False)])
async def test_a_clients_request_id_is_carried_downstream(ctx, engine, sent, kept):
    response = await post(ctx, CHAT, headers={"X-Request-Id": sent})
    request_id = engine.requests[0].request_id
    assert response.headers["x-request-id"] == request_id
    assert (request_id == sent.decode("latin-1")) is kept
    assert kept or request_id == response.json()["id"]


async def test_request_parameters_reach_the_engine(ctx, engine):
    body = {**CHAT, "max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 20, "seed": 3,
            "speculation": {"method": "ngram", "prompt_lookup_max": 4}}
    response = await post(ctx, body, headers={"x-tenant-id": "team-a"})
    assert response.json()["choices"][0]["finish_reason"] == "length"
    request = engine.requests[0]
    assert (request.max_tokens, request.temperature, request.top_p, request.top_k, request.seed) == (7, 0.5, 0.9, 20, 3)
    assert (request.speculation.method, request.speculation.prompt_lookup_max) == ("ngram", 4)
    assert request.tenant == "team-a"


async def test_chat_streaming_with_usage(ctx, engine):
    response = await post(ctx, {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == response.headers["x-request-id"] for e in events)
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1])
    assert content == COMPLETION
    assert len(events) > 4  # really streamed in pieces
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert all(e["usage"] is None for e in events[:-1])
    assert events[-1]["choices"] == []
    assert events[-1]["usage"]["completion_tokens"] == len(engine.token_ids)
    assert events[-1]["usage"]["speculation"]["verify_steps"] == steps_of(engine)


async def test_streaming_without_include_usage_has_no_usage(ctx):
    events = sse_events(await post(ctx, {**CHAT, "stream": True}))
    assert all("usage" not in e for e in events)


async def test_stop_string_is_excluded_and_aborts_generation(ctx, engine):
    body = (await post(ctx, {**CHAT, "stop": "héllo"})).json()
    assert body["choices"][0]["message"]["content"] == "Hello world! "
    assert body["choices"][0]["finish_reason"] == "stop"
    assert engine.aborted == [body["id"]]
    events = sse_events(await post(ctx, {**CHAT, "stream": True, "stop": ["xyz", "你好"]}))
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == "Hello world! héllo 🚀 "


async def test_n_choices_run_concurrently_and_usage_is_summed(ctx, engine):
    body = (await post(ctx, {**CHAT, "n": 2, "seed": 9, "temperature": 1.0})).json()
    assert [c["message"]["content"] for c in body["choices"]] == [COMPLETION, COMPLETION]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["completion_tokens"] == 2 * len(engine.token_ids)
    assert body["usage"]["speculation"]["draft_tokens"] == 2 * engine.usage(steps_of(engine)).draft_tokens
    assert body["usage"]["prompt_tokens"] == len(engine.requests[0].prompt_token_ids)  # one shared prompt
    assert sorted(r.request_id for r in engine.requests) == [f"{body['id']}-0", f"{body['id']}-1"]
    assert sorted(r.seed for r in engine.requests) == [9, 10]


async def test_n_choices_streamed(ctx, engine):
    events = sse_events(await post(ctx, {**CHAT, "n": 2, "stream": True,
                                         "stream_options": {"include_usage": True}}))
    texts = {0: "", 1: ""}
    for event in events[:-1]:
        choice, = event["choices"]
        texts[choice["index"]] += choice["delta"].get("content", "")
    assert texts == {0: COMPLETION, 1: COMPLETION}
    assert events[-1]["usage"]["speculation"]["verify_steps"] == 2 * steps_of(engine)


async def test_text_completions(ctx, engine, tiny_tokenizer):
    body = (await post(ctx, {"prompt": "Once upon", "max_tokens": 50}, "/v1/completions")).json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == COMPLETION
    assert engine.requests[0].prompt_token_ids == tiny_tokenizer.encode("Once upon")
    await post(ctx, {"prompt": [5, 6, 7]}, "/v1/completions")
    assert engine.requests[1].prompt_token_ids == [5, 6, 7]
    assert engine.requests[1].max_tokens == 16  # OpenAI's default for this endpoint
    events = sse_events(await post(ctx, {"prompt": "x", "stream": True, "max_tokens": 50}, "/v1/completions"))
    assert "".join(e["choices"][0]["text"] for e in events) == COMPLETION


def assert_error(response, status, param=None, message=None, error_type="invalid_request_error", code=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == (error_type, param, code)
    assert message is None or message in error["message"]


@pytest.mark.parametrize("body, param, message", [
    ({**CHAT, "max_tokens": -1}, "max_tokens", "at least 1"),
    ({**CHAT, "messages": []}, "messages", "must not be empty"),
    ({**CHAT, "speculation": {"num_speculative_token": 4}}, "speculation", "unknown speculation key"),
    ({**CHAT, "temperature": 3}, "temperature", "between 0 and 2"),
    ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({**CHAT, "n": 0}, "n", "n must be between 1 and 8"),
    ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream"),
    ({"model": MODEL_NAME}, "messages", "missing required parameter"),
    ({**CHAT, "max_tokens": "many"}, "max_tokens", "valid integer"),
    ({**CHAT, "frobnicate": True}, "frobnicate", "Unrecognized request argument"),
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "between 0 and 20"),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs", "needs logprobs=true"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "not among the tools"),
    ({**CHAT, "tools": [{"type": "function"}]}, "tools.0", "must be"),
    ({**CHAT, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({**CHAT, "messages": [{"role": "tool", "content": "42"}]}, "messages.0.tool_call_id", "tool_call_id"),
    ({**CHAT, "messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages.0.tool_calls.0", "not valid JSON"),
    ({**CHAT, "presence_penalty": 2.5}, "presence_penalty", "between -2 and 2"),
    ({**CHAT, "repetition_penalty": 0}, "repetition_penalty", "repetition_penalty must be in"),
    ({**CHAT, "min_p": 1.5}, "min_p", "between 0 and 1"),
    ({**CHAT, "logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ({**CHAT, "logit_bias": {"5": 101}}, "logit_bias", "between -100 and 100"),
    ({**CHAT, "logit_bias": {"999999": 1}}, "logit_bias", "outside the vocabulary"),
    ({**CHAT, "min_tokens": 9, "max_tokens": 4}, "min_tokens", "between 0 and max_tokens"),
    ({**CHAT, "response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "JSON schema"),
    ({**CHAT, "prediction": {"type": "image", "content": "x"}}, "prediction.type", "must be content"),
    ({**CHAT, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "may not set tools"),
    ({**CHAT, "add_generation_prompt": False, "continue_final_message": True}, "continue_final_message",
     "assistant message last"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content", "only text content parts"),
])
async def test_bad_input_is_400_with_an_openai_error_body(ctx, engine, body, param, message):
    assert_error(await post(ctx, body), 400, param, message)
    assert engine.requests == []


async def test_neutral_values_of_unsupported_fields_are_accepted(ctx):
    body = {**CHAT, "logprobs": False, "tools": [], "tool_choice": "none", "presence_penalty": 0,
            "response_format": {"type": "text"}, "user": "u1",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hello"}]}]}
    assert (await post(ctx, body)).status_code == 200


async def test_malformed_json_is_400(ctx):
    async with client_for(ctx) as client:
        response = await client.post("/v1/chat/completions", content=b'{"messages": [',
                                     headers={"content-type": "application/json"})
    assert_error(response, 400, None, "not valid JSON")


async def test_completion_prompt_must_be_text_or_token_ids(ctx):
    assert_error(await post(ctx, {"prompt": ["a", "b"]}, "/v1/completions"), 400, "prompt", "batched prompts")


async def test_unknown_model_is_404(ctx):
    assert_error(await post(ctx, {**CHAT, "model": "gpt-4o"}), 404, "model", "does not exist", code="model_not_found")


async def test_over_the_concurrency_limit_is_429(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer)
    engine.hold = asyncio.Event()
    ctx = make_context(tiny_tokenizer, engine, max_concurrent_requests=1)
    async with client_for(ctx) as client:
        first = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
        await engine.started.wait()
        for body in (CHAT, {**CHAT, "stream": True}):
            assert_error(await client.post("/v1/chat/completions", json=body), 429,
                         error_type="rate_limit_error", code="overloaded")
        engine.hold.set()
        assert (await first).status_code == 200
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200  # slot freed
    assert len(engine.requests) == 2


@pytest.mark.parametrize("stream", [False, True])
async def test_overload_reported_by_the_engine_is_429(tiny_tokenizer, stream):
    ctx = make_context(tiny_tokenizer, ScriptedEngine(tiny_tokenizer, error=Overloaded("verifier is full")))
    assert_error(await post(ctx, {**CHAT, "stream": stream}), 429, message="verifier is full",
                 error_type="rate_limit_error", code="overloaded")
    assert ctx.limiter.in_flight == 0


async def test_unexpected_errors_are_500_with_a_generic_message(tiny_tokenizer):
    ctx = make_context(tiny_tokenizer, ScriptedEngine(tiny_tokenizer, error=RuntimeError("secret internals")))
    response = await post(ctx, CHAT)
    assert_error(response, 500, message="Internal server error", error_type="server_error")
    assert "secret" not in response.text


async def test_streaming_disconnect_closes_the_generation(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer)
    engine.hold = asyncio.Event()  # never set: the generation would run forever
    ctx = make_context(tiny_tokenizer, engine)
    sent = await call_asgi(create_app(ctx), "/v1/chat/completions", {**CHAT, "stream": True},
                           disconnect_after_first_chunk=True)
    assert sent[0]["status"] == 200
    assert engine.aborted == [engine.requests[0].request_id]
    assert ctx.limiter.in_flight == 0


async def test_non_streaming_disconnect_closes_the_generation(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer)
    engine.hold = asyncio.Event()
    ctx = make_context(tiny_tokenizer, engine)
    await call_asgi(create_app(ctx), "/v1/chat/completions", CHAT, disconnect_after_first_chunk=False)
    assert engine.aborted == [engine.requests[0].request_id]
    assert ctx.limiter.in_flight == 0


async def test_models_health_and_metrics(tiny_tokenizer, engine):
    ctx = make_context(tiny_tokenizer, engine)
    async with client_for(ctx) as client:
        models = (await client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == [MODEL_NAME]
        assert (await client.get("/health")).status_code == 200
        await client.post("/v1/chat/completions", json=CHAT)
        await client.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
        metrics = await client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    assert 'vllm:request_success_total{finished_reason="stop",model_name="tiny-chatml"} 1.0' in metrics.text
    assert 'speclane:request_errors_total{error_type="model_not_found",model_name="tiny-chatml"} 1.0' in metrics.text
    assert (await post(make_context(tiny_tokenizer, engine, ready=False), None, "/health")).status_code == 405
    async with client_for(make_context(tiny_tokenizer, engine, ready=False)) as client:
        assert (await client.get("/health")).status_code == 503


async def test_official_openai_client_reads_our_responses(ctx):
    http_client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(ctx)))
    client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="none", http_client=http_client, max_retries=0)
    completion = await client.chat.completions.create(model=MODEL_NAME, messages=CHAT["messages"])
    assert completion.choices[0].message.content == COMPLETION
    assert completion.usage.model_extra["speculation"]["verify_steps"] > 0
    chunks = [chunk async for chunk in await client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT["messages"], stream=True, stream_options={"include_usage": True},
        extra_body={"speculation": {"num_speculative_tokens": 4}})]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == COMPLETION
    assert chunks[-1].usage.completion_tokens > 0
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model=MODEL_NAME, messages=[])
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="gpt-4o", messages=CHAT["messages"])
    await http_client.aclose()


async def test_error_after_streaming_started_is_sent_in_band(tiny_tokenizer):
    class FailingEngine:
        async def generate(self, request):
            yield TokenDelta(tiny_tokenizer.encode("Hello", add_special_tokens=False))
            raise Overloaded("verifier lost")

    ctx = make_context(tiny_tokenizer, FailingEngine())
    events = sse_events(await post(ctx, {**CHAT, "stream": True}))
    assert events[1]["choices"][0]["delta"] == {"content": "Hello"}
    assert events[-1] == {"error": {"message": "verifier lost", "type": "rate_limit_error", "param": None,
                                    "code": "overloaded"}}
    assert ctx.limiter.in_flight == 0
