"""Fuzzing the OpenAI HTTP API (issue 14).

schemathesis generates request bodies from the app's own OpenAPI schema, valid
(positive) and invalid (negative) ones; hypothesis adds mutations of a request that
uses every feature, raw bytes, broken JSON, lone surrogates, huge numbers, deep
nesting and odd headers. The app is the real one, over the real serving layer and
the real propose/verify loop and gRPC clients, with in-process fake verifier and
drafter servers (tests/gateway/fake_services.py) answering on real gRPC streams.

Properties: never a 5xx; every 4xx in OpenAI's error shape; every 200 a well-formed
body or SSE stream; a body served was within the schema as the server read it (no
bound the schema states is ever passed); afterwards no
generation, slot or verifier session is left behind and a plain request is served
as before. `make fuzz` (SPECLANE_FUZZ_EXAMPLES) runs many more examples.
"""

import contextlib
import copy
import dataclasses
import functools
import json
import math
import traceback

import anyio.from_thread
import httpx
import jsonschema
import pytest
import schemathesis
import structlog
from hypothesis import given
from hypothesis import strategies as st
from schemathesis import GenerationMode

from gateway.json_limits import MAX_JSON_DEPTH
from gateway.openai_api import create_app
from gateway.openai_protocol import ChatCompletionRequest, CompletionRequest
from tests.fuzz_support import fuzz_settings, serving, wait_for
from tests.gateway.fake_services import FakeDrafter, FakeVerifier, gateway, target_tokens
from tests.gateway.fakes import MODEL_NAME, make_context

MAX_CONTEXT = 96  # keeps every generation short: the fake verifier runs to max_tokens
POSTS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")


class CountingVerifier(FakeVerifier):
    """The fake verifier, counting the sessions opened (FakeVerifier.outcomes counts those ended)."""

    opened = 0

    async def Session(self, request_iterator, context):
        self.opened += 1
        async for response in super().Session(request_iterator, context):
            yield response


@dataclasses.dataclass
class FuzzedGateway:
    portal: anyio.from_thread.BlockingPortal
    client: httpx.AsyncClient
    ctx: object
    verifier: CountingVerifier
    tokenizer: object
    schema: object

    def send(self, method: str, path: str, content: bytes | None = None, headers: dict | None = None
             ) -> httpx.Response:
        with structlog.testing.capture_logs() as logs:
            response = self.portal.call(functools.partial(self.client.request, method, path, content=content,
                                                          headers=headers))
        response.logs = logs  # the server's errors, for the failure message
        return response

    def post(self, path: str, body, **dumps) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body, **dumps).encode("utf-8", "surrogatepass")
        return self.send("POST", path, content, {"content-type": "application/json"})

    def running(self) -> tuple[int, int, int]:
        """Generations holding a slot, verifier sessions still open, and vllm:num_requests_running."""
        metrics = self.send("GET", "/metrics").text
        gauge = next(line for line in metrics.splitlines() if line.startswith("vllm:num_requests_running{"))
        return self.ctx.limiter.in_flight, self.verifier.opened - len(self.verifier.outcomes), \
            int(float(gauge.rsplit(" ", 1)[1]))

    def assert_still_serving(self) -> None:
        """Nothing left running (streams the gateway cancelled end a moment later), and a plain request served."""
        wait_for(lambda: self.running() == (0, 0, 0))
        response = self.post("/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0,
                                                      "messages": [{"role": "user", "content": "Say hello"}]})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["message"]["content"] == self.tokenizer.decode(target_tokens(0, 8))
        assert choice["finish_reason"] == "length"
        # The drafter still drafts: no input rested it for everyone.
        assert response.json()["usage"]["speculation"]["draft_tokens"] > 0, response.json()["usage"]
        assert self.send("GET", "/v1/models").json()["data"][0]["id"] == MODEL_NAME
        assert self.send("GET", "/health").status_code == 200
        wait_for(lambda: self.running() == (0, 0, 0))


