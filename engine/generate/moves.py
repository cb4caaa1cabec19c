"""How ``kvmem generate``'s processes move requests between them (kvmem's hand-offs):
the worker's side (:class:`WorkerMoves`) and the command's (:class:`Router`).

Roles: a ``mixed`` worker computes its prompts and decodes them, and adopts what a
draining peer hands it; a ``prefill`` worker (``--disaggregate P:D``) hands each request
off after its first token; a ``decode`` worker has no prompts of its own and adopts.
A worker told to stop (SIGTERM) drains: it hands its running requests off, passes its
waiting prompts on, waits until its tickets are adopted, and exits.

The protocol, over the command's message queue and one inbox and one ack queue per
worker (all multiprocessing queues, each FIFO per sender):

* ``handoff`` (worker -> command): ``items``, (ticket, state) pairs (ticket "" for a
  prompt not computed yet); the command routes each to the inbox of a worker that adopts
  and is not draining, the one with the fewest items in flight;
* ``took`` (worker -> command), after the Step that adopted them: the tickets adopted
  and how many items it took; the command acks each ticket to its giver, which may end
  its session once all of its tickets are adopted (a session that ends releases its
  tickets);
* ``idle``: the worker has nothing to do; ``draining``: it drains; ``returned``: the
  items left in a drained worker's inbox, routed again;
* the command closes every inbox (None) once every worker is idle or done and no item
  is in flight: the adopters' loops end when their requests do.
"""

from __future__ import annotations

import queue
import signal
import time
from typing import Any

from ..handoff import Moves

__all__ = ["ROLES", "Router", "WorkerMoves"]

ROLES = ("mixed", "prefill", "decode")
ACK_WAIT_S = 120.0  # how long a giver waits for its tickets' adoption before it ends its session anyway


class WorkerMoves:
    """A worker's side: its :class:`~kvmem.engine.handoff.Moves`, its inbox, the acks of its tickets,
    and SIGTERM (a drain)."""

    def __init__(self, worker: int, role: str, messages: Any, inbox: Any, acks: Any) -> None:
        self.worker, self.messages, self._inbox, self._acks = worker, messages, inbox, acks
        self.closed = inbox is None
        self.outstanding: set[str] = set()
        self._idle_sent = False
        self.moves = Moves(
            give_after_first=role == "prefill",
            inbox=self.take if inbox is not None else None,
            on_given=self.given,
            more=self.more,
            on_adopted=self.adopted,
        )
        signal.signal(signal.SIGTERM, self._drain)

    def _drain(self, _signum: int, _frame: Any) -> None:
        if not self.moves.draining:
            self.moves.draining = True
            self.messages.put({"kind": "draining", "worker": self.worker})

    def more(self) -> bool:
        return not self.closed and not self.moves.draining

    def take(self, free: int, idle: bool) -> list[tuple[str, bytes]]:
        items: list[tuple[str, bytes]] = []
        wait = 0.05 if idle else 0.0
        while len(items) < free and not self.closed:
            try:
                item = self._inbox.get(timeout=wait) if wait else self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self.closed = True
                break
            items.append(item)
            wait = 0.0
        if idle and not items and not self._idle_sent:
            self._idle_sent = True
            self.messages.put({"kind": "idle", "worker": self.worker})
        if items:
            self._idle_sent = False
        return items

    def given(self, items: list[tuple[str, bytes]]) -> None:
        self.outstanding.update(t for t, _ in items if t)
        self.messages.put({"kind": "handoff", "worker": self.worker, "items": items})

    def adopted(self, tickets: list[str], taken: int) -> None:
        self.messages.put({"kind": "took", "worker": self.worker, "tickets": tickets, "count": taken})

    def finish(self) -> None:
        """The loop is done: say so, hand back what the inbox still holds (a drained
        worker's), and wait until every ticket given is adopted."""
        if self._inbox is not None and self.moves.draining:
            left = []
            while not self.closed:
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    break
                left.append(item)
            self.messages.put({"kind": "returned", "worker": self.worker, "items": left})
        self.messages.put({"kind": "idle", "worker": self.worker})  # after its last hand-off: it gives no more
        deadline = time.monotonic() + ACK_WAIT_S
        while self.outstanding and time.monotonic() < deadline:
            try:
                self.outstanding.discard(self._acks.get(timeout=0.5))
            except queue.Empty:
                continue


