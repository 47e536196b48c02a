"""Fuzzing the gateway's gRPC Generate API (issue 14): random GenerateRequest
messages, every field drawn from values in and out of bounds (texts, token ids,
chats with tool calls, sampling settings incl. NaN and infinities, speculation,
tools with JSON schemas that are invalid or nested thousands deep, JSON schema
output, template arguments), through the real servicer, serving layer, the
real propose/verify loop and gRPC clients, with in-process fake verifier and
drafter servers answering on real gRPC streams.

Every call ends OK (a stream whose last message finishes it and counts its
tokens) or with INVALID_ARGUMENT / NOT_FOUND / RESOURCE_EXHAUSTED, never UNKNOWN
or INTERNAL. Afterwards nothing is left running, and a plain request is served,
with drafts. (Lone surrogates cannot be put in a protobuf string: the HTTP API's
fuzz, test_fuzz_openapi.py, sends those.) Bytes that are no GenerateRequest at all
get grpc's own answer (UNKNOWN: its deserializer fails before our code runs), and
the server goes on serving.
"""

import contextlib
import dataclasses
import json

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.grpc_api import add_generation_servicer
from gateway.json_limits import MAX_JSON_DEPTH
from protos.common.v1 import common_pb2
from protos.conventions import CHANNEL_OPTIONS
from protos.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.fuzz_support import fuzz_settings, serving, wait_for
from tests.gateway.fake_services import FakeDrafter, FakeVerifier, gateway, serve, target_tokens
from tests.gateway.fakes import MODEL_NAME, make_context

MAX_CONTEXT = 96  # keeps every generation short: the fake verifier runs to max_tokens
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.RESOURCE_EXHAUSTED}
GENERATE = "/speclane.gateway.v1.Generation/Generate"


class CountingVerifier(FakeVerifier):
    opened = 0

    async def Session(self, request_iterator, context):
        self.opened += 1
        async for response in super().Session(request_iterator, context):
            yield response


@dataclasses.dataclass
class Api:
    channel: grpc.aio.Channel
    stub: gateway_pb2_grpc.GenerationStub
    ctx: object
    verifier: CountingVerifier


@contextlib.asynccontextmanager
async def running_api(tokenizer):
    verifier = CountingVerifier()
    async with gateway([verifier], FakeDrafter()) as gw:
        ctx = dataclasses.replace(make_context(tokenizer, gw.orchestrator, max_context_len=MAX_CONTEXT),
                                  metrics=gw.metrics, drafter_limits=lambda: gw.client.limits)
        async with serve(lambda server: add_generation_servicer(server, ctx)) as address:
            async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
                yield Api(channel, gateway_pb2_grpc.GenerationStub(channel), ctx, verifier)


@pytest.fixture(scope="module")
def api(tiny_tokenizer):
    with serving(lambda: running_api(tiny_tokenizer)) as (portal, api):
        yield portal, api


async def generate(stub, request) -> tuple[grpc.StatusCode, list]:
    replies = []
    try:
        async for reply in stub.Generate(request, timeout=30):
            replies.append(reply)
    except grpc.aio.AioRpcError as error:
        return error.code(), replies
    return grpc.StatusCode.OK, replies


# -- what to send ------------------------------------------------------------------------------------------------

VOCAB = 396  # the tiny tokenizer's (tests/gateway/fakes.py)
floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
int32 = st.integers(-2**31, 2**31 - 1)
uint32 = st.integers(0, 2**32 - 1)
texts = st.text(max_size=30) | st.sampled_from(["", "Hello world!", "<tool_call>", "😀" * 40, "\x00", "x" * 400])
token_ids = st.integers(0, VOCAB - 1) | st.sampled_from([-1, VOCAB, 2**31 - 1, -2**31])
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                           lambda children: st.lists(children, max_size=3)
                           | st.dictionaries(st.text(max_size=6), children, max_size=3), max_leaves=8)


def nested_text(depth: int, opener: str = "[", closer: str = "]") -> str:
    return opener * depth + closer * depth


json_texts = (st.sampled_from(["", "{}", "[]", "null", "{", "1", '"x"', '{"type": "object"}',
                               '{"type": "object", "properties": {"x": {"type": "integer"}}}',
                               '{"x": ' + nested_text(MAX_JSON_DEPTH + 1) + "}",
                               '{"x": ' + nested_text(600) + "}", nested_text(3000), nested_text(100_000),
                               '{"a":' * 2000 + "1" + "}" * 2000])
              | json_values.map(json.dumps))


good_texts = st.sampled_from(["Hello world!", "hi", "def f(x):", "你好"]) | st.text(min_size=1, max_size=20)


@st.composite
def chats(draw, wild: bool) -> gateway_pb2.ChatMessages:
    messages = gateway_pb2.ChatMessages()
    roles = ["user", "system", "developer", "assistant"] + (["tool", "", "bot"] if wild else [])
    for index in range(draw(st.integers(0 if wild else 1, 4))):
        role = "user" if index == 0 and not wild else draw(st.sampled_from(roles))
        message = messages.messages.add(role=role, content=draw(texts if wild else good_texts))
        if wild and draw(st.booleans()):
            message.name = draw(texts)
        if wild and draw(st.booleans()):
            message.tool_call_id = draw(texts)
        for _ in range(draw(st.integers(0, 2))) if wild or role == "assistant" else ():
            message.tool_calls.add(id=draw(texts), name=draw(st.just("f") | texts),
                                   arguments=draw(json_texts if wild else st.just('{"x": 1}')))
    return messages


