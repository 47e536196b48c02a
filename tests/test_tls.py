"""TLS without a model: what `speclane certs` writes, the services' TLS flags and
their checks, `speclane serve`'s TLS wiring, and a real drafter process serving
mTLS that refuses plaintext clients, clients without a certificate and clients
whose certificate another CA signed; the health probe speaks TLS to it."""

import argparse
import asyncio
import http.server
import ipaddress
import pathlib
import ssl
import stat
import subprocess
import sys
import threading
import time

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from cryptography.x509.oid import ExtendedKeyUsageOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from drafter_service.config import DrafterConfig
from gateway.config import GatewayConfig
from gateway.drafter_client import DrafterClient
from speclane.net import free_port
from speclane.tls import TlsFiles, channel, issued
from speclane_cli import serve
from speclane_cli.main import main as speclane
from verifier_service.config import VerifierConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
SERVICES = ("drafter", "verifier", "gateway")
HOSTS = "node-a.example,10.0.0.5,fd00::5"


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("certs")
    assert speclane(["certs", "--out", str(out), "--hosts", HOSTS, "--force"]) == 0
    return out


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory) -> pathlib.Path:
    """A second `speclane certs` directory: a CA the services do not trust."""
    out = tmp_path_factory.mktemp("other-certs")
    assert speclane(["certs", "--out", str(out), "--force"]) == 0
    return out


def load(directory: pathlib.Path, name: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate((directory / name).read_bytes())


# --- speclane certs --------------------------------------------------------------------------

def test_the_ca_signs_every_service_certificate(certs, other_ca):
    ca = load(certs, "ca.pem")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for service in SERVICES:
        cert = load(certs, f"{service}.pem")
        cert.verify_directly_issued_by(ca)
        assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        with pytest.raises(Exception):  # noqa: B017 - whatever cryptography raises for a wrong issuer
            cert.verify_directly_issued_by(load(other_ca, "ca.pem"))
        key = load_pem_private_key((certs / f"{service}-key.pem").read_bytes(), None)
        assert key.public_key() == cert.public_key()


def test_service_certificates_name_localhost_the_service_and_the_given_hosts(certs):
    for service in SERVICES:
        names = load(certs, f"{service}.pem").extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert set(names.get_values_for_type(x509.DNSName)) == {"localhost", service, "node-a.example"}
        assert set(names.get_values_for_type(x509.IPAddress)) == {
            ipaddress.ip_address(a) for a in ("127.0.0.1", "10.0.0.5", "fd00::5")}


def test_service_certificates_are_server_and_client_certificates(certs):
    for service in SERVICES:
        usages = load(certs, f"{service}.pem").extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}


def test_keys_are_readable_by_their_owner_only(certs):
    for name in ("ca", *SERVICES):
        assert stat.S_IMODE((certs / f"{name}-key.pem").stat().st_mode) == 0o600, name
        assert stat.S_IMODE((certs / f"{name}.pem").stat().st_mode) == 0o644, name


def test_existing_files_are_kept_unless_forced(tmp_path, capsys):
    assert speclane(["certs", "--out", str(tmp_path)]) == 0
    before = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    (tmp_path / "ca.pem").unlink()  # one file missing is no licence to replace the others
    assert speclane(["certs", "--out", str(tmp_path)]) == 1
    assert "--force" in capsys.readouterr().err
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == {
        name: content for name, content in before.items() if name != "ca.pem"}
    assert speclane(["certs", "--out", str(tmp_path), "--force"]) == 0
    assert (tmp_path / "ca-key.pem").read_bytes() != before["ca-key.pem"]
    assert stat.S_IMODE((tmp_path / "ca-key.pem").stat().st_mode) == 0o600


def test_a_malformed_host_is_refused(tmp_path):
    assert speclane(["certs", "--out", str(tmp_path / "certs"), "--hosts", "ok.example,not a host"]) == 2
    assert not (tmp_path / "certs").exists()


# --- the services' flags ---------------------------------------------------------------------

def drafter(**tls) -> DrafterConfig:
    return DrafterConfig(**tls)


