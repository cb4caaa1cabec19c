"""TLS for the ``--tcp`` port: ``--tls-cert`` and ``--tls-key`` (and, for mutual TLS,
``--tls-client-ca``) read and checked before anything is created, each refusal one line
naming the option; then the gRPC server credentials. The unix socket stays plaintext
(its 0600 mode protects it), and so does ``--health-port`` (kubelet's gRPC probes speak
no TLS). A bearer token is still required beyond loopback: TLS keeps it (and the calls)
private on the wire, the token says who may call."""

from __future__ import annotations

import dataclasses
import ssl
from typing import TYPE_CHECKING, NoReturn

import grpc

if TYPE_CHECKING:
    from kvmem.server.process.startup import ServerConfig

_CERTIFICATE = b"-----BEGIN CERTIFICATE-----"


class TLSConfigError(Exception):
    """A TLS option that cannot be used; the message names it (startup makes it a StartupError)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ServerTLS:
    """The PEM bytes the gRPC server credentials are made of."""

    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )


def _read(option: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise TLSConfigError(f"{option} {path}: cannot read it ({exc.strerror or exc})") from None


def _check_certificates(option: str, path: str, data: bytes) -> None:
    """At least one PEM certificate, and every one of them parses."""
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        text = ""
    if _CERTIFICATE not in data or not text:
        raise TLSConfigError(f"{option} {path}: no PEM certificate in it (-----BEGIN CERTIFICATE-----)")
    try:
        ssl.create_default_context().load_verify_locations(cadata=text)
    except ssl.SSLError as exc:
        raise TLSConfigError(f"{option} {path}: not a valid PEM certificate ({exc.reason or exc})") from None


def _encrypted() -> NoReturn:
    raise _Encrypted


class _Encrypted(Exception):
    """load_cert_chain asked for a passphrase."""


def load(cfg: ServerConfig) -> ServerTLS | None:
    """The TLS of ``--tcp``, read and checked (None: plaintext). Refused, each in one
    line naming the option: a TLS option without --tcp, --tls-cert without --tls-key
    (or the reverse), --tls-client-ca without them, a file that cannot be read, no
    certificate, a key that is not a PEM private key, is encrypted, or does not match
    the certificate."""
    given = [
        (o, v)
        for o, v in (("--tls-cert", cfg.tls_cert), ("--tls-key", cfg.tls_key), ("--tls-client-ca", cfg.tls_client_ca))
        if v is not None
    ]
    if not given:
        return None
    if cfg.tcp is None:
        option, value = given[0]
        raise TLSConfigError(
            f"{option} {value}: TLS is for --tcp only (the unix socket is plaintext, protected by its 0600 mode): "
            "add --tcp HOST:PORT, or drop the TLS options"
        )
    if cfg.tls_cert is None or cfg.tls_key is None:
        missing = "--tls-cert" if cfg.tls_cert is None else "--tls-key"
        option, value = given[0]
        raise TLSConfigError(f"{option} {value} needs {missing} too (the certificate and its private key)")
    cert = _read("--tls-cert", cfg.tls_cert)
    key = _read("--tls-key", cfg.tls_key)
    _check_certificates("--tls-cert", cfg.tls_cert, cert)
    if b"PRIVATE KEY-----" not in key:
        raise TLSConfigError(f"--tls-key {cfg.tls_key}: no PEM private key in it (-----BEGIN ... PRIVATE KEY-----)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cfg.tls_cert, cfg.tls_key, password=_encrypted)
    except _Encrypted:
        raise TLSConfigError(f"--tls-key {cfg.tls_key} is encrypted: gRPC needs the key without a passphrase") from None
    except ssl.SSLError as exc:
        if exc.reason in ("KEY_VALUES_MISMATCH", "NO_CERTIFICATE_ASSIGNED"):
            raise TLSConfigError(
                f"--tls-key {cfg.tls_key} does not match the certificate of --tls-cert {cfg.tls_cert}"
            ) from None
        raise TLSConfigError(f"--tls-key {cfg.tls_key}: not a usable PEM private key ({exc.reason or exc})") from None
    except OSError as exc:  # the file went away between the reads
        raise TLSConfigError(f"--tls-key {cfg.tls_key}: cannot read it ({exc.strerror or exc})") from None
    client_ca = None
    if cfg.tls_client_ca is not None:
        client_ca = _read("--tls-client-ca", cfg.tls_client_ca)
        _check_certificates("--tls-client-ca", cfg.tls_client_ca, client_ca)
    return ServerTLS(cert, key, client_ca)
