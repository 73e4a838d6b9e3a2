"""Who may call: the gateway's API keys, TLS between the services, and a local CA for
`specmesh up --secure`.

API keys come from `gateway.api_keys` (comma-separated, e.g. SPECMESH_GATEWAY__API_KEYS) and
`gateway.api_keys_file` (one per line); a key is never logged, only how many there are. Clients
send `authorization: Bearer <key>` (gRPC metadata or the HTTP header). TLS: every service serves
its `tls.cert_file` / `tls.key_file`; clients (the services calling each other, the stack's
health checks) verify servers with `tls.ca_file`, and with `tls.mutual` present the same
certificate, which servers then require.
"""
from __future__ import annotations

import datetime
import hmac
import ipaddress
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc

from specmesh_services.common.config import GatewaySettings, TlsSettings

log = logging.getLogger(__name__)

AUTH_HEADER = "authorization"


def api_keys(gateway: GatewaySettings) -> frozenset[str]:
    """The keys the gateway accepts (empty: no key needed)."""
    keys = set()
    if gateway.api_keys is not None:
        keys |= {k.strip() for k in gateway.api_keys.get_secret_value().split(",") if k.strip()}
    if gateway.api_keys_file is not None:
        try:
            lines = Path(gateway.api_keys_file).read_text().splitlines()
        except OSError as err:
            raise ValueError(f"cannot read gateway.api_keys_file: {err}") from None
        keys |= {line.strip() for line in lines if line.strip() and not line.startswith("#")}
    return frozenset(keys)


def bearer_ok(value: str | None, keys: frozenset[str]) -> bool:
    """Whether an `authorization` value is "Bearer <one of keys>" (constant-time compare)."""
    scheme, _, token = (value or "").partition(" ")
    return scheme.lower() == "bearer" and any(
        hmac.compare_digest(token.strip().encode(), key.encode()) for key in keys)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to `services` without a valid key with UNAUTHENTICATED (health checks and
    reflection stay open: probes and grpcurl need no key)."""

    MESSAGE = "missing or invalid API key: send the metadata 'authorization: Bearer <key>'"

    def __init__(self, keys: frozenset[str], services: Iterable[str]) -> None:
        self.keys = keys
        self.services = frozenset(services)

    async def intercept_service(self, continuation, details):
        service = details.method.lstrip("/").rpartition("/")[0]
        if service not in self.services or not self.keys:
            return await continuation(details)
        metadata = dict(details.invocation_metadata or ())
        if bearer_ok(metadata.get(AUTH_HEADER), self.keys):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None

        async def refuse_unary(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, self.MESSAGE)

        async def refuse_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, self.MESSAGE)
            yield  # an async generator, as the method it stands for

        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                refuse_stream, handler.request_deserializer, handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(
            refuse_unary, handler.request_deserializer, handler.response_serializer)


# ---------------------------------------------------------------------------------------------
# TLS


def _read(path: Path | None) -> bytes | None:
    return Path(path).read_bytes() if path is not None else None


def check(tls: TlsSettings) -> bool:
    """Whether TLS is on; ValueError naming what is missing when it is half configured."""
    if tls.enabled and (tls.key_file is None or tls.ca_file is None):
        raise ValueError("tls.cert_file needs tls.key_file and tls.ca_file")
    if not tls.enabled and (tls.key_file is not None or tls.mutual):
        raise ValueError("tls.key_file and tls.mutual need tls.cert_file")
    return tls.enabled


def server_credentials(tls: TlsSettings) -> grpc.ServerCredentials | None:
    """The server side of `tls` (None: plaintext)."""
    if not check(tls):
        return None
    return grpc.ssl_server_credentials([(_read(tls.key_file), _read(tls.cert_file))],
                                       root_certificates=_read(tls.ca_file) if tls.mutual else None,
                                       require_client_auth=tls.mutual)


def channel_credentials(tls: TlsSettings) -> grpc.ChannelCredentials | None:
    """The client side of `tls` (None: plaintext): the CA to verify servers with, and with
    `mutual` this service's certificate."""
    if not check(tls):
        return None
    if tls.mutual:
        return grpc.ssl_channel_credentials(_read(tls.ca_file), _read(tls.key_file),
                                            _read(tls.cert_file))
    return grpc.ssl_channel_credentials(_read(tls.ca_file))


# ---------------------------------------------------------------------------------------------
# a local CA (`specmesh up --secure`)


@dataclass(frozen=True)
class LocalPki:
    ca: Path
    cert: Path
    key: Path


def local_pki(folder: Path, hosts: Iterable[str] = ("localhost", "127.0.0.1")) -> LocalPki:
    """A CA and one certificate it signs for `hosts`, valid for server and client auth, written
    to `folder` (keys 0600); reused while both exist."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    pki = LocalPki(folder / "ca.pem", folder / "service.pem", folder / "service-key.pem")
    if pki.ca.is_file() and pki.cert.is_file() and pki.key.is_file():
        return pki
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("specmesh local CA"))
          .issuer_name(name("specmesh local CA")).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now)
          .not_valid_after(now + datetime.timedelta(days=365))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.IPAddress(ipaddress.ip_address(h)) if _is_ip(h) else x509.DNSName(h)
             for h in hosts]
    cert = (x509.CertificateBuilder().subject_name(name("specmesh service"))
            .issuer_name(ca.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=365))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    _write(pki.ca, ca.public_bytes(pem))
    _write(pki.cert, cert.public_bytes(pem))
    _write(pki.key, key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()), private=True)
    _write(folder / "ca-key.pem", ca_key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()), private=True)
    return pki


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _write(path: Path, data: bytes, private: bool = False) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
