"""GetModelInfo on the public gRPC API: the real Generate API servicer over a
real VerifierPool and DrafterClient, talking to fake verifiers (with a health
service) and a fake drafter on real gRPC servers, through both clients."""

import asyncio
import contextlib
import dataclasses

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.auth import Keyring
from gateway.client import AsyncGenerationClient, GenerationClient
from gateway.drafter_client import DrafterClient
from gateway.grpc_api import add_generation_servicer
from gateway.model_info import Backends
from gateway.verifier_pool import VerifierPool
from speclane.speculation import SpeculationSettings
from tests.gateway.fake_services import FakeDrafter, FakeVerifier, serve
from tests.gateway.fakes import MODEL_NAME

pytestmark = pytest.mark.anyio
SETTINGS = SpeculationSettings(method="ngram", num_speculative_tokens=5, prompt_lookup_min=3, prompt_lookup_max=4)


class HealthyVerifier(FakeVerifier):
    """A fake verifier with the health service real ones have; `status` is what it reports."""

    def add_to(self, server: grpc.aio.Server) -> None:
        super().add_to(server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)

    async def report(self, status) -> None:
        await self.health.set("", status)


@contextlib.asynccontextmanager
async def gateway_api(ctx, verifiers: list[HealthyVerifier], drafter: FakeDrafter | None,
                      settings: SpeculationSettings = SETTINGS):
    """The servicer as gateway/server.py wires it; yields (address, drafter's server stack)."""
    async with contextlib.AsyncExitStack() as stack:
        addresses = [await stack.enter_async_context(serve(v.add_to)) for v in verifiers]
        for verifier in verifiers:
            await verifier.report(health_pb2.HealthCheckResponse.SERVING)
        pool = VerifierPool(tuple(addresses))
        stack.push_async_callback(pool.close)
        client = None
        drafter_server = contextlib.AsyncExitStack()
        if drafter is not None:
            client = DrafterClient(await drafter_server.enter_async_context(serve(drafter.add_to)), 1.0)
            stack.push_async_callback(client.close)
        stack.push_async_callback(drafter_server.aclose)
        ctx = dataclasses.replace(ctx, default_speculation=settings, keyring=Keyring.load(("sk-1",)))
        yield await stack.enter_async_context(
            serve(lambda server: add_generation_servicer(server, ctx, Backends(pool, client)))), drafter_server


async def test_model_info_reports_the_model_the_defaults_and_the_backends(ctx, tiny_tokenizer):
    verifiers = [HealthyVerifier(), HealthyVerifier()]
    drafter = FakeDrafter(max_tree_depth=32)
    async with gateway_api(ctx, verifiers, drafter) as (address, drafter_server), \
            AsyncGenerationClient(address, api_key="sk-1") as client:
        info = await client.model_info()
        assert (info.model_name, info.max_context_len, info.vocab_size) == (MODEL_NAME, 256, len(tiny_tokenizer))
        assert info.default_speculation["method"] == "ngram"
        assert info.default_speculation["num_speculative_tokens"] == 5
        assert info.default_speculation["prompt_lookup_min"] == 3
        assert info.default_speculation["suffix_decoding_max_tree_depth"] == 32  # the drafter's own
        assert (info.num_verifiers, info.num_verifiers_serving) == (2, 2)
        assert info.drafter_configured and info.drafter_reachable

        await verifiers[1].report(health_pb2.HealthCheckResponse.NOT_SERVING)
        await drafter_server.aclose()  # the drafter goes away
        info = await client.model_info()
        assert (info.num_verifiers, info.num_verifiers_serving) == (2, 1)
        assert info.drafter_configured and not info.drafter_reachable
        assert "suffix_decoding_max_tree_depth" not in info.default_speculation


async def test_a_suffix_default_without_k_reports_the_drafters_tree_depth(ctx):
    async with gateway_api(ctx, [HealthyVerifier()], FakeDrafter(max_tree_depth=32), SpeculationSettings()) as (
            address, drafter_server), AsyncGenerationClient(address, api_key="sk-1") as client:
        assert (await client.model_info()).default_speculation["num_speculative_tokens"] == 32
        await drafter_server.aclose()
        assert (await client.model_info()).default_speculation["num_speculative_tokens"] == 24  # its default depth


async def test_without_a_drafter_and_with_the_blocking_client(ctx):
    async with gateway_api(ctx, [HealthyVerifier()], None) as (address, _):
        def call():
            with GenerationClient(address, api_key="sk-1") as client:
                return client.model_info(request_id="info-1")

        info = await asyncio.to_thread(call)
    assert (info.num_verifiers, info.num_verifiers_serving) == (1, 1)
    assert not info.drafter_configured and not info.drafter_reachable


async def test_model_info_needs_the_api_key(ctx):
    async with gateway_api(ctx, [HealthyVerifier()], None) as (address, _), \
            AsyncGenerationClient(address, api_key="wrong") as client:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.model_info()
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