class Router:
    """The command's side: routes hand-offs to adopters, acks tickets to their givers,
    and closes the inboxes when nothing more can come."""

    def __init__(self, ctx: Any, roles: list[str]) -> None:
        self.roles = roles
        self.inboxes = {w: ctx.Queue() for w, role in enumerate(roles) if role != "prefill"}
        self.acks = {w: ctx.Queue() for w in range(len(roles))}
        self.inflight = dict.fromkeys(self.inboxes, 0)
        self.idle: set[int] = set()
        self.draining: set[int] = set()
        self.done: set[int] = set()
        self.giver: dict[str, int] = {}
        self.closed = False
        self.num_handed_off = self.num_prompts_passed = 0

    def inbox_of(self, w: int) -> Any:
        return self.inboxes.get(w)

    def handle(self, msg: dict[str, Any]) -> str | None:
        """One worker message of the protocol (others are not its business); an error line, or None."""
        kind, w = msg.get("kind"), msg.get("worker", -1)
        error = None
        if kind == "handoff" or kind == "returned":
            if kind == "returned":
                self.inflight[w] -= len(msg["items"])
            for ticket, state in msg["items"]:
                if ticket and kind == "handoff":
                    self.giver[ticket] = w
                    self.num_handed_off += 1
                elif not ticket and kind == "handoff":
                    self.num_prompts_passed += 1
                error = self._route((ticket, state), avoid=w) or error
        elif kind == "took":
            self.inflight[w] -= msg["count"]
            for ticket in msg["tickets"]:
                giver = self.giver.pop(ticket, None)
                if giver is not None:
                    self.acks[giver].put(ticket)
        elif kind == "idle":
            self.idle.add(w)
        elif kind == "draining":  # it hands off from now on; its next idle is its last (see WorkerMoves.finish)
            self.draining.add(w)
            self.idle.discard(w)
        elif kind in ("done", "error"):
            self.done.add(w)
            error = self._reclaim(w) or error
        self._maybe_close()
        return error

    def gone(self, w: int) -> None:
        """Worker ``w`` exited without a report."""
        self.done.add(w)
        self._reclaim(w)
        self._maybe_close()

    def _reclaim(self, w: int) -> str | None:
        """Items still in a finished worker's inbox (routed as it drained): to another."""
        error = None
        inbox = self.inboxes.get(w)
        while inbox is not None and self.inflight[w] > 0:
            try:
                item = inbox.get(timeout=1.0)
            except queue.Empty:
                return f"worker {w} ended with {self.inflight[w]} hand-off(s) routed to it not taken"
            if item is not None:
                self.inflight[w] -= 1
                error = self._route(item, avoid=w) or error
        return error

    def _route(self, item: tuple[str, bytes], avoid: int) -> str | None:
        targets = [t for t in self.inboxes if t != avoid and t not in self.draining and t not in self.done]
        if not targets or self.closed:
            return f"a request handed off by worker {avoid} has no worker to adopt it"
        target = min(targets, key=lambda t: (self.inflight[t], t))
        self.inboxes[target].put(item)
        self.inflight[target] += 1
        self.idle.discard(target)
        return None

    def _maybe_close(self) -> None:
        if self.closed:
            return
        settled = all(w in self.done or w in self.idle for w in range(len(self.roles)))
        if settled and not any(self.inflight.values()):
            self.closed = True
            for q in self.inboxes.values():
                q.put(None)