def either(draw, wild: bool, good, anything):
    """A value within bounds, or (wild) anything at all."""
    return draw(good | anything if wild else good)


def maybe(draw, wild: bool, message, name: str, good, anything) -> None:
    """Sets the field (half the time) to a value within bounds, or (wild) anything at all."""
    if draw(st.booleans()):
        value = either(draw, wild, good, anything)
        if hasattr(getattr(message, name), "extend"):  # a repeated field
            getattr(message, name).extend(value)
        else:
            setattr(message, name, value)


@st.composite
def requests(draw) -> gateway_pb2.GenerateRequest:
    """Requests within the documented bounds two times in three; the others anything at all."""
    wild = draw(st.sampled_from([False, False, True]))
    request = gateway_pb2.GenerateRequest()
    kind = draw(st.sampled_from(["messages", "text", "token_ids"] + ["none"] * wild))
    if kind == "messages":
        request.messages.CopyFrom(draw(chats(wild)))
    elif kind == "text":
        request.text = either(draw, wild, good_texts, texts)
    elif kind == "token_ids":
        request.token_ids.ids.extend(draw(st.lists(st.integers(0, VOCAB - 1) | (token_ids if wild else st.nothing()),
                                                   min_size=1 - wild, max_size=20)))
    maybe(draw, wild, request, "max_tokens", st.sampled_from([8, 1, 30]), st.sampled_from([0, 2**32 - 1]) | uint32)
    maybe(draw, wild, request, "temperature", st.sampled_from([0.0, 0.5, 1.0, 2.0]), floats32)
    maybe(draw, wild, request, "top_p", st.sampled_from([0.1, 0.9, 1.0]), floats32)
    maybe(draw, wild, request, "top_k", st.sampled_from([-1, 0, 5, 1000, 2**31 - 1]), int32)
    maybe(draw, wild, request, "seed", st.integers(0, 2**64 - 1), st.nothing())
    maybe(draw, wild, request, "stop", st.lists(good_texts, max_size=4), st.lists(texts, max_size=5))
    maybe(draw, wild, request, "stop_token_ids", st.lists(st.integers(0, VOCAB - 1), max_size=3),
          st.lists(token_ids, max_size=3))
    maybe(draw, wild, request, "ignore_eos", st.booleans(), st.nothing())
    maybe(draw, wild, request, "model", st.sampled_from([MODEL_NAME, ""]), st.sampled_from(["other"]) | texts)
    for name, low, high in (("presence_penalty", -2, 2), ("frequency_penalty", -2, 2),
                            ("repetition_penalty", 0.5, 2), ("min_p", 0, 1)):
        maybe(draw, wild, request, name, st.floats(low, high, width=32), floats32)
    if draw(st.booleans()):
        request.logit_bias.update(draw(st.dictionaries(
            st.integers(0, VOCAB - 1) | (token_ids if wild else st.nothing()),
            st.floats(-100, 100, width=32) | (floats32 if wild else st.nothing()), max_size=3)))
    maybe(draw, wild, request, "min_tokens", st.sampled_from([0, 1]), st.sampled_from([5]) | uint32)
    maybe(draw, wild, request, "logprobs", st.sampled_from([0, 2, 20]), st.sampled_from([21]) | uint32)
    maybe(draw, wild, request, "prediction", good_texts, texts)
    if (wild or kind == "messages") and draw(st.booleans()):
        for _ in range(draw(st.integers(1, 2))):
            request.tools.add(name=either(draw, wild, st.just("f"), texts), description=draw(texts),
                              parameters=either(draw, wild, st.sampled_from(["", '{"type": "object"}']), json_texts))
    maybe(draw, wild, request, "tool_choice", st.sampled_from(["none", "auto", "required", "f"]), texts)
    maybe(draw, wild, request, "parallel_tool_calls", st.booleans(), st.nothing())
    maybe(draw, wild, request, "json_schema", st.sampled_from(['{"type": "object"}']), json_texts)
    maybe(draw, wild, request, "chat_template_kwargs", st.sampled_from(["{}", '{"enable_thinking": false}']),
          json_texts)
    maybe(draw, wild, request, "add_generation_prompt", st.just(True), st.booleans())
    maybe(draw, wild, request, "continue_final_message", st.just(False), st.booleans())
    if draw(st.booleans()):
        speculation = request.speculation
        maybe(draw, wild, speculation, "method", st.sampled_from(["suffix", "ngram", "none"]), texts)
        maybe(draw, wild, speculation, "num_speculative_tokens", st.integers(1, 64), uint32)
        maybe(draw, wild, speculation, "prompt_lookup_min", st.integers(1, 3), uint32)
        maybe(draw, wild, speculation, "prompt_lookup_max", st.integers(3, 1024), uint32)
        maybe(draw, wild, speculation, "suffix_decoding_max_tree_depth", st.just(24), uint32)
        maybe(draw, wild, speculation, "suffix_decoding_max_cached_requests", st.just(10000), uint32)
        maybe(draw, wild, speculation, "suffix_decoding_max_spec_factor", st.floats(0, 4, width=32), floats32)
        maybe(draw, wild, speculation, "suffix_decoding_min_token_prob", st.floats(0, 1, width=32), floats32)
    return request


