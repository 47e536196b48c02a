"""The streaming client against canned server answers (httpx's mock transport)."""

import asyncio
import json

import httpx

from speclane_cli.bench.client import api_base, stream_chat

URL = "http://server:8000"


def sse(*chunks) -> bytes:
    return "".join(f"data: {json.dumps(c) if not isinstance(c, str) else c}\n\n" for c in chunks).encode()


def delta(text):
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}], "usage": None}


USAGE = {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19,
                                  "speculation": {"draft_tokens": 8, "accepted_tokens": 5, "verify_steps": 2}}}


def send(handler, body=None):
    seen = {}

    def record(request: httpx.Request) -> httpx.Response:
        seen["body"], seen["headers"] = json.loads(request.content), request.headers
        return handler(request)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(record)) as client:
            return await stream_chat(client, URL, body or {"messages": []}, {"x-tenant-id": "t1"})

    result, reply = asyncio.run(go())
    return result, reply, seen


def test_a_streamed_reply_gives_text_timings_and_speculation_counters():
    stream = sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}], "usage": None},
                 delta("Hel"), delta("lo, world"), USAGE, "[DONE]")
    result, reply, seen = send(lambda request: httpx.Response(200, content=stream))
    assert seen["headers"]["x-tenant-id"] == "t1"
    assert reply == {"role": "assistant", "content": "Hello, world"} and result.tool_calls == 0
    assert result.ok
    assert (result.input_tokens, result.output_tokens) == (12, 7)
    assert (result.draft_tokens, result.accepted_tokens, result.verify_steps) == (8, 5, 2)
    assert 0 < result.ttft <= result.e2e


def test_a_streamed_tool_call_is_put_together_from_its_fragments():
    def call(index, **fields):
        return {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": index, **fields}]}}], "usage": None}

    stream = sse(call(0, id="call_a", type="function", function={"name": "write_file", "arguments": ""}),
                 call(0, function={"arguments": '{"path": '}), call(0, function={"arguments": '"a.py"}'}),
                 call(1, id="call_b", function={"name": "run_tests", "arguments": "{}"}), USAGE, "[DONE]")
    result, reply, _ = send(lambda request: httpx.Response(200, content=stream))
    assert result.ok and result.tool_calls == 2 and 0 < result.ttft <= result.e2e
    assert reply == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "write_file", "arguments": '{"path": "a.py"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "run_tests", "arguments": "{}"}}]}


def test_an_http_error_is_a_failed_request_with_the_servers_message():
    result, reply, _ = send(lambda request: httpx.Response(400, json={"error": {"message": "bad method"}}))
    assert not result.ok
    assert result.error.startswith("HTTP 400") and "bad method" in result.error
    assert reply == {}


def test_an_in_band_error_after_the_headers_is_a_failed_request():
    stream = sse(delta("partial"), {"error": {"message": "verifier went away", "type": "server_error"}}, "[DONE]")
    result, _, _ = send(lambda request: httpx.Response(200, content=stream))
    assert not result.ok and result.error == "verifier went away"


def test_a_stream_without_usage_is_a_failed_request():
    result, _, _ = send(lambda request: httpx.Response(200, content=sse(delta("x"), "[DONE]")))
    assert not result.ok and "usage" in result.error


def test_a_server_without_speculation_counters_still_measures():
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
    result, _, _ = send(lambda request: httpx.Response(200, content=sse(delta("a"), delta("b"), usage)))
    assert result.ok and result.output_tokens == 2
    assert result.draft_tokens is None and result.verify_steps is None


def test_api_base_accepts_either_form():
    assert api_base("http://h:1") == api_base("http://h:1/") == api_base("http://h:1/v1") == "http://h:1/v1"


def test_time_to_first_token_is_the_first_chunk_not_the_first_visible_text():
    async def stream():
        yield sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}], "usage": None})
        await asyncio.sleep(0.3)  # a tool call's name takes some tokens to appear
        yield sse(delta("x"), USAGE, "[DONE]")

    result, _, _ = send(lambda request: httpx.Response(200, content=stream()))
    assert result.ok and result.ttft < 0.2 <= result.e2e
