"""A small Python client for the gateway's gRPC Generate API, for agent frameworks.

    client = GenerationClient("127.0.0.1:50060")
    for delta in client.stream(messages=[{"role": "user", "content": "hi"}], max_tokens=32):
        print(delta.text, end="")
    result = client.generate(prompt_token_ids=[1, 2, 3], max_tokens=16)
"""

import dataclasses
from collections.abc import Iterator

import grpc

from protos.conventions import FINISH_REASON_NAMES
from protos.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from speclane.grpc_server import CHANNEL_OPTIONS, request_metadata


@dataclasses.dataclass
class Generation:
    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    draft_tokens: int
    accepted_tokens: int
    verify_steps: int


class GenerationClient:
    def __init__(self, address: str):
        self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = gateway_pb2_grpc.GenerationStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.close()

    def stream(self, *, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
               messages: list[dict] | None = None, request_id: str | None = None,
               timeout: float | None = None, **params) -> Iterator[gateway_pb2.GenerateResponse]:
        """Streams the deltas. Exactly one of prompt, prompt_token_ids, messages.
        `params` are GenerateRequest fields: max_tokens, temperature, top_p, top_k, seed,
        stop, stop_token_ids, ignore_eos, speculation (a dict of vLLM speculative-config keys)."""
        request = _build_request(prompt, prompt_token_ids, messages, params)
        metadata = request_metadata(request_id) if request_id else None
        yield from self._stub.Generate(request, timeout=timeout, metadata=metadata)

    def generate(self, **kwargs) -> Generation:
        """Runs a generation to the end and returns it whole."""
        token_ids, pieces, last = [], [], None
        for last in self.stream(**kwargs):
            token_ids += last.token_ids
            pieces.append(last.text)
        usage = last.usage
        return Generation(
            token_ids=token_ids, text="".join(pieces), finish_reason=FINISH_REASON_NAMES.get(last.finish_reason, ""),
            prompt_tokens=usage.prompt_tokens, draft_tokens=usage.speculation.draft_tokens,
            accepted_tokens=usage.speculation.accepted_tokens, verify_steps=usage.speculation.verify_steps,
        )


def _build_request(prompt, prompt_token_ids, messages, params) -> gateway_pb2.GenerateRequest:
    inputs = [x is not None for x in (prompt, prompt_token_ids, messages)]
    if sum(inputs) != 1:
        raise ValueError("give exactly one of prompt, prompt_token_ids, messages")
    speculation = params.pop("speculation", None) or {}
    request = gateway_pb2.GenerateRequest(speculation=gateway_pb2.SpeculationConfig(**speculation), **params)
    if prompt is not None:
        request.text = prompt
    elif prompt_token_ids is not None:
        request.token_ids.ids.extend(prompt_token_ids)
    else:
        request.messages.messages.extend(gateway_pb2.ChatMessage(**m) for m in messages)
    return request
