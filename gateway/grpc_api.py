"""The public gRPC Generate API: a thin adapter from protobuf to the shared
serving layer, for agent frameworks that want token ids in and out."""

import contextlib

import grpc

from gateway.auth import AUTHORIZATION_METADATA_KEY, authorized
from gateway.errors import InvalidRequest, ModelNotFound, Overloaded, Unavailable
from gateway.serving import GenerationParams, ServingContext, TextDelta, build_generation_request, generate_text
from protos.conventions import FINISH_REASONS_BY_NAME, TENANT_METADATA_KEY
from protos.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from speclane.grpc_server import bind_request_id_from
from speclane.log import metadata_value

_OPTIONAL_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed")


def _params(request: gateway_pb2.GenerateRequest, tenant: str) -> GenerationParams:
    optional = {name: getattr(request, name) for name in _OPTIONAL_SAMPLING_FIELDS if request.HasField(name)}
    speculation = {field.name: value for field, value in request.speculation.ListFields()}
    return GenerationParams(
        model=request.model or None, stop=list(request.stop), stop_token_ids=list(request.stop_token_ids),
        ignore_eos=request.ignore_eos, speculation=speculation or None, tenant=tenant, **optional,
    )


def _prompt(request: gateway_pb2.GenerateRequest) -> dict:
    kind = request.WhichOneof("input")
    if kind == "text":
        return {"text": request.text}
    if kind == "token_ids":
        return {"token_ids": list(request.token_ids.ids)}
    if kind == "messages":
        return {"messages": [{"role": m.role, "content": m.content} for m in request.messages.messages]}
    raise InvalidRequest("one of text, token_ids or messages is required", "input")


def _response(delta: TextDelta, prompt_tokens: int, completion_tokens: int) -> gateway_pb2.GenerateResponse:
    response = gateway_pb2.GenerateResponse(token_ids=delta.token_ids, text=delta.text)
    if delta.finish_reason:
        response.finish_reason = FINISH_REASONS_BY_NAME[delta.finish_reason]
        usage = delta.speculation
        response.usage.CopyFrom(gateway_pb2.Usage(
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
            speculation=gateway_pb2.SpeculationUsage(draft_tokens=usage.draft_tokens,
                                                     accepted_tokens=usage.accepted_tokens,
                                                     verify_steps=usage.verify_steps),
        ))
    return response


class GenerationServicer(gateway_pb2_grpc.GenerationServicer):
    def __init__(self, context: ServingContext):
        self._ctx = context

    async def Generate(self, request, context):
        request_id = bind_request_id_from(context)
        metadata = context.invocation_metadata()
        if not authorized(self._ctx.api_keys, metadata_value(metadata, AUTHORIZATION_METADATA_KEY)):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "incorrect or missing API key "
                                "(metadata authorization: Bearer KEY)")
        tenant = metadata_value(metadata, TENANT_METADATA_KEY) or ""
        try:
            params = _params(request, tenant)
            generation = build_generation_request(self._ctx, request_id, params, **_prompt(request))
            with self._ctx.limiter.acquire():
                completion_tokens = 0
                async with contextlib.aclosing(generate_text(self._ctx, generation, params.stop)) as deltas:
                    async for delta in deltas:
                        completion_tokens += len(delta.token_ids)
                        yield _response(delta, len(generation.prompt_token_ids), completion_tokens)
        except ModelNotFound as error:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(error))
        except InvalidRequest as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except Overloaded as error:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        except Unavailable as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))


def add_generation_servicer(server: grpc.aio.Server, context: ServingContext) -> str:
    gateway_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(context), server)
    return gateway_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