@contextlib.asynccontextmanager
async def running_gateway(tokenizer):
    verifier = CountingVerifier()
    async with gateway([verifier], FakeDrafter()) as gw:
        ctx = dataclasses.replace(make_context(tokenizer, gw.orchestrator, max_context_len=MAX_CONTEXT),
                                  metrics=gw.metrics, drafter_limits=lambda: gw.client.limits)
        app = create_app(ctx)
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=30) as client:
            yield ctx, client, verifier, app


@pytest.fixture(scope="module")
def fuzzed(tiny_tokenizer):
    """The gateway on an event loop of its own, which the (synchronous) hypothesis tests call into."""
    with serving(lambda: running_gateway(tiny_tokenizer)) as (portal, (ctx, client, verifier, app)):
        schema = schemathesis.openapi.from_dict(app.openapi())
        yield FuzzedGateway(portal, client, ctx, verifier, tiny_tokenizer, schema)


def server_errors(response: httpx.Response) -> str:
    """The tracebacks the server logged while answering (for a failure's message)."""
    return "\n".join("".join(traceback.format_exception(entry["exc_info"]))
                     for entry in getattr(response, "logs", []) if isinstance(entry.get("exc_info"), BaseException))


def assert_openai_error(response: httpx.Response) -> None:
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error


def assert_completion(response: httpx.Response) -> None:
    """A 200 of a completions endpoint: one JSON body, or an SSE stream ending in [DONE]."""
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [event for event in response.text.split("\n\n") if event]
        assert events and all(event.startswith("data: ") for event in events), response.text
        assert events[-1] == "data: [DONE]", response.text
        chunks = [json.loads(event[len("data: "):]) for event in events[:-1]]
        assert chunks and all("choices" in chunk and "error" not in chunk for chunk in chunks), response.text
        finished = [c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c.get("finish_reason")]
        assert finished, response.text
    else:
        body = response.json()
        assert body["choices"] and all(choice["finish_reason"] for choice in body["choices"]), body
        assert body["usage"]["completion_tokens"] >= len(body["choices"]), body


MODELS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}
VALIDATORS = {path: jsonschema.Draft202012Validator(model.model_json_schema()) for path, model in MODELS.items()}


def assert_served_within_the_schema(response: httpx.Response) -> None:
    """A body served was within the schema as the server read it. (It reads JSON leniently, as vLLM
    does: `false` or `"5"` for a number is taken as 0 or 5, so the bytes sent need not be.)"""
    path, body = response.request.url.path, json.loads(response.request.content)
    model = MODELS[path]
    read = model.model_validate(body).model_dump(mode="json", exclude_unset=True)
    read = {name: value for name, value in read.items() if name not in model.refused}  # taken when neutral
    errors = [f"{'/'.join(map(str, error.absolute_path))}: {error.message}"
              for error in VALIDATORS[path].iter_errors(read)]
    assert not errors, f"served {body}, read as {read}, outside the schema: {errors}"


def assert_anthropic_error(response: httpx.Response) -> None:
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["message"], body


def sse_events(response: httpx.Response) -> list[dict]:
    """The data of each event of an Anthropic or Responses stream (`event:` and `data:` lines)."""
    events = [event for event in response.text.split("\n\n") if event]
    assert all(event.startswith("event: ") and "\ndata: " in event for event in events), response.text
    return [json.loads(event.split("\ndata: ", 1)[1]) for event in events]


def assert_message(response: httpx.Response) -> None:
    if response.headers["content-type"].startswith("text/event-stream"):
        kinds = [event["type"] for event in sse_events(response)]
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop", response.text
    else:
        body = response.json()
        assert body["type"] == "message" and body["stop_reason"], body


def assert_response(response: httpx.Response) -> None:
    if response.headers["content-type"].startswith("text/event-stream"):
        events = sse_events(response)
        assert events[0]["type"] == "response.created", response.text
        assert events[-1]["type"] in ("response.completed", "response.incomplete"), response.text
    else:
        body = response.json()
        assert body["object"] == "response" and body["status"] in ("completed", "incomplete"), body


