"""The three services as real processes with the files of `speclane certs`: drafter
and verifier serve mTLS, the gateway dials both with its own certificate and serves
HTTPS and TLS on its gRPC Generate API. Plaintext clients, clients without a
certificate and clients with another CA's certificate are refused."""

import asyncio

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2

from gateway.client import AsyncGenerationClient, GenerationClient
from speclane.net import http_ok
from speclane.tls import TlsFiles, issued
from speclane_cli.main import main as speclane
from tests.e2e.stack import grpc_health, start_stack

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m-instruct"
MESSAGES = [{"role": "user", "content": "Repeat this code, renaming f to g: def f(x): return x + 1"}]
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    out = tmp_path_factory.mktemp("certs")
    assert speclane(["certs", "--out", str(out), "--force"]) == 0
    return out


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory):
    out = tmp_path_factory.mktemp("other-certs")
    assert speclane(["certs", "--out", str(out), "--force"]) == 0
    return out


@pytest.fixture(scope="module")
def tls_stack(model_dir, certs, tmp_path_factory):
    running = start_stack(model_dir, tmp_path_factory.mktemp("tls-stack-logs"), tls_dir=certs)
    yield running
    running.stop()


def test_a_chat_completion_over_https_through_mtls_links(tls_stack):
    client = openai.OpenAI(base_url=tls_stack.base_url, api_key="unused", max_retries=0, timeout=120,
                           http_client=httpx.Client(verify=tls_stack.http_context))
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0)
    assert tls_stack.base_url.startswith("https://")
    assert reply.choices[0].message.content
    assert reply.usage.model_extra["speculation"]["verify_steps"] >= 1
    # Plain HTTP to the HTTPS port gets no answer.
    assert not http_ok(tls_stack.base_url.replace("https://", "http://").removesuffix("/v1") + "/health")


def test_the_grpc_api_serves_tls_with_the_ca(tls_stack, certs):
    ca = (certs / "ca.pem").read_bytes()
    with GenerationClient(tls_stack.gateway.grpc_address, root_certificates=ca) as client:
        info = client.model_info()
        result = client.generate(messages=MESSAGES, max_tokens=16, temperature=0)
    # The gateway reached the drafter and the verifier over mTLS.
    assert (info.num_verifiers_serving, info.drafter_reachable) == (1, True)
    assert result.token_ids

    async def stream():
        async with AsyncGenerationClient(tls_stack.gateway.grpc_address, root_certificates=ca) as client:
            return [chunk async for chunk in client.stream(messages=MESSAGES, max_tokens=16, temperature=0)]

    assert [token for chunk in asyncio.run(stream()) for token in chunk.token_ids] == result.token_ids


def test_the_grpc_api_refuses_plaintext(tls_stack):
    with GenerationClient(tls_stack.gateway.grpc_address, retries=0) as client:
        with pytest.raises(grpc.RpcError) as refused:
            client.model_info(timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def refused(address: str, tls: TlsFiles) -> bool:
    try:
        grpc_health(address, tls)
    except grpc.RpcError as error:
        return error.code() == grpc.StatusCode.UNAVAILABLE
    return False


@pytest.mark.parametrize("service", ["drafter", "verifier"])
def test_backends_serve_only_clients_with_a_certificate_of_their_ca(tls_stack, certs, other_ca, service):
    address = getattr(tls_stack, service).address
    assert grpc_health(address, issued(str(certs), "gateway")) == SERVING
    foreign = issued(str(other_ca), "gateway")
    assert refused(address, TlsFiles())  # plaintext
    assert refused(address, TlsFiles(ca=str(certs / "ca.pem")))  # TLS without a client certificate
    assert refused(address, TlsFiles(cert=foreign.cert, key=foreign.key, ca=str(certs / "ca.pem")))
