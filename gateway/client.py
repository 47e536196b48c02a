"""Python clients of the gateway's gRPC Generate API, for agent frameworks:
`GenerationClient` (blocking) and `AsyncGenerationClient` (asyncio). They need
only grpcio and protobuf: no torch, no transformers, no server code.

    async with AsyncGenerationClient("127.0.0.1:50060", tenant="team-a") as client:
        async for chunk in client.stream(messages=[{"role": "user", "content": "hi"}], max_tokens=32):
            print(chunk.text, end="")
        result = await client.generate(prompt_token_ids=[1, 2, 3], max_tokens=16, timeout=30)
        info = await client.model_info()  # served model, limits, default speculation, backends' state

A call that the gateway answers UNAVAILABLE (no verifier serving, a gateway
restarting) before any token arrived is retried with back-off; once tokens
have arrived an error is raised, never a silent restart. `timeout` is the
deadline of the whole call, retries included. Leaving a stream early (break,
or cancelling the task) cancels the generation on the server.

A gateway serving TLS (`--tls-cert`) is reached with `root_certificates`, the PEM
of the CA that signed its certificate (`speclane certs` writes it as ca.pem), or
with `tls=True` when a CA the system trusts signed it:

    GenerationClient("gateway.example:50060", root_certificates=pathlib.Path("ca.pem").read_bytes())
"""

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Iterator

import grpc

from protos.conventions import (
    CHANNEL_OPTIONS,
    FINISH_REASON_NAMES,
    REQUEST_ID_METADATA_KEY,
    TENANT_METADATA_KEY,
)
from protos.gateway.v1 import gateway_pb2, gateway_pb2_grpc

RETRY_BACKOFF_SECONDS = 0.5


@dataclasses.dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    draft_tokens: int
    accepted_tokens: int
    verify_steps: int
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    drafter_steps: int = 0  # steps verifying the drafter service's draft
    head_steps: int = 0  # steps verifying the verifier head's draft
    next_round_steps: int = 0  # steps the verifier started on its own, with a next-round draft
    cached_prompt_tokens: int = 0  # prompt tokens the verifier's prefix cache held


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclasses.dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One streamed step: the tokens it committed and their text; the last has finish_reason and usage."""

    token_ids: list[int]
    text: str  # without the tool calls' text
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)  # one per token id, if asked for
    tool_calls: list[ToolCall] = dataclasses.field(default_factory=list)  # each complete call, once
    reasoning: str = ""  # the <think> part, split off by the server's --reasoning-parser


@dataclasses.dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    text: str
    finish_reason: str
    usage: Usage
    logprobs: list[TokenLogprob]
    tool_calls: list[ToolCall]
    reasoning: str = ""


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    model_name: str
    max_context_len: int
    vocab_size: int  # prompt token ids must be below it
    default_speculation: dict  # vLLM --speculative-config keys
    num_verifiers: int
    num_verifiers_serving: int
    drafter_configured: bool
    drafter_reachable: bool


def model_info_from(reply: gateway_pb2.ModelInfo) -> ModelInfo:
    return ModelInfo(reply.model_name, reply.max_context_len, reply.vocab_size,
                     {field.name: value for field, value in reply.default_speculation.ListFields()},
                     reply.num_verifiers, reply.num_verifiers_serving, reply.drafter_configured,
                     reply.drafter_reachable)


def _message(message: dict) -> gateway_pb2.ChatMessage:
    """An OpenAI-shaped chat message (tool_calls as OpenAI writes them) as the API's message."""
    calls = [gateway_pb2.ToolCall(id=call.get("id", ""), name=call["function"]["name"],
                                  arguments=call["function"].get("arguments", "{}"))
             for call in message.get("tool_calls") or ()]
    return gateway_pb2.ChatMessage(role=message["role"], content=message.get("content") or "",
                                   name=message.get("name", ""), tool_call_id=message.get("tool_call_id", ""),
                                   tool_calls=calls)


