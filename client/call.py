"""One call of a session, described and not made (:class:`Call`): what
:class:`kvmem.client.session.Session` builds and the clients make."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from google.protobuf.message import Message

T = TypeVar("T")


class Call(Generic[T]):
    """One call, described and not made: the stub's method name, the request, the
    deadline in seconds, and ``read``, which turns the response into what the caller
    gets (a Step goes on the client's step stream unless it was made with
    ``step_stream=False``). ``ends_session``: the client stops its keep-alive once the call is done.
    ``fenced``: its answer is handed over only while the lease is known to hold (a Step:
    its pages are the session's only while the session lives). ``sent_at``: when it was
    (last) sent (monotonic seconds)."""

    __slots__ = ("ends_session", "fenced", "method", "read", "request", "sent_at", "timeout")

    def __init__(
        self,
        method: str,
        request: Message,
        timeout: float,
        read: Callable[[Any], T],
        ends_session: bool = False,
        fenced: bool = False,
    ) -> None:
        self.method = method
        self.request = request
        self.timeout = timeout
        self.read = read
        self.ends_session = ends_session
        self.fenced = fenced
        self.sent_at = time.monotonic()
