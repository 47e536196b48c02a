"""gRPC adapter of the drafter: `Drafter.Session` streams, converted to and
from SequenceProposer calls at the boundary."""

import asyncio

import grpc
import structlog

from drafter_service.draft import Draft
from drafter_service.proposer import (
    METHOD_NGRAM,
    METHOD_SUFFIX,
    CommittedLengthMismatch,
    ProposerParams,
    SequenceProposer,
)
from drafter_service.engine import DraftEngine
from protos.common.v1 import common_pb2
from protos.drafter.v1 import drafter_pb2, drafter_pb2_grpc
from speclane.grpc_server import bind_request_id_from
from speclane.log import TENANT_METADATA_KEY, metadata_value

SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name
_METHODS = {drafter_pb2.METHOD_SUFFIX: METHOD_SUFFIX, drafter_pb2.METHOD_NGRAM: METHOD_NGRAM}
# vLLM: with neither prompt-lookup bound set both are 5; with one set, the other copies it.
_DEFAULT_LOOKUP = 5
_OPTIONAL_PARAMS = ("prompt_lookup_min", "prompt_lookup_max", "max_spec_factor", "max_spec_offset",
                    "min_token_prob", "max_tree_depth")

log = structlog.get_logger()


def params_from_proto(message: drafter_pb2.ProposerParams, default_tree_depth: int) -> ProposerParams:
    """Absent optional fields take ProposerParams' defaults; raises ValueError on bad input."""
    method = _METHODS.get(message.method)
    if method is None:
        raise ValueError(f"params.method must be METHOD_SUFFIX or METHOD_NGRAM, got {message.method}")
    given = {field.name: value for field, value in message.ListFields()
             if field.name in _OPTIONAL_PARAMS}
    # vLLM: when only one lookup bound is given, the other takes its value.
    given.setdefault("prompt_lookup_min", given.get("prompt_lookup_max", _DEFAULT_LOOKUP))
    given.setdefault("prompt_lookup_max", given["prompt_lookup_min"])
    given.setdefault("max_tree_depth", default_tree_depth)
    return ProposerParams(method=method, num_speculative_tokens=message.num_speculative_tokens,
                          use_tree_spec=message.use_tree_spec, **given)


def draft_to_proto(draft: Draft, committed_len: int) -> common_pb2.Draft:
    return common_pb2.Draft(
        token_ids=draft.token_ids,
        parents=() if draft.is_chain else draft.parents,  # empty means a chain
        confidences=draft.probs,
        score=draft.score,
        committed_len=committed_len,
        source=draft.source,
    )


def _has_negative(token_ids) -> bool:
    return any(token < 0 for token in token_ids)


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, engine: DraftEngine, default_tree_depth: int):
        # The engine keys sessions by its own numbers, not the client's sequence
        # ids, so a retried or reused sequence id never collides with a session still winding down.
        self._engine = engine
        self._default_tree_depth = default_tree_depth

    async def Session(self, request_iterator, context: grpc.aio.ServicerContext):
        bind_request_id_from(context)
        requests = aiter(request_iterator)
        first = await anext(requests, None)
        if first is None or first.WhichOneof("kind") != "start":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message of a session must be start")
        start = first.start
        try:
            params = params_from_proto(start.params, self._default_tree_depth)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if _has_negative(start.prompt_token_ids):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "start.prompt_token_ids must not be negative")
        tenant = start.tenant or metadata_value(context.invocation_metadata(), TENANT_METADATA_KEY) or ""
        proposer = SequenceProposer(self._engine, params, tenant)
        proposer.start(start.prompt_token_ids)
        log.info("session_start", sequence_id=start.sequence_id, tenant=tenant, method=params.method,
                 prompt_tokens=len(start.prompt_token_ids), num_speculative_tokens=params.num_speculative_tokens)
        steps = drafted = 0
        ended_by = "error"
        try:
            async for request in requests:
                kind = request.WhichOneof("kind")
                if kind != "step":
                    detail = "start may only be sent once" if kind == "start" else "empty message"
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, detail)
                step = request.step
                if _has_negative(step.committed_token_ids):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "step.committed_token_ids must not be negative")
                try:
                    proposer.commit(step.committed_token_ids, step.committed_len)
                except CommittedLengthMismatch as exc:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
                draft = await proposer.propose()
                steps += 1
                drafted += len(draft)
                yield drafter_pb2.SessionResponse(draft=draft_to_proto(draft, proposer.committed_len))
            ended_by = "stream_closed"  # half-closed, or cancelled with the stream ending first
        except asyncio.CancelledError:
            ended_by = "cancelled"
            raise
        finally:
            proposer.end()
            log.info("session_end", sequence_id=start.sequence_id, tenant=tenant, ended_by=ended_by, steps=steps,
                     output_tokens=proposer.committed_len - len(start.prompt_token_ids), drafted_tokens=drafted)