def verifier(**tls) -> VerifierConfig:
    return VerifierConfig(model="smollm2-135m-instruct", **tls)


def gateway(**tls) -> GatewayConfig:
    return GatewayConfig(**tls)


@pytest.mark.parametrize("make", [drafter, verifier, gateway])
def test_each_service_checks_its_tls_files(make, certs, tmp_path):
    own = issued(str(certs), "drafter")
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        make(tls_cert=own.cert)
    with pytest.raises(ValueError, match="--tls-key .*missing-key.pem"):
        make(tls_cert=own.cert, tls_key=str(tmp_path / "missing-key.pem"))
    (tmp_path / "ca.txt").write_text("not a certificate")
    with pytest.raises(ValueError, match="--tls-ca .*not a PEM file"):
        make(tls_cert=own.cert, tls_key=own.key, tls_ca=str(tmp_path / "ca.txt"))
    assert make(tls_cert=own.cert, tls_key=own.key, tls_ca=own.ca).tls == TlsFiles(own.cert, own.key, own.ca)


@pytest.mark.parametrize("make", [drafter, verifier])
def test_a_server_refuses_a_ca_without_a_certificate(make, certs):
    with pytest.raises(ValueError, match="--tls-ca needs --tls-cert"):
        make(tls_ca=str(certs / "ca.pem"))


def test_the_gateway_may_verify_servers_without_a_certificate_of_its_own(certs):
    config = gateway(tls_ca=str(certs / "ca.pem"), tls_server_name="verifier")
    assert config.tls.channel_credentials() is not None
    with pytest.raises(ValueError, match="--tls-server-name needs --tls-ca"):
        gateway(tls_server_name="verifier")
    with pytest.raises(ValueError, match="--ssl-certfile and --ssl-keyfile go together"):
        gateway(ssl_certfile=str(certs / "gateway.pem"))


def test_tls_flags_come_from_the_environment_too(certs, monkeypatch):
    from speclane.config import parse_config

    for flag, name in (("TLS_CERT", "drafter.pem"), ("TLS_KEY", "drafter-key.pem"), ("TLS_CA", "ca.pem")):
        monkeypatch.setenv(f"SPECLANE_DRAFTER_{flag}", str(certs / name))
    assert parse_config(DrafterConfig, "SPECLANE_DRAFTER_", [], "drafter").tls.server_mode == "mtls"


# --- speclane serve --------------------------------------------------------------------------

def serve_configs(tmp_path, *argv: str):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return serve.configs_from_args(parser.parse_args([str(tmp_path), *argv]))


def test_serve_gives_each_service_its_own_files_from_a_tls_dir(certs, tmp_path):
    configs = dict(zip(SERVICES, serve_configs(tmp_path, "--tls-dir", str(certs))))
    for service, config in configs.items():
        assert config.tls_cert == str(certs / f"{service}.pem") and config.tls_key == str(certs / f"{service}-key.pem")
        assert config.tls_ca == str(certs / "ca.pem")
    assert configs["drafter"].tls.server_mode == configs["verifier"].tls.server_mode == "mtls"


def test_serve_without_a_ca_keeps_the_internal_links_plaintext(certs, tmp_path):
    own = issued(str(certs), "gateway")
    drafter_config, verifier_config, gateway_config = serve_configs(tmp_path, "--tls-cert", own.cert,
                                                                    "--tls-key", own.key)
    assert drafter_config.tls.server_mode == verifier_config.tls.server_mode == "plaintext"
    assert gateway_config.tls.channel_credentials() is None and gateway_config.tls_cert == own.cert
    with_ca = serve_configs(tmp_path, "--tls-cert", own.cert, "--tls-key", own.key, "--tls-ca", own.ca)
    assert all(config.tls == own for config in with_ca)


def test_serve_refuses_a_tls_dir_with_tls_files_or_without_a_ca(certs, tmp_path):
    with pytest.raises(ValueError, match="exclude each other"):
        serve_configs(tmp_path, "--tls-dir", str(certs), "--tls-ca", str(certs / "ca.pem"))
    with pytest.raises(ValueError, match="speclane certs"):
        serve_configs(tmp_path, "--tls-dir", str(tmp_path))


