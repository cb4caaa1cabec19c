"""Hand-off tickets: a running request moves from one owner to another, nothing copied.

A hand-off item (``handoff_slots``) of owner A's Step takes a request out of A: its
slot, row, pages and length stay exactly as they are, but the slot's owner becomes the
core's *ticket holder* (an owner that no session is), under a ticket
``"<slot>.<32 hex digits>"``: 128 random bits, returned in the Step's result. A can no
longer name the slot (SLOT_NOT_FOUND, as for a closed one). An adopt item of owner B's
Step names a ticket and a request id: the slot becomes B's under that id, with the same
row and length, and an alloc item of the same Step may name it (the slot is the
ticket's number before the dot). No page is copied and no reference count changes: the
pages were held by one row and still are.

Rules, each checked before the Step changes anything (``KVCore.step``):

* a hand-off slot is A's, open and listed once, not released in the Step and not named
  by its cache, match or alloc items (it leaves before them; a truncate may shorten it
  first); a hand-off may carry an opaque ``state`` (the scheduler's token state, at most
  :data:`MAX_STATE_BYTES`), given back to the adopter;
* a ticket is known and listed once (single-use: an adopted, expired or released ticket
  is known no more, a forged one never was: TICKET_NOT_FOUND); its namespace is B's
  (another namespace is another model's KV: NAMESPACE_MISMATCH names both); its request
  id is new to B and listed once; the pages adopted count against B's quota as if held
  after the Step's releases, truncates and hand-offs (QUOTA_EXCEEDED).

The holder is an ordinary owner to the request table and the audit (its slots are open
requests, its pages used pages), so every invariant holds as it did. This module keeps
the tickets (ticket -> slot, giver, namespace, state), equal to the holder's request map
(:meth:`Tickets.problems`, which the audit reports). Tickets live in this process only: a
state image keeps the holder's slots but no ticket, and adopting the image closes them
(:mod:`.adopt`).

A ticket ends one of three ways: adopted; released (:meth:`Tickets.release`: the sessions
layer's window, ``kvmem serve --handoff-ms``, passed); or with its giver
(:meth:`Tickets.of_giver`: a session that ends releases its tickets as it releases its
requests, into its quarantine when it has one).
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable, Iterable

import numpy as np

from kvmem.server.core.batch import StepBatch, raise_first, too_many
from kvmem.server.core.image import CoreImage
from kvmem.server.core.owner import Owner
from kvmem.server.core.slot_errors import check_id_length
from kvmem.server.core.slots import RequestTable
from kvmem.server.errors import KVMemError, Reason

__all__ = ["HOLDER_NAME", "MAX_STATE_BYTES", "Ticket", "Tickets", "ticket_slot"]

HOLDER_NAME = "(hand-off tickets)"  # the holder's name in the state image (it has no session id)
MAX_STATE_BYTES = 256 * 1024  # the longest state a hand-off carries (a documented limit)


@dataclasses.dataclass(frozen=True, slots=True)
class Ticket:
    slot: int
    giver: int  # the owner that handed the request off
    namespace: str
    state: bytes


def ticket_slot(ticket: str) -> int:
    """The slot a ticket names (its number before the dot); 0 for a string that is no ticket."""
    head, dot, _ = ticket.partition(".")
    return int(head) if dot and head.isdigit() and len(head) <= 9 else 0


def _shown(ticket: object) -> str:
    """A ticket as an error names it: its slot and the first secret digits, never all of it."""
    text = str(ticket)
    return repr(text[: text.find(".") + 5] + "…") if "." in text and len(text) > 12 else repr(text[:16])


def _named_too(hs: np.ndarray, name: str) -> Callable[[int], KVMemError]:
    def error(i: int) -> KVMemError:
        return KVMemError(
            Reason.BAD_VALUE,
            f"handoff_slots[{i}]: request slot {int(hs[i])} is also named by {name}; a request handed off leaves "
            "the session before the Step's cache, match and alloc items",
            index=i,
            slot=int(hs[i]),
        )

    return error


class Tickets:
    """The open hand-off tickets of one core, and their holder (made at the first hand-off)."""

    def __init__(self, requests: RequestTable, image: CoreImage | None) -> None:
        self._requests, self._image = requests, image
        self.holder: Owner | None = None
        self.by_ticket: dict[str, Ticket] = {}
        # since start: tickets issued, adopted, released (their window passed) and ended with their givers
        self.num_handed_off = self.num_adopted = self.num_expired = self.num_given_up = 0

    @property
    def holder_index(self) -> int:
        return 0 if self.holder is None else self.holder.index

    def _holder(self) -> Owner:
        """The holder, made at the first hand-off, once the Step is checked (it is an
        owner: with a state image it takes an owner record, which no undo record lists:
        a crash that cuts the Step leaves an empty holder, which adoption forgets)."""
        if self.holder is None:
            self.holder = self._requests.owner(self._requests.add_owner(""))
            if self._image is not None:
                self._image.write_session(self.holder.record, "", HOLDER_NAME, None)
        return self.holder

    def slots_of(self, tickets: Iterable[str]) -> np.ndarray:
        """The slots of the known ones of ``tickets`` (int64)."""
        found = [t.slot for t in map(self.by_ticket.get, tickets) if t is not None]
        return np.array(found, dtype=np.int64)

    def of_giver(self, giver: int) -> list[str]:
        """The open tickets ``giver`` handed off. O(tickets)."""
        return [k for k, t in self.by_ticket.items() if t.giver == giver]

    # ------------------------------------------------------------ validation

    def check_handoffs(self, state: Owner, batch: StepBatch) -> None:
        """The hand-off items: see the module's rules. Called once the Step's other
        slot columns are checked (so every slot is in range). O(n)."""
        requests, hs = self._requests, batch.handoff_slots
        requests.check(state, hs, "handoff_slots", batch.release_slots)
        scratch = requests.scratch
        for name, other in (
            ("cache_slots", batch.cache_slots),
            ("match_slots", batch.match_slots),
            ("alloc_slots", batch.alloc_slots),
        ):
            if other.size:
                scratch[hs] = 0
                scratch[other] = 1
                raise_first(scratch[hs] == 1, _named_too(hs, name))
        states = batch.handoff_states
        if states and len(states) != hs.size:
            raise KVMemError(
                Reason.LENGTH_MISMATCH, f"handoff_slots has {hs.size} items but handoff_states has {len(states)}"
            )
        for i, data in enumerate(states):
            if not isinstance(data, bytes) or len(data) > MAX_STATE_BYTES:
                size = len(data) if isinstance(data, bytes) else type(data).__name__
                raise KVMemError(
                    Reason.BAD_VALUE,
                    f"handoff_states[{i}] must be bytes of at most {MAX_STATE_BYTES}, got {size}",
                    index=i,
                )

    def check_adopts(self, state: Owner, batch: StepBatch, max_items: int) -> tuple[np.ndarray, list[Ticket]]:
        """The adopt items' tickets and request ids (the quota is :meth:`check_quota`'s);
        returns their slots (int64) and tickets. O(n)."""
        tickets, ids = batch.adopt_tickets, batch.adopt_request_ids
        if len(tickets) != len(ids):
            raise KVMemError(
                Reason.LENGTH_MISMATCH, f"adopt_tickets has {len(tickets)} items but adopt_request_ids has {len(ids)}"
            )
        if len(tickets) > max_items:
            raise too_many("adopt_tickets", len(tickets), max_items, "Step column", column="adopt_tickets")
        found: list[Ticket] = []
        first_ticket: dict[str, int] = {}
        first_id: dict[str, int] = {}
        for i, (key, rid) in enumerate(zip(tickets, ids, strict=True)):
            ticket = self.by_ticket.get(key) if isinstance(key, str) else None
            if ticket is None:
                raise KVMemError(
                    Reason.TICKET_NOT_FOUND,
                    f"adopt_tickets[{i}]: no open hand-off ticket {_shown(key)}: never issued, already adopted, "
                    "released when its window passed or its giver's session ended, or of an earlier server run "
                    "(tickets are not kept across a restart)",
                    index=i,
                )
            if key in first_ticket:
                raise KVMemError(
                    Reason.BAD_VALUE,
                    f"adopt_tickets[{i}] repeats adopt_tickets[{first_ticket[key]}]: a ticket is adopted once",
                    index=i,
                )
            first_ticket[key] = i
            if ticket.namespace != state.namespace:
                raise KVMemError(
                    Reason.NAMESPACE_MISMATCH,
                    f"adopt_tickets[{i}]: the request was handed off in cache namespace {ticket.namespace!r}, this "
                    f"session is in {state.namespace!r}; another namespace is another model's KV",
                    index=i,
                    ticket_namespace=ticket.namespace,
                    session_namespace=state.namespace,
                )
            if not isinstance(rid, str) or not rid:
                raise KVMemError(
                    Reason.BAD_VALUE, f"adopt_request_ids[{i}] must be a non-empty string, got {rid!r}", index=i
                )
            check_id_length(i, rid)
            if rid in state.request_slots:
                raise KVMemError(
                    Reason.BAD_VALUE,
                    f"adopt_request_ids[{i}] = {rid!r} is already open in this session "
                    f"(slot {state.request_slots[rid]}); adopt under a new request id",
                    index=i,
                )
            if rid in first_id:
                raise KVMemError(
                    Reason.BAD_VALUE, f"adopt_request_ids[{i}] repeats adopt_request_ids[{first_id[rid]}]", index=i
                )
            first_id[rid] = i
            found.append(ticket)
        return np.array([t.slot for t in found], dtype=np.int64), found

    def check_quota(self, state: Owner, batch: StepBatch, adopted: np.ndarray, quota: int | None) -> None:
        """QUOTA_EXCEEDED when the pages adopted would take ``state`` past ``quota``,
        counted after the Step's releases, truncates and hand-offs. O(n)."""
        if quota is None or not adopted.size:
            return
        requests = self._requests
        pages = requests.table.num_pages_for
        gain = int(pages(requests.alloced[adopted]).sum())
        rel, tr, hs = batch.release_slots, batch.truncate_slots, batch.handoff_slots
        drop = int(pages(requests.alloced[rel]).sum()) if rel.size else 0
        if tr.size:
            drop += int((pages(requests.alloced[tr]) - pages(batch.truncate_lens)).sum())
        if hs.size:
            lens = requests.alloced.copy()
            lens[tr] = batch.truncate_lens
            drop += int(pages(lens[hs]).sum())
        after = state.num_pages_held - drop + gain
        if after > quota:
            raise KVMemError(
                Reason.QUOTA_EXCEEDED,
                f"adopting {adopted.size} request(s) holding {gain} pages would leave this session holding {after} "
                f"pages, over its quota of {quota}; release or truncate first",
                pages=gain,
                quota=quota,
            )

    # ------------------------------------------------------------------ apply

    def hand_off(self, state: Owner, batch: StepBatch) -> tuple[str, ...]:
        """The checked hand-off items: each slot to the holder under a new ticket."""
        hs, states = batch.handoff_slots, batch.handoff_states
        holder = self._holder()
        slots = hs.tolist()
        keys = [f"{s}.{secrets.token_hex(16)}" for s in slots]
        self._requests.move(state, holder, hs, keys, rename=False)
        for i, (key, slot) in enumerate(zip(keys, slots, strict=True)):
            self.by_ticket[key] = Ticket(slot, state.index, state.namespace, states[i] if states else b"")
        self.num_handed_off += len(keys)
        return tuple(keys)

    def adopt(
        self, state: Owner, batch: StepBatch, slots: np.ndarray, found: list[Ticket]
    ) -> tuple[np.ndarray, np.ndarray, tuple[bytes, ...]]:
        """The checked adopt items: each ticket's slot to ``state`` under its request
        id. Returns the slots and lengths (int32) and the states handed off with them."""
        holder = self.holder
        assert holder is not None  # a known ticket has a holder
        self._requests.move(holder, state, slots, list(batch.adopt_request_ids), rename=True)
        for key in batch.adopt_tickets:
            del self.by_ticket[key]
        self.num_adopted += len(found)
        lens = self._requests.alloced[slots].astype(np.int32)
        return slots.astype(np.int32), lens, tuple(t.state for t in found)

    def release(self, tickets: Iterable[str], hold: list[np.ndarray] | None = None, *, expired: bool = True) -> int:
        """End the open ones of ``tickets`` as a release would end their requests (their
        pages into ``hold``, a quarantine, when given). Returns how many were open."""
        known = [k for k in tickets if k in self.by_ticket]
        if not known:
            return 0
        slots = np.array([self.by_ticket.pop(k).slot for k in known], dtype=np.int64)
        assert self.holder is not None
        self._requests.release(self.holder, slots, hold)
        if expired:
            self.num_expired += len(known)
        else:
            self.num_given_up += len(known)
        return len(known)

    # ------------------------------------------------------------------ audit

    def problems(self) -> list[str]:
        """Where the tickets and the holder's requests disagree (the audit's part). O(tickets)."""
        held = {} if self.holder is None else self.holder.request_slots
        by_slot = {k: t.slot for k, t in self.by_ticket.items()}
        if held == by_slot:
            return []
        mine, theirs = sorted(by_slot.items())[:4], sorted(held.items())[:4]
        return [f"hand-off tickets {mine} differ from the holder's requests {theirs}"]