def _tool(tool: dict) -> gateway_pb2.Tool:
    """An OpenAI tool ({"type": "function", "function": {...}}) as the API's Tool."""
    function = tool["function"]
    return gateway_pb2.Tool(name=function["name"], description=function.get("description", ""),
                            parameters=json.dumps(function.get("parameters") or {}))


def build_request(*, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
                  messages: list[dict] | None = None, speculation: dict | None = None,
                  tools: list[dict] | None = None, tool_choice: str | dict | None = None,
                  json_schema: dict | None = None, chat_template_kwargs: dict | None = None,
                  **params) -> gateway_pb2.GenerateRequest:
    """Exactly one of prompt, prompt_token_ids, messages (OpenAI's message dicts). `params`
    are GenerateRequest fields: max_tokens, temperature, top_p, top_k, seed, stop,
    stop_token_ids, ignore_eos, presence_penalty, frequency_penalty, repetition_penalty,
    min_p, logit_bias, min_tokens, logprobs, prediction, parallel_tool_calls,
    add_generation_prompt, continue_final_message. `speculation` holds vLLM
    speculative-config keys; `tools` and `tool_choice` are OpenAI's."""
    if sum(x is not None for x in (prompt, prompt_token_ids, messages)) != 1:
        raise ValueError("give exactly one of prompt, prompt_token_ids, messages")
    if isinstance(tool_choice, dict):
        tool_choice = tool_choice["function"]["name"]
    request = gateway_pb2.GenerateRequest(
        speculation=gateway_pb2.SpeculationConfig(**(speculation or {})),
        tools=[_tool(tool) for tool in tools or ()], tool_choice=tool_choice or "",
        json_schema=json.dumps(json_schema) if json_schema is not None else "",
        chat_template_kwargs=json.dumps(chat_template_kwargs) if chat_template_kwargs else "", **params)
    if prompt is not None:
        request.text = prompt
    elif prompt_token_ids is not None:
        request.token_ids.ids.extend(prompt_token_ids)
    else:
        request.messages.messages.extend(_message(message) for message in messages)
    return request


def chunk_from(response: gateway_pb2.GenerateResponse) -> Chunk:
    logprobs = [TokenLogprob(entry.logprob, list(zip(entry.top_token_ids, entry.top_logprobs)))
                for entry in response.logprobs]
    calls = [ToolCall(call.id, call.name, call.arguments) for call in response.tool_calls]
    if not response.finish_reason:
        return Chunk(list(response.token_ids), response.text, logprobs=logprobs, tool_calls=calls,
                     reasoning=response.reasoning)
    usage = response.usage
    return Chunk(list(response.token_ids), response.text, FINISH_REASON_NAMES.get(response.finish_reason, ""),
                 Usage(usage.prompt_tokens, usage.completion_tokens, usage.speculation.draft_tokens,
                       usage.speculation.accepted_tokens, usage.speculation.verify_steps,
                       usage.accepted_prediction_tokens, usage.rejected_prediction_tokens,
                       usage.speculation.drafter_steps, usage.speculation.head_steps,
                       usage.speculation.next_round_steps, usage.cached_prompt_tokens),
                 logprobs, calls, response.reasoning)


def generation_from(chunks: list[Chunk]) -> Generation:
    last = chunks[-1]
    return Generation([token for chunk in chunks for token in chunk.token_ids], "".join(c.text for c in chunks),
                      last.finish_reason, last.usage, [entry for chunk in chunks for entry in chunk.logprobs],
                      [call for chunk in chunks for call in chunk.tool_calls], "".join(c.reasoning for c in chunks))


class _Settings:
    """What both clients share: metadata, the retry rule, deadlines."""

    def __init__(self, *, api_key: str | None, tenant: str | None, retries: int):
        self._metadata = ((("authorization", f"Bearer {api_key}"),) if api_key else ()) + \
                         (((TENANT_METADATA_KEY, tenant),) if tenant else ())
        self.retries = retries

    def metadata(self, request_id: str | None) -> tuple[tuple[str, str], ...]:
        return self._metadata + (((REQUEST_ID_METADATA_KEY, request_id),) if request_id else ())

    def retry_delay(self, error: grpc.RpcError, attempt: int, received: bool, deadline: float | None) -> float | None:
        """Seconds to wait before the next attempt, or None to raise `error`."""
        delay = RETRY_BACKOFF_SECONDS * 2 ** attempt
        if received or error.code() != grpc.StatusCode.UNAVAILABLE or attempt >= self.retries:
            return None
        if deadline is not None and time.monotonic() + delay >= deadline:
            return None
        return delay