def check(response: httpx.Response) -> None:
    """The properties every answer has, whatever was sent."""
    assert response.status_code < 500, f"{response.status_code} {response.text}\n{server_errors(response)}"
    path = response.request.url.path
    if response.status_code >= 400:
        (assert_anthropic_error if path.startswith("/v1/messages") else assert_openai_error)(response)
    elif response.request.method == "POST":
        assert response.status_code == 200, response.text
        if path in MODELS:
            assert_completion(response)
            assert_served_within_the_schema(response)
        elif path == "/v1/messages":
            assert_message(response)
        elif path == "/v1/messages/count_tokens":
            assert isinstance(response.json()["input_tokens"], int), response.text
        else:
            assert_response(response)


# -- schemathesis: bodies from the OpenAPI schema -------------------------------------------------------------

def test_the_schema_describes_the_request_bodies(fuzzed):
    """What the fuzzer generates from: the bodies' fields, bounds and closed objects, not `{}`."""
    components = fuzzed.schema.raw_schema["components"]["schemas"]
    chat, text = components["ChatCompletionRequest"], components["CompletionRequest"]
    assert chat["additionalProperties"] is False and text["additionalProperties"] is False
    assert chat["required"] == ["messages"] and chat["properties"]["messages"]["minItems"] == 1
    assert components["ChatMessage"]["properties"]["role"]["enum"] == ["system", "developer", "user", "assistant",
                                                                        "tool"]
    assert (chat["properties"]["temperature"]["minimum"], chat["properties"]["temperature"]["maximum"]) == (0, 2)
    assert chat["properties"]["top_logprobs"]["maximum"] == 20 and text["properties"]["logprobs"]["maximum"] == 5
    assert {"type": "array", "items": {"type": "integer", "minimum": 0}} in text["properties"]["prompt"]["anyOf"]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_schemathesis_bodies(fuzzed, mode):
    strategy = fuzzed.schema.include(method="POST").as_strategy(mode)

    @fuzz_settings(100)
    @given(data=st.data())
    def run(data):
        case = data.draw(strategy, label="case")
        sent = case.as_transport_kwargs(base_url="http://gateway")
        if "json" in sent:
            content = json.dumps(sent["json"]).encode()
        else:
            content = sent.get("data") or b""
            content = content.encode() if isinstance(content, str) else content
        response = fuzzed.send(sent["method"], case.formatted_path, content,
                               {"content-type": sent["headers"].get("Content-Type", "application/json")})
        check(response)  # a body served is within the schema, as the server read it

    run()
    fuzzed.assert_still_serving()


# -- hypothesis: mutations of a request that uses every feature ---------------------------------------------

