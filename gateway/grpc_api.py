"""The public gRPC Generate API: a thin adapter from protobuf to the shared
serving layer, for agent frameworks that want token ids in and out."""

import contextlib

import grpc

from gateway import grpc_messages
from gateway.assistant_stream import AssistantMessage, AssistantStream
from gateway.auth import AUTHORIZATION_METADATA_KEY, ApiKey, tenant_for
from gateway.errors import InvalidRequest, ModelNotFound, Overloaded, Unavailable
from gateway.model_info import Backends, model_info
from gateway.serving import ServingContext, build_generation_request, generate_text, prompt_tail
from protos.conventions import TENANT_METADATA_KEY
from protos.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from speclane.grpc_server import bind_request_id_from
from speclane.log import metadata_value


class GenerationServicer(gateway_pb2_grpc.GenerationServicer):
    def __init__(self, context: ServingContext, backends: Backends | None = None):
        self._ctx = context
        self._backends = backends

    async def _require_key(self, context) -> ApiKey | None:
        """The caller's key; None when no keys are configured (aborts without a good one)."""
        if not self._ctx.keyring:
            return None
        caller = self._ctx.keyring.authenticate(metadata_value(context.invocation_metadata(),
                                                               AUTHORIZATION_METADATA_KEY))
        if caller is None:
            self._ctx.metrics.record_error("unauthenticated")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "incorrect or missing API key "
                                "(metadata authorization: Bearer KEY)")
        return caller

    async def GetModelInfo(self, request, context):
        bind_request_id_from(context)
        await self._require_key(context)
        return await model_info(self._ctx, self._backends)

    async def Generate(self, request, context):
        request_id = bind_request_id_from(context)
        metadata = context.invocation_metadata()
        caller = await self._require_key(context)
        try:
            tenant = tenant_for(caller, metadata_value(metadata, TENANT_METADATA_KEY))
            tool_grammar, tool_parser = grpc_messages.tool_plan(self._ctx, request)
            params = grpc_messages.params(request, tenant, tool_grammar)
            generation = build_generation_request(self._ctx, request_id, params, **grpc_messages.prompt(request))
            output = AssistantStream(tool_parser, self._ctx.reasoning_parser, prompt_tail(self._ctx, generation))
            with self._ctx.limiter.acquire(1, caller):
                completion_tokens = 0
                async with contextlib.aclosing(generate_text(self._ctx, generation, params.stop)) as deltas:
                    async for delta in deltas:
                        completion_tokens += len(delta.token_ids)
                        events, finish_reason = output.read(delta.text, delta.finish_reason)
                        message = AssistantMessage()
                        message.add(events)
                        yield grpc_messages.response(delta, message, finish_reason,
                                                     len(generation.prompt_token_ids), completion_tokens)
        except ModelNotFound as error:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(error))
        except InvalidRequest as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except Overloaded as error:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        except Unavailable as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))


def add_generation_servicer(server: grpc.aio.Server, context: ServingContext, backends: Backends | None = None) -> str:
    gateway_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(context, backends), server)
    return gateway_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