def _credentials(tls: bool, root_certificates: bytes | None) -> grpc.ChannelCredentials | None:
    """TLS when asked for or given a CA (else None: plaintext); without a CA, gRPC's default roots."""
    if not tls and root_certificates is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=root_certificates)


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


class GenerationClient:
    def __init__(self, address: str, *, api_key: str | None = None, tenant: str | None = None, retries: int = 3,
                 tls: bool = False, root_certificates: bytes | None = None):
        credentials = _credentials(tls, root_certificates)
        self._channel = (grpc.insecure_channel(address, options=CHANNEL_OPTIONS) if credentials is None
                         else grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS))
        self._stub = gateway_pb2_grpc.GenerationStub(self._channel)
        self._settings = _Settings(api_key=api_key, tenant=tenant, retries=retries)

    def stream(self, *, timeout: float | None = None, request_id: str | None = None, **inputs) -> Iterator[Chunk]:
        request = build_request(**inputs)
        deadline = None if timeout is None else time.monotonic() + timeout
        for attempt in range(self._settings.retries + 1):
            call = self._stub.Generate(request, timeout=_remaining(deadline),
                                       metadata=self._settings.metadata(request_id))
            received = False
            try:
                for response in call:
                    received = True
                    yield chunk_from(response)
                return
            except grpc.RpcError as error:
                delay = self._settings.retry_delay(error, attempt, received, deadline)
                if delay is None:
                    raise
                time.sleep(delay)
            finally:
                call.cancel()  # a no-op once finished; otherwise the caller left early

    def generate(self, **kwargs) -> Generation:
        """Runs a generation to the end and returns it whole."""
        return generation_from(list(self.stream(**kwargs)))

    def model_info(self, *, timeout: float | None = 10.0, request_id: str | None = None) -> ModelInfo:
        reply = self._stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=timeout,
                                        metadata=self._settings.metadata(request_id))
        return model_info_from(reply)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.close()


class AsyncGenerationClient:
    def __init__(self, address: str, *, api_key: str | None = None, tenant: str | None = None, retries: int = 3,
                 tls: bool = False, root_certificates: bytes | None = None):
        credentials = _credentials(tls, root_certificates)
        self._channel = (grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) if credentials is None
                         else grpc.aio.secure_channel(address, credentials, options=CHANNEL_OPTIONS))
        self._stub = gateway_pb2_grpc.GenerationStub(self._channel)
        self._settings = _Settings(api_key=api_key, tenant=tenant, retries=retries)

    async def stream(self, *, timeout: float | None = None, request_id: str | None = None,
                     **inputs) -> AsyncIterator[Chunk]:
        request = build_request(**inputs)
        deadline = None if timeout is None else time.monotonic() + timeout
        for attempt in range(self._settings.retries + 1):
            call = self._stub.Generate(request, timeout=_remaining(deadline),
                                       metadata=self._settings.metadata(request_id))
            received = False
            try:
                async for response in call:
                    received = True
                    yield chunk_from(response)
                return
            except grpc.aio.AioRpcError as error:
                delay = self._settings.retry_delay(error, attempt, received, deadline)
                if delay is None:
                    raise
                await asyncio.sleep(delay)
            finally:
                call.cancel()  # a no-op once finished; otherwise the caller left early

    async def generate(self, **kwargs) -> Generation:
        return generation_from([chunk async for chunk in self.stream(**kwargs)])

    async def model_info(self, *, timeout: float | None = 10.0, request_id: str | None = None) -> ModelInfo:
        reply = await self._stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=timeout,
                                              metadata=self._settings.metadata(request_id))
        return model_info_from(reply)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *_):
        await self.close()
