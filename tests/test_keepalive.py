"""A channel of ours left idle past the keepalive time keeps its connection: the
server takes our clients' pings instead of answering them with GOAWAY
(too_many_pings). The real drafter server (speclane.grpc_server.serve, as every
service's) and the gateway's real drafter client, with the keepalive time cut
from 30 s to 1 s (gRPC's floor) so that the idle spell fits a test; beside
them, the control: a server on gRPC's default allowance closes the same idle
channel."""

import asyncio
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from drafter_service import server
from drafter_service.config import DrafterConfig
from gateway import drafter_client
from protos.conventions import channel_options
from speclane import grpc_server

PING_AFTER_MS = 1000
# gRPC's default allowance is one ping in 5 minutes: it closes the connection at the third strike, about
# 3 s into the spell.
IDLE_SECONDS = 5.0
ALLOWANCE = "grpc.http2.min_ping_interval_without_data_ms"


async def _drafter_channel_after_idle() -> tuple[grpc.ChannelConnectivity, bool]:
    """The gateway's channel to the drafter after an idle spell, and whether a call then still answers."""
    port = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(server.run(DrafterConfig(address="127.0.0.1:0"), ready=port.set_result))
    client = drafter_client.DrafterClient(f"127.0.0.1:{await port}", timeout_seconds=5.0)
    try:
        assert await client.refresh_limits() is not None
        assert client._channel.get_state() == grpc.ChannelConnectivity.READY
        await asyncio.sleep(IDLE_SECONDS)
        return client._channel.get_state(), await client.refresh_limits() is not None
    finally:
        await client.close()
        signal.raise_signal(signal.SIGTERM)  # serve() drains and returns
        await task


async def _control_channel_after_idle() -> grpc.ChannelConnectivity:
    options = tuple(option for option in channel_options(PING_AFTER_MS) if option[0] != ALLOWANCE)
    control = grpc.aio.server(options=options)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), control)
    port = control.add_insecure_port("127.0.0.1:0")
    await control.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options(PING_AFTER_MS)) as channel:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            await asyncio.sleep(IDLE_SECONDS)
            return channel.get_state()
    finally:
        await control.stop(None)


def test_an_idle_channel_keeps_its_connection_where_grpcs_default_closes_it(monkeypatch):
    monkeypatch.setattr(grpc_server, "CHANNEL_OPTIONS", channel_options(PING_AFTER_MS))
    monkeypatch.setattr(drafter_client, "CHANNEL_OPTIONS", channel_options(PING_AFTER_MS))

    async def main():
        return await asyncio.gather(_drafter_channel_after_idle(), _control_channel_after_idle())

    (state, answered), control_state = asyncio.run(main())
    assert state == grpc.ChannelConnectivity.READY and answered
    assert control_state != grpc.ChannelConnectivity.READY  # GOAWAY: too_many_pings
