"""TLS of the gRPC links: the PEM files a process uses, the server's and the
client's credentials made from them, and the file names `speclane certs` writes.

One rule on both sides: a server with a certificate serves TLS, and with a CA
too it requires client certificates signed by that CA (mTLS); a client speaks
TLS when it has a CA to verify the server with, and shows its own certificate
if it has one. Imports only grpc and the standard library: the health probe
uses it in the light image."""

import dataclasses
import pathlib

import grpc

CA_FILE = "ca.pem"
CA_KEY_FILE = "ca-key.pem"


def cert_file(service: str) -> str:
    return f"{service}.pem"


def key_file(service: str) -> str:
    return f"{service}-key.pem"


def check_pem_file(flag: str, path: str) -> None:
    """Config-time check: a missing, unreadable (a key is 0600) or non-PEM file fails the
    start with its flag named, not the first handshake with an opaque error."""
    try:
        text = pathlib.Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in text:
        raise ValueError(f"{flag} {path}: not a PEM file")


def check_pair(cert_flag: str, cert: str, key_flag: str, key: str) -> None:
    if bool(cert) != bool(key):
        raise ValueError(f"{cert_flag} and {key_flag} go together: give both or neither")
    for flag, path in ((cert_flag, cert), (key_flag, key)):
        if path:
            check_pem_file(flag, path)


@dataclasses.dataclass(frozen=True)
class TlsFiles:
    """A process's TLS files (paths; empty: none): its certificate and key, served and
    shown to servers as its client certificate, and the CA its peers are signed by."""

    cert: str = ""
    key: str = ""
    ca: str = ""
    # Checked in servers' certificates instead of the dialled host (grpc.ssl_target_name_override).
    server_name: str = ""

    def __post_init__(self):
        check_pair("--tls-cert", self.cert, "--tls-key", self.key)
        if self.ca:
            check_pem_file("--tls-ca", self.ca)
        if self.server_name and not self.ca:
            raise ValueError("--tls-server-name needs --tls-ca: without a CA the link is plaintext")

    @property
    def server_mode(self) -> str:
        """What a server with these files serves, for its logs."""
        return "mtls" if self.cert and self.ca else "tls" if self.cert else "plaintext"

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS with this certificate, requiring client certificates signed by the CA when
        there is one; None without a certificate (plaintext)."""
        if not self.cert:
            return None
        ca = _read(self.ca) if self.ca else None
        return grpc.ssl_server_credentials([(_read(self.key), _read(self.cert))], root_certificates=ca,
                                           require_client_auth=ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS verifying the server against the CA, showing this certificate if there is
        one; None without a CA (plaintext)."""
        if not self.ca:
            return None
        return grpc.ssl_channel_credentials(root_certificates=_read(self.ca),
                                            private_key=_read(self.key) if self.key else None,
                                            certificate_chain=_read(self.cert) if self.cert else None)


def server_tls(cert: str, key: str, ca: str) -> TlsFiles:
    """A server's files; a CA alone is refused: client certificates are checked only over TLS."""
    if ca and not cert:
        raise ValueError("--tls-ca needs --tls-cert and --tls-key: a server checks client certificates "
                         "only when it serves TLS")
    return TlsFiles(cert=cert, key=key, ca=ca)


def issued(directory: str, service: str) -> TlsFiles:
    """`service`'s files in a directory made by `speclane certs`."""
    root = pathlib.Path(directory)
    if not (root / CA_FILE).is_file():
        raise ValueError(f"{directory} has no {CA_FILE}: make it with `speclane certs --out {directory}`")
    return TlsFiles(cert=str(root / cert_file(service)), key=str(root / key_file(service)), ca=str(root / CA_FILE))


def aio_channel(address: str, tls: TlsFiles, options=()) -> grpc.aio.Channel:
    credentials = tls.channel_credentials()
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, credentials, options=_secure_options(tls, options))


def channel(address: str, tls: TlsFiles, options=()) -> grpc.Channel:
    """The blocking twin of aio_channel (health probes)."""
    credentials = tls.channel_credentials()
    if credentials is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, credentials, options=_secure_options(tls, options))


def _secure_options(tls: TlsFiles, options) -> tuple:
    if tls.server_name:
        return (*options, ("grpc.ssl_target_name_override", tls.server_name))
    return tuple(options)


def _read(path: str) -> bytes:
    return pathlib.Path(path).read_bytes()