# --- a drafter process serving mTLS ----------------------------------------------------------

def health(address: str, tls: TlsFiles) -> int:
    with channel(address, tls) as probe:
        return health_pb2_grpc.HealthStub(probe).Check(health_pb2.HealthCheckRequest(), timeout=5).status


@pytest.fixture(scope="module")
def mtls_drafter(certs):
    address = f"127.0.0.1:{free_port()}"
    own = issued(str(certs), "drafter")
    process = subprocess.Popen([sys.executable, "-m", "drafter_service", "--address", address, "--tls-cert", own.cert,
                                "--tls-key", own.key, "--tls-ca", own.ca],
                               cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    client = issued(str(certs), "gateway")
    deadline = time.monotonic() + 30
    while True:
        try:
            if health(address, client) == health_pb2.HealthCheckResponse.SERVING:
                break
        except grpc.RpcError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the TLS drafter did not serve:\n{process.communicate()[1].decode()[-3000:]}")
        time.sleep(0.2)
    yield address
    process.terminate()
    assert process.wait(30) == 0


def refused(address: str, tls: TlsFiles) -> bool:
    try:
        health(address, tls)
    except grpc.RpcError as error:
        return error.code() == grpc.StatusCode.UNAVAILABLE
    return False


def test_the_drafter_serves_a_client_with_a_certificate_of_its_ca(mtls_drafter, certs):
    assert health(mtls_drafter, issued(str(certs), "gateway")) == health_pb2.HealthCheckResponse.SERVING


def test_the_drafter_refuses_plaintext_and_clients_without_a_certificate(mtls_drafter, certs):
    assert refused(mtls_drafter, TlsFiles())
    assert refused(mtls_drafter, TlsFiles(ca=str(certs / "ca.pem")))


def test_the_drafter_refuses_a_certificate_of_another_ca(mtls_drafter, certs, other_ca):
    foreign = issued(str(other_ca), "gateway")
    assert refused(mtls_drafter, TlsFiles(cert=foreign.cert, key=foreign.key, ca=str(certs / "ca.pem")))


def test_a_client_refuses_a_drafter_its_ca_did_not_sign(mtls_drafter, other_ca):
    assert refused(mtls_drafter, issued(str(other_ca), "gateway"))


def test_the_gateways_drafter_client_speaks_mtls(mtls_drafter, certs):
    async def limits(tls: TlsFiles):
        client = DrafterClient(mtls_drafter, 1.0, tls=tls)
        try:
            return await client.refresh_limits()
        finally:
            await client.close()

    assert asyncio.run(limits(issued(str(certs), "gateway"))).max_tree_depth == 24
    assert asyncio.run(limits(TlsFiles())) is None


def speclane_health(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "speclane_cli", "health", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.e2e
def test_the_grpc_health_probe_speaks_mtls(mtls_drafter, certs):
    own = issued(str(certs), "drafter")
    flags = ["--tls-ca", own.ca, "--tls-cert", own.cert, "--tls-key", own.key]
    assert speclane_health("grpc", mtls_drafter, *flags).returncode == 0
    assert speclane_health("grpc", mtls_drafter).returncode == 1
    # The name checked in the certificate is --tls-server-name's, not the dialled address's.
    assert speclane_health("grpc", mtls_drafter, *flags, "--tls-server-name", "drafter").returncode == 0
    assert speclane_health("grpc", mtls_drafter, *flags, "--tls-server-name", "elsewhere.example").returncode == 1
    assert speclane_health("grpc", mtls_drafter, "--tls-cert", own.cert, "--tls-key", own.key).returncode == 2


class _Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the http.server API
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):  # keep pytest's output clean
        pass


@pytest.fixture
def https_url(certs):
    own = issued(str(certs), "gateway")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(own.cert, own.key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"https://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@pytest.mark.e2e
def test_the_http_health_probe_verifies_https_with_the_ca(https_url, certs):
    assert speclane_health("http", https_url, "--tls-ca", str(certs / "ca.pem")).returncode == 0
    assert speclane_health("http", https_url).returncode == 1  # the system's CAs do not know ours