RICH_CHAT = {
    "model": MODEL_NAME,
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Call f"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2"},
    ],
    "max_tokens": 6, "max_completion_tokens": 6, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 1,
    "stop": ["xyz"], "stop_token_ids": [5], "ignore_eos": False, "n": 2, "stream": True,
    "stream_options": {"include_usage": True},
    "speculation": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "presence_penalty": 0.1, "frequency_penalty": 0.1, "repetition_penalty": 1.1, "min_p": 0.05, "min_tokens": 1,
    "logit_bias": {"5": 1.5}, "logprobs": True, "top_logprobs": 2,
    "tools": [{"type": "function", "function": {"name": "f", "description": "adds one", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}],
    "tool_choice": {"type": "function", "function": {"name": "f"}}, "parallel_tool_calls": False,
    "prediction": {"type": "content", "content": "Hello"}, "chat_template_kwargs": {"enable_thinking": False},
    "add_generation_prompt": True, "continue_final_message": False, "response_format": {"type": "text"},
    "user": "someone", "metadata": {"team": "a"},
}
RICH_TEXT = {"model": MODEL_NAME, "prompt": "Once upon", "max_tokens": 6, "logprobs": 2, "n": 2, "stream": False,
             "temperature": 0, "stop": "xyz", "speculation": {"method": "suffix", "num_speculative_tokens": 3},
             "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}}


def nested(depth: int, leaf=1):
    for _ in range(depth):
        leaf = [leaf]
    return leaf


# Values that sit on some check's edge: types, bounds, int32/int64/uint64 limits, odd text.
EDGE_VALUES = [
    None, True, False, 0, 1, -1, 2, 5, 20, 21, 64, 65, 100, 101, 2**31 - 1, 2**31, 2**32, 2**63, 2**64 - 1, 2**64,
    -2**31 - 1, -2**63, 10**30, 0.0, -0.0, 0.5, 1.5, 2.5, 1e-300, 1e308, math.inf, -math.inf, math.nan, "", " ", "a",
    "auto", "none", "required", "text", "function", "json_object", "json_schema", "content", "user", "assistant",
    "tool", "suffix", "ngram", "<tool_call>", "\ud800", "a\udfffb", "\x00", "{", "{}", "[1]", "1e5", "٣",
    "😀" * 50, "x" * 5000, [], {}, [[]], [{}], [None], [1, -1], ["\ud800"], {"": None}, {"\ud800": 1},
    {"type": "json_schema"}, {"type": "json_schema", "json_schema": "x"}, {"function": "f"},
    {"type": "function", "function": {"name": 5}}, nested(MAX_JSON_DEPTH + 5), nested(600, {"a": 1}),
]
# Each drawn fresh (from its JSON text): a mutation may add to a drawn list or object.
EDGE_JSON = [json.dumps(value) for value in EDGE_VALUES]
keys = st.sampled_from(["type", "function", "name", "content", "role", "schema", "json_schema", "text", "x",
                        "arguments", "parameters", "method", "\ud800"]) | st.text(max_size=6)
scalars = (st.sampled_from(EDGE_JSON).map(json.loads) | st.none() | st.booleans() | st.integers()
           | st.floats(allow_nan=True, allow_infinity=True)
           | st.text(st.characters(exclude_categories=()), max_size=12))  # surrogates included
json_values = st.recursive(scalars, lambda children: st.lists(children, max_size=3)
                           | st.dictionaries(keys, children, max_size=3), max_leaves=8)


def paths(value, prefix=()):
    """Every path into a JSON value (dict keys and list indices), the root included."""
    yield prefix
    if isinstance(value, dict):
        for key, child in value.items():
            yield from paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from paths(child, (*prefix, index))


@st.composite
def mutated(draw, template: dict):
    """The template with 1 to 3 of its values replaced, deleted, or given a new key or element."""
    body = copy.deepcopy(template)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(list(paths(body))))
        parent = body
        for part in path[:-1]:
            parent = parent[part]
        target = parent[path[-1]] if path else body
        action = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
        if action == "add" and isinstance(target, dict):
            target[draw(keys)] = draw(json_values)
        elif action == "add" and isinstance(target, list):
            target.insert(draw(st.integers(0, len(target))), draw(json_values))
        elif action == "delete" and path:
            del parent[path[-1]]
        elif path:
            parent[path[-1]] = draw(json_values)
        else:
            body = draw(json_values)
            break
    return body


