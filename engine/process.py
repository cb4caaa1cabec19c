"""What an engine's worker processes and their command share: the message queue the
workers report into and the events they wait on (``multiprocessing``'s, typed by what
is used of them)."""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["Flag", "Messages", "join"]


class Messages(Protocol):
    """What the workers report into (a ``multiprocessing`` queue): dicts with a ``kind``."""

    def put(self, item: dict[str, Any]) -> None: ...


class Flag(Protocol):
    """A ``multiprocessing`` event."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


def join(procs: list[Any], timeout: float) -> None:
    """Wait up to ``timeout`` seconds for each worker process to exit; terminate the
    ones still running (then wait 5 s more)."""
    for proc in procs:
        proc.join(timeout=timeout)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
