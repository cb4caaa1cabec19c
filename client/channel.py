"""The channel a kvmem client opens: target syntax, options, TLS and auth metadata (no torch).

A ``HOST:PORT`` target is plaintext unless the client gets ``tls_ca``: the CA
certificate(s) that signed the server's (``kvmem serve --tls-cert``), as a path or PEM
bytes, or ``True`` for gRPC's default roots (its bundled ones, or the file
``GRPC_DEFAULT_SSL_ROOTS_FILE_PATH`` names). ``tls_server_name`` checks the certificate
against that name instead of the target's host; ``tls_cert``/``tls_key`` are the
client's own certificate and key, for a server that requires them (``--tls-client-ca``).
A unix socket is always plaintext (its 0600 mode protects it).

A mismatch is a :class:`TLSError` at once, never a wait: gRPC reports a failed handshake
(or a TLS server closing a plaintext connection) as UNAVAILABLE, which the clients
otherwise retry while ``wait_for_ready``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import grpc

from .errors import KVMemError, Unavailable

CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
    # A sidecar that restarts (--keep-state: its sessions resume) is back within seconds:
    # reconnect at most a second apart, not gRPC's default of up to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)

PemSource = str | bytes | os.PathLike[str]  # a path, or the PEM text itself (bytes)

# A request up to this size fits any HTTP/2 flow-control window (64 KiB at the least), so
# gRPC hands it to the transport at once. A bigger one may have to wait for the server to
# read: measured with grpcio 1.85, a blocking unary call (and an asyncio one) whose 16 MB
# request waits so on a stopped server does not end at its deadline but hangs. The
# clients bound such calls with a timer of their own (:func:`deadline_exceeded`).
BIG_REQUEST_BYTES = 16 * 1024


def deadline_exceeded(method: str, timeout: float) -> KVMemError:
    """What a call gets when its answer does not come within ``timeout`` seconds: the
    DEADLINE_EXCEEDED gRPC gives a unary call, when the client had to enforce it."""
    return KVMemError(
        grpc.StatusCode.DEADLINE_EXCEEDED, "", f"Deadline Exceeded: no {method} answer within {timeout:g} s"
    )


def normalize_target(target: str) -> str:
    """``/path/to.sock`` and ``unix:/path`` are unix sockets; anything else is
    ``HOST:PORT``."""
    if target.startswith("/") or target.startswith("./"):
        return f"unix:{target}"
    return target


def auth_metadata(auth_token: str | None) -> tuple[tuple[str, str], ...] | None:
    """The call metadata that carries ``auth_token`` (None: no token)."""
    return None if auth_token is None else (("authorization", f"Bearer {auth_token}"),)


class TLSError(Unavailable):
    """The connection failed for a reason of TLS: the server's certificate is not
    signed by ``tls_ca`` or does not name the host, the server does not speak TLS (or
    speaks only TLS to a plaintext client), or it wants a client certificate. A
    configuration error: not retried, whatever ``wait_for_ready`` says."""


def _read_pem(what: str, source: PemSource, marker: bytes) -> bytes:
    """PEM bytes from a path (str or PathLike) or as given (bytes); a ValueError naming
    ``what`` when the file cannot be read or holds no ``marker`` block."""
    if isinstance(source, bytes):
        data, where = source, "the PEM bytes given"
    else:
        path = os.fspath(source)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise ValueError(f"{what} {path}: cannot read it ({exc.strerror or exc})") from None
        where = path
    if marker not in data:
        kind = marker.decode().strip("-").removeprefix("BEGIN ").lower()
        raise ValueError(f"{what}: no PEM {kind} in {where}")
    return data


@dataclasses.dataclass(frozen=True)
class Transport:
    """How a client reaches its server: the target and, for TLS, the channel
    credentials. Opens channels and explains connection failures that TLS causes."""

    target: str
    credentials: grpc.ChannelCredentials | None = None
    server_name: str | None = None
    client_cert: bool = False  # the client presents a certificate (mutual TLS)

    @property
    def tls(self) -> bool:
        return self.credentials is not None

    @property
    def options(self) -> tuple[tuple[str, Any], ...]:
        if self.server_name is None:
            return CHANNEL_OPTIONS
        return (*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", self.server_name))

    def channel(self) -> grpc.Channel:
        if self.credentials is None:
            return grpc.insecure_channel(self.target, options=self.options)
        return grpc.secure_channel(self.target, self.credentials, options=self.options)

    def aio_channel(self) -> grpc.aio.Channel:
        if self.credentials is None:
            return grpc.aio.insecure_channel(self.target, options=self.options)
        return grpc.aio.secure_channel(self.target, self.credentials, options=self.options)

    def explain(self, details: str, *, first: bool) -> str | None:
        """What a connection failure's gRPC ``details`` mean when TLS explains them, or
        None. ``first``: the first call of a connection (an Attach, a one-shot Stats or
        health check), where a closed socket means the handshake was refused."""
        host = self.target
        if not self.tls:
            if first and not host.startswith("unix:") and "Socket closed" in details:
                return (
                    f"{host} closed the connection before answering: a server that listens with TLS "
                    "(kvmem serve --tls-cert) closes plaintext connections so; connect with tls_ca "
                    f"(kvmem health/stats: --tls-ca) ({details})"
                )
            return None
        if "WRONG_VERSION_NUMBER" in details:
            why = "the server does not speak TLS (a --tcp port without --tls-cert): connect without tls_ca"
        elif "CERTIFICATE_VERIFY_FAILED" in details:
            why = "the server's certificate is not signed by a CA in tls_ca (kvmem health/stats: --tls-ca)"
        elif "Hostname Verification" in details or "No match found for server name" in details:
            name = self.server_name or host.rpartition(":")[0]
            why = (
                f"the server's certificate does not name {name!r}: connect by a name it has, or give that name "
                "as tls_server_name (kvmem health/stats: --tls-server-name)"
            )
        elif "Tls handshake failed" in details or "Handshake failed" in details:
            why = "the TLS handshake failed"
        elif first and "Socket closed" in details:
            why = (
                "the server closed the connection after the TLS handshake: it wants a client certificate "
                "(kvmem serve --tls-client-ca) signed by its CA; "
                + ("this one is not" if self.client_cert else "give tls_cert and tls_key")
            )
        else:
            return None
        return f"TLS with {host}: {why} ({details})"

    def error(self, err: KVMemError, *, first: bool) -> KVMemError:
        """``err`` as a :class:`TLSError` when TLS explains it, else ``err`` itself."""
        if err.code != grpc.StatusCode.UNAVAILABLE or err.raw_reason:
            return err
        message = self.explain(err.message, first=first)
        return err if message is None else TLSError(err.code, "", message)


def transport(
    target: str,
    *,
    tls_ca: PemSource | bool | None = None,
    tls_server_name: str | None = None,
    tls_cert: PemSource | None = None,
    tls_key: PemSource | None = None,
) -> Transport:
    """The :class:`Transport` of ``target`` with these TLS settings (see the module's
    docstring). A ValueError for a file that cannot be read or holds no PEM block, for
    TLS to a unix socket, and for a client certificate without its key (or without
    ``tls_ca``)."""
    target = normalize_target(target)
    if tls_ca is None or tls_ca is False:
        for name, value in (("tls_server_name", tls_server_name), ("tls_cert", tls_cert), ("tls_key", tls_key)):
            if value is not None:
                raise ValueError(f"{name} needs tls_ca (the CA that signed the server's certificate, or True)")
        return Transport(target)
    if target.startswith("unix:"):
        raise ValueError(f"tls_ca is for HOST:PORT targets: the unix socket {target[5:]} is plaintext (mode 0600)")
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("tls_cert and tls_key go together (the client's certificate and its private key)")
    roots = None if isinstance(tls_ca, bool) else _read_pem("tls_ca", tls_ca, b"-----BEGIN CERTIFICATE-----")
    cert = None if tls_cert is None else _read_pem("tls_cert", tls_cert, b"-----BEGIN CERTIFICATE-----")
    key = None if tls_key is None else _read_pem("tls_key", tls_key, b"PRIVATE KEY-----")
    credentials = grpc.ssl_channel_credentials(root_certificates=roots, private_key=key, certificate_chain=cert)
    return Transport(target, credentials, tls_server_name or None, cert is not None)


_MAX_TIMEOUT_S = 10**7  # about 116 days: gRPC takes no infinite deadline (it fails at once)


def checked_timeout(seconds: float) -> float:
    """A call's deadline in seconds: a positive finite number (ValueError naming it
    otherwise: gRPC would fail the call at once on an infinite one)."""
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not 0 < seconds <= _MAX_TIMEOUT_S:
        raise ValueError(f"timeout must be a number of seconds in (0, {_MAX_TIMEOUT_S:g}], got {seconds!r}")
    return float(seconds)
