"""The channel a kvmem client opens: target syntax, options and auth metadata (no torch)."""

from __future__ import annotations

CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
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
