"""`speclane certs --out DIR --hosts NAME,IP,...`: a development CA and a certificate
for each service, for mTLS between them and TLS on the gateway's public ports.

Every service certificate is both a server and a client certificate (the gateway
shows its own to the drafter and the verifiers; health probes show the service's
own) and names localhost, 127.0.0.1, the service's name (its host name in a
compose network) and the given hosts. All are signed by one CA: any of them is
accepted by every service, which is what the services check (membership of the
deployment, not which service). A production deployment can bring its own CA's
files instead: the services only read PEM files."""

import datetime
import ipaddress
import os
import pathlib
import sys

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from speclane.tls import CA_FILE, CA_KEY_FILE, cert_file, key_file

SERVICES = ("drafter", "verifier", "gateway")
DEFAULT_DAYS = 825  # the longest validity clients such as macOS accept for a TLS server certificate
CLOCK_SKEW = datetime.timedelta(minutes=5)  # valid a little before now: peers' clocks differ


def add_arguments(parser) -> None:
    parser.add_argument("--out", required=True, type=pathlib.Path, help="directory to write the files to (created)")
    parser.add_argument("--hosts", default="",
                        help="comma-separated host names and IP addresses the services are dialled at, besides "
                             "localhost and 127.0.0.1 (two hosts: both hosts' addresses)")
    parser.add_argument("--days", type=int, default=DEFAULT_DAYS,
                        help=f"validity of the CA and the certificates (default {DEFAULT_DAYS})")
    parser.add_argument("--force", action="store_true", help="overwrite files already in --out")


def subject_names(service: str, hosts: str) -> list[x509.GeneralName]:
    """The SAN entries of `service`'s certificate; ValueError on a malformed host."""
    names: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                     x509.DNSName(service)]
    for host in (part.strip() for part in hosts.split(",")):
        if not host:
            continue
        try:
            name = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            if any(char.isspace() or char in "/:" for char in host):
                raise ValueError(f"--hosts: {host!r} is neither a host name nor an IP address") from None
            name = x509.DNSName(host)
        if name not in names:
            names.append(name)
    return names


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "speclane"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject: x509.Name, issuer: x509.Name, public_key, days: int) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False))


def make_ca(days: int) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name("speclane development CA")
    cert = (_builder(name, name, key.public_key(), days)  # self-signed
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def issue(ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, service: str,
          names: list[x509.GeneralName], days: int) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """`service`'s key and certificate, usable as a TLS server's and a TLS client's."""
    key = ec.generate_private_key(ec.SECP256R1())
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (_builder(_name(service), ca_cert.subject, key.public_key(), days)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return key, cert


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def build(hosts: str, days: int) -> dict[str, tuple[bytes, int]]:
    """File name -> (content, mode) of the whole set: keys readable by their owner only."""
    ca_key, ca_cert = make_ca(days)
    files = {CA_FILE: (_cert_pem(ca_cert), 0o644), CA_KEY_FILE: (_key_pem(ca_key), 0o600)}
    for service in SERVICES:
        key, cert = issue(ca_key, ca_cert, service, subject_names(service, hosts), days)
        files[cert_file(service)] = (_cert_pem(cert), 0o644)
        files[key_file(service)] = (_key_pem(key), 0o600)
    return files


def write(out: pathlib.Path, files: dict[str, tuple[bytes, int]], force: bool) -> None:
    """Writes every file or, if any exists and not `force`, none (FileExistsError)."""
    existing = [name for name in files if (out / name).exists()]
    if existing and not force:
        raise FileExistsError(f"{out} already holds {', '.join(existing)}: pass --force to replace them")
    out.mkdir(parents=True, exist_ok=True)
    for name, (content, mode) in files.items():
        path = out / name
        path.unlink(missing_ok=True)  # a new file gets `mode` at creation: a key is never readable by others
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(descriptor, "wb") as stream:
            stream.write(content)


def run(args) -> int:
    if args.days < 1:
        print("speclane certs: --days must be >= 1", file=sys.stderr)
        return 2
    try:
        files = build(args.hosts, args.days)
        write(args.out, files, args.force)
    except ValueError as exc:
        print(f"speclane certs: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # files already there (without --force), or --out not writable
        print(f"speclane certs: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {', '.join(files)} to {args.out}")
    print(f"no service reads {CA_KEY_FILE}: keep it off the hosts that run them")
    return 0