RICH_MESSAGES = {
    "model": MODEL_NAME, "max_tokens": 6, "system": [{"type": "text", "text": "Be brief."}], "stream": True,
    "messages": [
        {"role": "user", "content": "Call f"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "f it is", "signature": ""},
                                          {"type": "text", "text": "Calling."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "2"},
                                     {"type": "text", "text": "And now?"}]},
    ],
    "tools": [{"name": "f", "description": "adds one", "input_schema": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}],
    "tool_choice": {"type": "tool", "name": "f", "disable_parallel_tool_use": True},
    "stop_sequences": ["xyz"], "temperature": 0.5, "top_p": 0.9, "top_k": 5, "thinking": {"type": "disabled"},
    "metadata": {"user_id": "someone"}, "speculation": {"method": "suffix", "num_speculative_tokens": 3},
}
RICH_RESPONSES = {
    "model": MODEL_NAME, "instructions": "Be brief.", "max_output_tokens": 6, "stream": True, "store": True,
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Call f"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "f it is"}]},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{\"x\": 1}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "2"},
        {"type": "message", "role": "user", "content": "And now?"},
    ],
    "tools": [{"type": "function", "name": "f", "description": "adds one", "strict": True, "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}],
    "tool_choice": "auto", "parallel_tool_calls": False, "temperature": 0.5, "top_p": 0.9,
    "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}},
    "reasoning": {"effort": "low"}, "speculation": {"method": "ngram", "num_speculative_tokens": 4},
}
RICH = {"/v1/chat/completions": RICH_CHAT, "/v1/completions": RICH_TEXT, "/v1/messages": RICH_MESSAGES,
        "/v1/responses": RICH_RESPONSES}


def test_the_rich_requests_are_served(fuzzed):
    """The mutations start from requests that work, so each mutation tests one change."""
    for path, body in RICH.items():
        response = fuzzed.post(path, body)
        assert response.status_code == 200, response.text
        check(response)


@pytest.mark.parametrize("path, template", list(RICH.items()))
def test_mutated_requests(fuzzed, path, template):
    @fuzz_settings(300)
    @given(body=mutated(template), ascii_only=st.booleans())
    def run(body, ascii_only):
        # ensure_ascii=False writes a lone surrogate as raw (invalid UTF-8) bytes, else as a \ud800 escape.
        check(fuzzed.post(path, body, ensure_ascii=ascii_only))

    run()
    fuzzed.assert_still_serving()


# -- hypothesis: bytes that are not (good) JSON, and headers ------------------------------------------------

VALID_CHAT = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()


@st.composite
def broken_bytes(draw) -> bytes:
    """Random bytes, or a valid body with bytes flipped, cut off, or spliced in."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=64))
    data = bytearray(VALID_CHAT)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        choice = draw(st.sampled_from(["flip", "cut", "splice"]))
        if choice == "flip" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif choice == "cut":
            del data[at:]
        else:
            data[at:at] = draw(st.sampled_from([b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\\ud800", b"\\u0000",
                                                b"NaN", b"1e999", b"9" * 400, b"[" * 2000, b"{", b"}", b",", b'"',
                                                b"\x00", b"\r\n", b"\xef\xbb\xbf"]))
    return bytes(data)


@pytest.mark.parametrize("path", POSTS)
def test_broken_bodies(fuzzed, path):
    @fuzz_settings(150)
    @given(content=broken_bytes(), content_type=st.sampled_from(["application/json", "text/plain", "", "x/y;;"]))
    def run(content, content_type):
        check(fuzzed.send("POST", path, content, {"content-type": content_type} if content_type else {}))

    run()
    fuzzed.assert_still_serving()


header_values = st.binary(max_size=300).map(lambda raw: raw.replace(b"\r", b"").replace(b"\n", b"").strip())


def test_odd_headers(fuzzed):
    @fuzz_settings(100)
    @given(headers=st.dictionaries(st.sampled_from(["x-request-id", "x-tenant-id", "authorization", "accept",
                                                    "content-type", "x-other"]), header_values, max_size=4))
    def run(headers):
        check(fuzzed.send("POST", "/v1/chat/completions", VALID_CHAT,
                          {"content-type": "application/json", **headers}))

    run()
    fuzzed.assert_still_serving()


# -- the inputs that once broke it, and their kin ---------------------------------------------------------------

def chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


REFUSED = {
    # Each was a 500 before the fix noted in the report of issue 14.
    "lone surrogate in content": chat(messages=[{"role": "user", "content": "\ud800"}]),
    "lone surrogate in a text prompt": ("/v1/completions", {"prompt": "a\udfffb"}),
    "lone surrogate in a prediction": chat(prediction={"content": "\ud800"}),
    "lone surrogate in a tool name": chat(tools=[{"type": "function", "function": {"name": "\ud800"}}]),
    "lone surrogate in a schema key": chat(response_format={"type": "json_schema",
                                                            "json_schema": {"schema": {"\ud800": {}}}}),
    "json_schema not an object": chat(response_format={"type": "json_schema", "json_schema": "x"}),
    "tool_choice function not an object": chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                               tool_choice={"type": "function", "function": "f"}),
    "tool call function not an object": chat(messages=[{"role": "assistant", "tool_calls": [{"function": "f"}]}]),
    "deep chat_template_kwargs": chat(chat_template_kwargs={"x": nested(500)}),
    "deep tool parameters": chat(tools=[{"type": "function", "function": {"name": "f",
                                                                          "parameters": {"x": nested(500)}}}]),
    "deep response_format": chat(response_format={"type": "json_schema",
                                                  "json_schema": {"schema": {"x": nested(MAX_JSON_DEPTH)}}}),
    "prompt_lookup_max beyond uint32": chat(speculation={"method": "ngram", "prompt_lookup_max": 2**40}),
    # Was an UNKNOWN from the drafter, which the gateway took for a dead drafter: no drafts for anyone for 5 s.
    "prompt_lookup_max beyond the drafter's": chat(speculation={"method": "ngram", "prompt_lookup_max": 1025}),
    # Refused without ever failing.
    "huge max_tokens": chat(max_tokens=10**30),
    "NaN temperature": chat(temperature=math.nan),
    "infinite top_p": chat(top_p=math.inf),
    "seed beyond uint64": chat(seed=2**64),
    "negative stop token": chat(stop_token_ids=[-1]),
    "token id beyond the vocabulary": ("/v1/completions", {"prompt": [2**40]}),
}


@pytest.mark.parametrize("name", REFUSED)
def test_inputs_that_broke_it_are_refused(fuzzed, name):
    path, body = REFUSED[name] if isinstance(REFUSED[name], tuple) else ("/v1/chat/completions", REFUSED[name])
    response = fuzzed.post(path, body)
    assert response.status_code == 400, f"{response.text}\n{server_errors(response)}"
    assert_openai_error(response)
    fuzzed.assert_still_serving()


@pytest.mark.parametrize("tenant", [b"caf\xe9", b"a\x01b", b"t" * 129])
def test_a_tenant_that_cannot_travel_to_the_drafter_is_refused(fuzzed, tenant):
    """Was a 200 that rested the drafter for every request: gRPC metadata takes printable ASCII only."""
    response = fuzzed.send("POST", "/v1/chat/completions", VALID_CHAT,
                           {"content-type": "application/json", "x-tenant-id": tenant})
    assert response.status_code == 400, response.text
    assert_openai_error(response)
    assert response.json()["error"]["param"] == "x-tenant-id"
    fuzzed.assert_still_serving()


@pytest.mark.parametrize("top_k", [2**31, 10**30])
def test_a_top_k_beyond_int32_is_served_as_no_cut(fuzzed, top_k):
    """Was a 500: the verifier's top_k is an int32 (any k beyond the vocabulary keeps every token)."""
    response = fuzzed.post("/v1/chat/completions", chat(top_k=top_k))
    assert response.status_code == 200, f"{response.text}\n{server_errors(response)}"


@pytest.mark.parametrize("content", [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + b"9" * 5000 + b"}",
    b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',
    b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',  # a surrogate as (invalid) UTF-8 bytes
    b"",
], ids=["deep array", "deep messages", "5000-digit number", "non-UTF-8", "encoded surrogate", "empty"])
def test_unparseable_bodies_are_refused(fuzzed, content):
    response = fuzzed.send("POST", "/v1/chat/completions", content, {"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert_openai_error(response)

