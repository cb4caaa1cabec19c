"""Refused calls, logged as rate-limited summaries (docs/DESIGN.md, Errors: no peer can flood the log).

A refusal is a call kvmem answered with an error of the caller's making (bad input, an
unknown session, a wrong token, ...). Logging one line, let alone a traceback, per
refusal would let any peer -- an unauthenticated TCP one included -- fill the disk, so
:class:`RefusalLog` counts refusals by (peer, method, reason) and logs:

* the first refusal of a kind at once, one WARNING line with its message (at most
  :data:`FIRST_LINES_PER_INTERVAL` such lines per interval, so many peers cannot flood
  it either);
* everything else folded into one WARNING summary line per interval (default 10 s):
  the total and, for the most frequent kinds, the count, peer, method, reason and the
  last message; the summary is due :attr:`interval_s` after the first line it follows,
  and is flushed at shutdown too.

A kind seen in one interval stays known while it keeps recurring: a steady flood logs
one summary line per interval and nothing else. Memory is bounded: at most
:data:`MAX_KINDS` kinds are tracked; the rest are counted under one overflow kind.
A peer is its address without the port (a reconnecting peer is one peer). Corruption
(a bug in kvmem) is not a refusal: the service logs it as an ERROR each time.
Not thread-safe: call it from the server's one event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

log = logging.getLogger("kvmem.refusals")

INTERVAL_S = 10.0  # at most one summary line per interval
FIRST_LINES_PER_INTERVAL = 5  # first-of-a-kind lines logged at once, per interval
MAX_KINDS = 1024  # kinds tracked at once; beyond, refusals are counted as "other"
SUMMARY_KINDS = 8  # kinds named in one summary line, most frequent first
MAX_MESSAGE_CHARS = 300  # a logged message is cut to this

Key = tuple[str, str, str]  # (peer, method, reason)
_OVERFLOW: Key = ("(other peers)", "*", "*")


@dataclasses.dataclass(slots=True)
class _Kind:
    pending: int = 0  # refusals not logged yet
    message: str = ""  # the last one's message


def peer_address(peer: str) -> str:
    """A gRPC peer string without its port: ``ipv4:10.0.0.1:5555`` -> ``ipv4:10.0.0.1``,
    ``ipv6:[::1]:5555`` -> ``ipv6:[::1]``; a unix peer as it is."""
    kind, sep, rest = peer.partition(":")
    if sep and kind in ("ipv4", "ipv6"):
        host, colon, port = rest.rpartition(":")
        if colon and port.isdigit():
            return f"{kind}:{host}"
    return peer


def _cut(message: str) -> str:
    return message if len(message) <= MAX_MESSAGE_CHARS else message[: MAX_MESSAGE_CHARS - 1] + "…"


class RefusalLog:
    """Counts refused calls and logs them in rate-limited summaries (see the module)."""

    def __init__(
        self,
        interval_s: float = INTERVAL_S,
        *,
        logger: logging.Logger = log,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self._log = logger
        self._clock = clock
        self._kinds: dict[Key, _Kind] = {}  # known kinds: seen in this interval or the last one
        self._first_lines_left = FIRST_LINES_PER_INTERVAL
        self._window_start = clock()
        self._timer: asyncio.TimerHandle | None = None
        self.total = 0  # refusals since start

    def record(self, peer: str, method: str, reason: str, message: str) -> None:
        """Count one refusal; log it at once if its kind is new (and the interval's
        budget of such lines lasts), else fold it into the next summary. O(1)."""
        self.total += 1
        now = self._clock()
        if now - self._window_start >= self.interval_s:
            self.flush(now)
        key: Key = (peer_address(peer), method, reason)
        kind = self._kinds.get(key)
        if kind is None:
            if len(self._kinds) >= MAX_KINDS:
                key = _OVERFLOW
                kind = self._kinds.setdefault(key, _Kind())
            else:
                kind = self._kinds[key] = _Kind()
                if self._first_lines_left > 0:
                    self._first_lines_left -= 1
                    self._log.warning(
                        "refused %s from %s: %s: %s (repeats are summarised every %gs)",
                        method,
                        key[0],
                        reason,
                        _cut(message),
                        self.interval_s,
                    )
                    return
        kind.pending += 1
        kind.message = message
        self._schedule()

    def flush(self, now: float | None = None) -> None:
        """Log one summary line of the refusals not logged yet (nothing if none), and
        start a new interval. Kinds that did not recur in it are forgotten."""
        now = self._clock() if now is None else now
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending = [(k, v) for k, v in self._kinds.items() if v.pending]
        if pending:
            pending.sort(key=lambda kv: -kv[1].pending)
            total = sum(v.pending for _, v in pending)
            parts = [
                f"{v.pending} x {method} {reason} from {peer} (last: {_cut(v.message)})"
                for (peer, method, reason), v in pending[:SUMMARY_KINDS]
            ]
            more = len(pending) - SUMMARY_KINDS
            if more > 0:
                parts.append(f"and {sum(v.pending for _, v in pending[SUMMARY_KINDS:])} more of {more} other kinds")
            self._log.warning(
                "refused %d calls in the last %.1fs: %s", total, now - self._window_start, "; ".join(parts)
            )
        self._kinds = {k: _Kind() for k, v in pending if k != _OVERFLOW}  # still recurring: stay known
        self._first_lines_left = FIRST_LINES_PER_INTERVAL
        self._window_start = now

    def _schedule(self) -> None:
        """A summary due at the end of this interval, on the running event loop (none
        outside one: then the next record or :meth:`flush` logs it)."""
        if self._timer is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        delay = max(self._window_start + self.interval_s - self._clock(), 0.0)
        self._timer = loop.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.flush()
