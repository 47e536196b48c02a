"""Verifiers found by name (dns:///name:port, a headless Kubernetes Service): the
pool dials every address the name resolves to, and follows the name as verifiers
are scaled up and down."""

import pytest

from gateway.config import GatewayConfig
from gateway.verifier_pool import VerifierPool, resolve
from speclane.net import free_port
from tests.gateway.fake_services import FakeVerifier, serve

pytestmark = pytest.mark.anyio
TARGET = "dns:///speclane-verifier:50062"
PROMPT, OTHER = list(range(200)), list(range(300, 500))


async def test_localhost_resolves_to_its_loopback_address():
    port = free_port()
    assert f"127.0.0.1:{port}" in await resolve(f"dns:///localhost:{port}")


async def test_verifiers_join_as_the_name_lists_them_and_leave_once_their_sequences_end():
    async with serve(FakeVerifier().add_to) as first, serve(FakeVerifier().add_to) as second:
        listed = {first}

        async def resolver(target):
            assert target == TARGET
            return set(listed)

        pool = VerifierPool((TARGET,), resolver=resolver)
        try:
            assert pool.addresses == ()  # nothing dialled before the name is resolved
            await pool.discover()
            assert pool.addresses == (first,)
            on_first, _ = pool.open("a", PROMPT)

            listed.add(second)  # scaled up
            await pool.discover()
            assert sorted(pool.addresses) == sorted([first, second])
            on_second, _ = pool.open("b", OTHER)  # the least busy: the new one
            assert pool._verifiers[on_second].address == second

            listed.discard(first)  # scaled down, with a sequence still running there
            await pool.discover()
            assert pool.addresses == (second,)
            # PROMPT's prefix went to the first, which takes no new sequences now.
            assert pool.open("c", PROMPT)[0] == on_second
            assert pool._verifiers[on_first].in_flight == 1
            pool.release(on_first)  # its last sequence ends: dropped
            assert on_first not in pool._verifiers

            listed.clear()  # the name resolves to nothing for a moment: keep what is known
            await pool.discover()
            assert pool.addresses == (second,)

            listed.update((first, second))  # the first back under its address: a new verifier, its cache empty
            await pool.discover()
            assert sorted(pool.addresses) == sorted([first, second])
            rejoined, _ = pool.open("d", list(range(600, 800)))  # the least busy
            assert rejoined not in (on_first, on_second) and pool._verifiers[rejoined].address == first
        finally:
            await pool.close()


async def test_fixed_addresses_are_dialled_as_given_and_never_resolved():
    async def resolver(target):
        raise AssertionError("resolved a fixed address")

    pool = VerifierPool(("127.0.0.1:1", "127.0.0.1:2"), resolver=resolver)
    try:
        await pool.discover()
        assert pool.addresses == ("127.0.0.1:1", "127.0.0.1:2")
    finally:
        await pool.close()


@pytest.mark.parametrize("target", ["verifier:50062", "10.0.0.7:50062", "[::1]:50062", TARGET])
def test_a_verifier_address_is_host_and_port_or_a_name_to_resolve(target):
    assert GatewayConfig(verifier_addresses=(target,)).verifier_addresses == (target,)


@pytest.mark.parametrize("target", ["verifier", "verifier:", "dns:///verifier", ":50062", "verifier:99999"])
def test_a_verifier_address_without_a_port_is_refused_at_start(target):
    with pytest.raises(ValueError, match="must be host:port or dns:///name:port"):
        GatewayConfig(verifier_addresses=(target,))
