"""Requests moving between engine processes with their K/V in place (kvmem's hand-offs).

A :class:`Moves` is one loop's part in it (:class:`~.loop.Loop` calls it):

* a *prefill* worker (``give_after_first``) hands each request off once it has sampled
  its first token: the next Step carries a hand-off item for its slot, with the
  request's token state (:func:`pack`), and ``on_given`` gets the ticket and the state
  to pass on;
* a worker that adopts (``inbox``) takes tickets and states from its inbox and adopts
  them in its next Step, with the alloc of their next tokens in the same Step: the
  adopted request decodes (or goes on with its prompt) from the length it was handed
  off at, its prompt not computed again;
* a worker told to drain (``draining``) hands off every running request in its next
  Step, and passes its waiting prompts on as they are (no ticket: not computed yet).

The state is the request as the loop knows it: its index, prompt length, tokens known
and computed, cached pages, figures, and when its first token came (monotonic seconds:
one clock for the processes of a host), so the adopter's completion is the whole
request's.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .loop import Request

__all__ = ["Moves", "pack", "unpack"]

_FIELDS = ("index", "prompt_len", "known", "computed", "cached_pages", "preemptions", "matched_total",
           "computed_total", "iterations", "moves")  # fmt: skip
_HEAD = len(_FIELDS) * 8 + 8  # int64 fields, then the first token's time (float64)

Inbox = Callable[[int, bool], list[tuple[str, bytes]]]  # (at most n, may wait) -> (ticket or "", state)
Given = Callable[[list[tuple[str, bytes]]], None]


def pack(r: Request) -> bytes:
    """``r``'s token state, for the process that takes it over."""
    head = np.array([getattr(r, f) for f in _FIELDS], dtype="<i8").tobytes()
    return head + np.array([r.first_at], dtype="<f8").tobytes() + r.tokens[: r.known].astype("<i4").tobytes()


def unpack(state: bytes, max_new_tokens: int) -> Request:
    """The request a :func:`pack` state describes (its slot: the ticket's)."""
    head = np.frombuffer(state[: len(_FIELDS) * 8], dtype="<i8").tolist()
    values = dict(zip(_FIELDS, head, strict=True))
    tokens = np.frombuffer(state[_HEAD:], dtype="<i4").astype(np.int32)
    r = Request(values["index"], tokens[: values["prompt_len"]], max_new_tokens)
    r.tokens[: tokens.size] = tokens
    for name, value in values.items():
        setattr(r, name, value)
    r.first_at = float(np.frombuffer(state[len(_FIELDS) * 8 : _HEAD], dtype="<f8")[0])
    r.alloced = r.computed
    return r


class Moves:
    """One loop's hand-offs and adoptions (see the module's docstring). ``more``: whether
    the inbox may still bring requests (the loop is not done while it may)."""

    def __init__(
        self,
        *,
        give_after_first: bool = False,
        inbox: Inbox | None = None,
        on_given: Given | None = None,
        more: Callable[[], bool] | None = None,
        max_new_tokens: int = 0,
        on_adopted: Callable[[list[str], int], None] | None = None,
    ) -> None:
        self.give_after_first = give_after_first
        self.inbox = inbox
        self.on_given = on_given
        self.on_adopted = on_adopted  # after the Step that adopted them: (tickets, items taken)
        self._taken: tuple[list[str], int] = ([], 0)
        self.more = more
        self.max_new_tokens = max_new_tokens
        self.draining = False
        self.giving: list[Request] = []
        self._states: list[bytes] = []
        self.num_given = self.num_adopted = 0

    def expecting(self) -> bool:
        return bool(self.giving) or (self.more is not None and self.more())

    def drain(self, running: list[Request], waiting: list[Request]) -> None:
        """Give every running request (next Step) and pass the waiting prompts on now."""
        self.giving.extend(running)
        running.clear()
        if waiting and self.on_given is not None:
            self.on_given([("", pack(r)) for r in waiting])
        waiting.clear()

    def take(self, free: int, idle: bool) -> tuple[list[Request], list[Request]]:
        """From the inbox, up to ``free`` requests: (to adopt, their tickets set as their
        ``rid``'s slot; prompts to compute). ``idle``: the loop has nothing else to do, so
        the inbox may wait a moment."""
        if self.inbox is None or free <= 0:
            return [], []
        adopted, prompts = [], []
        for ticket, state in self.inbox(free, idle):
            r = unpack(state, self.max_new_tokens)
            if ticket:
                r.slot = int(ticket.partition(".")[0])
                r.ticket = ticket
                adopted.append(r)
            else:
                r.computed = r.alloced = r.cached_pages = 0
                prompts.append(r)
        self.num_adopted += len(adopted)
        tickets, count = self._taken  # accumulated until a Step goes (prompts alone may wait for a slot)
        self._taken = (tickets + [r.ticket for r in adopted], count + len(adopted) + len(prompts))
        return adopted, prompts

    def plan_giving(self) -> tuple[list[int], list[bytes], list[tuple[int, int]]]:
        """This Step's hand-off items (slots, states) and the truncates they need first
        (rejected drafts' K/V)."""
        truncates = [(r.slot, r.truncate_to) for r in self.giving if r.truncate_to >= 0]
        for r in self.giving:
            if r.truncate_to >= 0:
                r.alloced, r.computed, r.truncate_to = r.truncate_to, min(r.computed, r.truncate_to), -1
        for r in self.giving:
            r.moves += 1  # handed off with its K/V (a prompt passed on as it is moves nothing)
        self._states = [pack(r) for r in self.giving]
        return [r.slot for r in self.giving], self._states, truncates

    def stepped(self, tickets: list[str]) -> None:
        """The Step went through: it handed the planned requests off under ``tickets``
        and adopted what :meth:`take` took."""
        taken, self._taken = self._taken, ([], 0)
        if taken[1] and self.on_adopted is not None:
            self.on_adopted(*taken)
        if self.giving:
            if self.on_given is not None:
                self.on_given(list(zip(tickets, self._states, strict=True)))
            self.num_given += len(self.giving)
            self.giving, self._states = [], []
