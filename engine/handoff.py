"""Requests moving between engine processes with their K/V in place (kvmem's hand-offs):
:class:`Moves`, the hand-off policy one scheduler runs with.

* a *prefill* worker (``give_after_first``) hands each request off once it has sampled
  its first token: the next Step carries a hand-off item for its slot, with the
  request's token state (:func:`~.request.pack`), and ``on_given`` gets each ticket and
  state to pass on;
* a worker that adopts (``inbox``) takes tickets and states from its inbox, and adopts
  them in its next Step with the alloc of their next tokens in the same Step: the
  adopted request decodes (or goes on with its prompt) from the length it was handed
  off at, its prompt not computed again;
* a worker told to drain (``draining``) hands off every running request in its next
  Step, and passes its waiting prompts on as they are (no ticket: not computed yet).

The policy decides and carries messages; it never changes a request: the scheduler
(:class:`~.scheduler.Scheduler`) plans the hand-off and adoption items, and applies
them once the Step went through.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["Inbox", "Moves"]

Inbox = Callable[[int, bool], list[tuple[str, bytes]]]  # (at most n, may wait) -> (ticket or "", state)
Given = Callable[[list[tuple[str, bytes]]], None]


class Moves:
    """One scheduler's hand-offs and adoptions (see the module's docstring). ``more``:
    whether the inbox may still bring requests (the scheduler is not done while it
    may); ``on_adopted``: after the Step that adopted them, the tickets and how many
    inbox items were taken (prompts included)."""

    def __init__(
        self,
        *,
        give_after_first: bool = False,
        inbox: Inbox | None = None,
        on_given: Given | None = None,
        more: Callable[[], bool] | None = None,
        on_adopted: Callable[[list[str], int], None] | None = None,
    ) -> None:
        self.give_after_first = give_after_first
        self.inbox = inbox
        self.on_given = on_given
        self.on_adopted = on_adopted
        self.more = more
        self.draining = False
        self.num_given = self.num_adopted = 0

    def expecting(self) -> bool:
        """Whether the inbox may still bring requests."""
        return self.more is not None and self.more()

    def take(self, free: int, idle: bool) -> list[tuple[str, bytes]]:
        """Up to ``free`` inbox items, ``(ticket, state)`` (ticket "" for a prompt);
        ``idle``: the scheduler has nothing else to do, so the inbox may wait a moment."""
        if self.inbox is None or free <= 0 or self.draining:
            return []
        return self.inbox(free, idle)

    def given(self, items: list[tuple[str, bytes]]) -> None:
        """Requests left under tickets (or prompts passed on, ticket ""): pass them on."""
        self.num_given += sum(1 for ticket, _ in items if ticket)
        if items and self.on_given is not None:
            self.on_given(items)

    def adopted(self, tickets: list[str], taken: int) -> None:
        """A Step adopted ``tickets`` (of ``taken`` inbox items)."""
        self.num_adopted += len(tickets)
        if taken and self.on_adopted is not None:
            self.on_adopted(tickets, taken)