def check(code: grpc.StatusCode, replies: list, request) -> None:
    assert code in ALLOWED, f"{code.name} for {request}"
    if code != grpc.StatusCode.OK:
        return
    assert replies, request
    *middle, last = replies
    assert all(reply.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for reply in middle), replies
    assert last.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED, replies
    tokens = [token for reply in replies for token in reply.token_ids]
    assert last.usage.completion_tokens == len(tokens) and all(0 <= token < VOCAB for token in tokens), replies
    for reply in replies:
        assert not reply.logprobs or len(reply.logprobs) == len(reply.token_ids), reply


def assert_still_serving(portal, api: Api, tokenizer) -> None:
    """Nothing left running, and a plain request served as before, with drafts."""
    def idle():
        return api.ctx.limiter.in_flight == 0 and api.verifier.opened == len(api.verifier.outcomes)

    wait_for(idle, what="generations and verifier sessions ended")
    code, replies = portal.call(generate, api.stub, gateway_pb2.GenerateRequest(
        text="Once upon", max_tokens=8, temperature=0, model=MODEL_NAME))
    assert code == grpc.StatusCode.OK, code
    assert [token for reply in replies for token in reply.token_ids] == target_tokens(0, 8)
    assert "".join(reply.text for reply in replies) == tokenizer.decode(target_tokens(0, 8))
    assert replies[-1].usage.speculation.draft_tokens > 0, replies[-1].usage  # the drafter was not rested
    wait_for(idle, what="generations and verifier sessions ended")


def test_generate_requests(api, tiny_tokenizer):
    portal, state = api
    codes = []

    @fuzz_settings(300)
    @given(request=requests())
    def run(request):
        code, replies = portal.call(generate, state.stub, request)
        check(code, replies, request)
        codes.append(code)

    run()
    assert grpc.StatusCode.OK in codes and grpc.StatusCode.INVALID_ARGUMENT in codes, set(codes)
    assert_still_serving(portal, state, tiny_tokenizer)


@pytest.mark.parametrize("field, value", [
    ("chat_template_kwargs", '{"x": ' + nested_text(600) + "}"),  # was UNKNOWN: a RecursionError rendering it
    ("chat_template_kwargs", nested_text(100_000)),  # was UNKNOWN: a RecursionError parsing it
    ("json_schema", '{"x": ' + nested_text(MAX_JSON_DEPTH + 1) + "}"),
])
def test_json_nested_too_deep_is_invalid(api, tiny_tokenizer, field, value):
    portal, state = api
    request = gateway_pb2.GenerateRequest(messages=gateway_pb2.ChatMessages(messages=[
        gateway_pb2.ChatMessage(role="user", content="hi")]), max_tokens=4, **{field: value})
    code, _ = portal.call(generate, state.stub, request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_tool_parameters_nested_too_deep_are_invalid(api):
    portal, state = api
    request = gateway_pb2.GenerateRequest(
        messages=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content="hi")]),
        max_tokens=4, tools=[gateway_pb2.Tool(name="f", parameters='{"x": ' + nested_text(600) + "}")])
    code, _ = portal.call(generate, state.stub, request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT


async def generate_raw(channel, payload: bytes) -> tuple[grpc.StatusCode, str]:
    """Sends bytes as they are, as a client of another language could."""
    call = channel.unary_stream(GENERATE, request_serializer=lambda data: data,
                                response_deserializer=gateway_pb2.GenerateResponse.FromString)
    try:
        async for _ in call(payload, timeout=30):
            pass
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details()
    return grpc.StatusCode.OK, ""


def test_bytes_that_are_no_request(api, tiny_tokenizer):
    portal, state = api
    valid = gateway_pb2.GenerateRequest(text="hi", max_tokens=2).SerializeToString()

    @fuzz_settings(100)
    @given(payload=st.binary(max_size=64) | st.binary(max_size=8).map(lambda junk: valid + junk)
           | st.sampled_from([b"\x0a\x02\xff\xfe", b"\x0a\x03\xed\xa0\x80"]))  # text: invalid UTF-8, a surrogate
    def run(payload):
        code, details = portal.call(generate_raw, state.channel, payload)
        # What does not parse fails in grpc's own deserializer, before our code runs (grpc.aio answers
        # UNKNOWN "Error parsing message"); everything that parses is answered by our code.
        assert code in ALLOWED or (code == grpc.StatusCode.UNKNOWN and "Error parsing message" in details), \
            (code, details)

    run()
    assert_still_serving(portal, state, tiny_tokenizer)

