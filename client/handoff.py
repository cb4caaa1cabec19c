"""Handing a running request to another session of the same server, written once for
both clients: the Step's hand-off and adopt columns, what their answers say, and the
client's side of the fence.

A hand-off moves a request's slot, row, pages and length to a ticket with nothing
copied; another session (another scheduler process, same cache namespace) adopts the
ticket and goes on from the same K/V (docs/DESIGN.md, "Hand-offs"). After a hand-off
this process still maps the pages (one trust domain): the server refuses every item
that names the slot, and the client refuses them before they are sent, naming the
ticket (:meth:`Handoffs.fence`), until an Open or an adoption gives this session the
slot again. The scheduler must drop the request's ``kv_loc`` and never write through a
block-table row it read before the hand-off: the adopter writes there now.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import grpc
import numpy as np
import torch

from kvmem.v1 import kvmem_pb2

from .errors import NotFound, Reason
from .step import IntsLike, StepResult, as_ints

AdoptItems = Sequence[tuple[str, str]]  # (ticket, request_id) per adopt item

_SLOT_NOT_FOUND: Reason = Reason["SLOT_NOT_FOUND"]


def shown(ticket: str) -> str:
    """A ticket as a message names it: its slot and first digits, never the whole secret."""
    head, _, secret = ticket.partition(".")
    return f"{head}.{secret[:4]}…"


def ticket_slot(ticket: str) -> int:
    """The request slot a ticket holds (its number before the dot): what an alloc item
    of the adopting Step names. ValueError for a string that is no ticket."""
    head, dot, secret = ticket.partition(".")
    if not dot or not head.isdigit() or not secret:
        raise ValueError(f"{ticket[:16]!r} is not a hand-off ticket ('<slot>.<hex>')")
    return int(head)


class Handoffs:
    """The hand-off half of a session (mixed into :class:`kvmem.client.session.Session`):
    the slots this session handed off, by slot, with their tickets."""

    handed_off: dict[int, str]

    def _init_handoffs(self) -> None:
        self.handed_off = {}

    def handoff_columns(
        self,
        columns: dict[str, Any],
        handoff: IntsLike | None,
        handoff_states: Sequence[bytes] | None,
        adopt: AdoptItems | None,
    ) -> list[int]:
        """The Step's hand-off and adopt columns into ``columns``; returns the slots
        handed off (for :meth:`stepped`)."""
        slots: list[int] = []
        if handoff is not None:
            slots = [int(s) for s in as_ints(handoff)]
            columns["handoff_slots"] = slots
            if handoff_states is not None:
                if len(handoff_states) != len(slots):
                    raise ValueError(f"{len(slots)} hand-off slots but {len(handoff_states)} states")
                columns["handoff_states"] = [bytes(s) for s in handoff_states]
        elif handoff_states is not None:
            raise ValueError("handoff_states without handoff slots")
        if adopt:
            columns["adopt_tickets"] = [str(t) for t, _ in adopt]
            columns["adopt_request_ids"] = [str(r) for _, r in adopt]
        return slots

    def fence(self, *columns: Iterable[int] | None) -> None:
        """Refuse, before sending, a Step item that names a slot this session handed off.
        O(items) in numpy (one membership test per column), never a Python loop over them."""
        gone = self.handed_off
        fenced = np.fromiter(gone, dtype=np.int64, count=len(gone))
        for column in columns:
            if column is None:
                continue
            values = column.cpu().numpy() if isinstance(column, torch.Tensor) else np.asarray(column)
            hit = np.flatnonzero(np.isin(values.reshape(-1), fenced)) if values.size else values
            if hit.size:
                slot = int(values.reshape(-1)[hit[0]])
                raise NotFound(
                    grpc.StatusCode.NOT_FOUND,
                    _SLOT_NOT_FOUND,
                    f"request slot {slot} was handed off by this session (ticket {shown(gone[slot])}): it is no "
                    "longer this session's; drop its kv_loc and do not write its pages",
                    {"slot": str(slot)},
                )

    def reclaimed(self, slots: Iterable[int]) -> None:
        """The server gave this session ``slots`` (an Open or an adoption): no longer fenced."""
        if self.handed_off:
            for slot in slots:
                self.handed_off.pop(int(slot), None)

    def stepped(self, slots: list[int], resp: kvmem_pb2.StepResponse) -> StepResult:
        """A Step's answer, read: the slots it handed off are fenced from now on, the
        ones it adopted are this session's."""
        self.handed_off.update(zip(slots, resp.handoff_tickets, strict=True))
        if resp.adopt_slots:
            self.reclaimed(np.frombuffer(resp.adopt_slots, dtype="<i4").tolist())
        return StepResult(resp)

    def opened(self, resp: kvmem_pb2.OpenResponse) -> torch.Tensor:
        """An Open's answer: its slots (int32), each this session's now."""
        self.reclaimed(resp.slots)
        return torch.tensor(list(resp.slots), dtype=torch.int32)
