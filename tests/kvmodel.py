"""The reference model of the allocation core (``kvmem.server.core``), shared by the
core's property tests (``tests/core/test_core_properties.py``,
``tests/core/test_prefix_properties.py``) and the wire fuzzer (``tests/e2e/test_fuzz.py``).

Deliberately simple: plain lists, sets and dicts, one item and one token at a time (numpy
only to draw the block table it expects). :class:`KVModel` holds what the core holds:

* the open requests by slot, in the order they were opened (owner, request id, length
  in tokens, the page ids of its row) and the free request slots as the core's stack
  (the top, handed out first, is the end; a release pushes its slots in item order,
  a removed owner's in ascending order);
* the owners (namespace, prefix query and hit tokens, evictions), keyed by whatever
  the test names them with;
* each page's reference count (its entries in all rows); the prefix cache, keyed by
  ``(namespace, every token up to the page's end)`` (equal keys, equal chains: what
  the core's hash chain stands for), for every cached page held or not; the evictable
  queue (cached pages nobody holds, oldest first); the free pages; the quarantines.

The rules (docs/DESIGN.md, Operations and The prefix cache; ``server/core/pool.py``): a step is releases
(their token ids cached first), truncates, cache items, match items, allocs. A drop of
references queues the cached pages it leaves unheld in the order they come out of it
(rows one after another, each first column first, a page listed twice by its first
appearance), reversed, so a chain's end is older than its beginning; uncached ones go
free (or into a quarantine). A key the cache has on another page switches the row to
that page. A match attaches the longest cached run, within its max tokens, the context
and the quota. Allocs are admitted greedily in item order (context, quota, pool: free
and evictable pages), ``atomic`` aborts all unless all fit; they take every free page
before they evict, and evict the shortfall from the queue's head.

Hand-offs (``kvmem.server.core.handoff``): a request handed off stays in its slot with
its row and length, owned by :data:`HOLDER` under its ticket (the core's answer names
the ticket; the model keeps ticket -> giver and namespace); an adoption gives it to the
adopter under a new id. A removed owner's tickets are released before its requests (in
the order they were issued), as a ticket whose window passed is.

It predicts everything but the ids of the free pages an alloc takes, which it reads
from the core's answer (:class:`Answer`) and checks: distinct free pages, then exactly
the evicted ones in order. :meth:`KVModel.step_faults` says which refusals a step may
get (any order of checks), :meth:`KVModel.step` applies a valid one, checking every
field of the answer it predicts (AssertionError naming the field).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

Key = tuple[str, tuple[int, ...]]  # a cached page's key: (namespace, its tokens and all before them)
INT32_MAX = 2**31 - 1
MAX_REQUEST_ID_BYTES = 256  # the longest request id, in bytes of UTF-8 (a documented limit)
OK, OUT_OF_PAGES, CONTEXT_TOO_LONG, QUOTA_EXCEEDED, ABORTED = 0, 1, 2, 3, 4  # AllocStatus
HOLDER = "(hand-off tickets)"  # the owner of a request handed off and not yet adopted


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def utf8_len(s: str) -> int:
    return len(s.encode("utf-8", "surrogatepass"))


def chain_keys(namespace: str, tokens: Sequence[int], n: int, page_size: int) -> list[Key]:
    """The keys of the first ``n`` full pages of ``tokens``."""
    return [(namespace, tuple(tokens[: (c + 1) * page_size])) for c in range(n)]


def split(flat: list[int], offsets: list[int], n: int, what: str) -> list[list[int]]:
    """``flat`` cut at ``offsets`` (``n + 1`` of them, from 0 to its end, never falling)."""
    assert len(offsets) == n + 1 and offsets[0] == 0 and offsets[-1] == len(flat), (
        f"{what} offsets {offsets} for {n} items and {len(flat)} values"
    )
    assert all(a <= b for a, b in itertools.pairwise(offsets)), f"{what} offsets {offsets} fall"
    return [flat[a:b] for a, b in itertools.pairwise(offsets)]


@dataclasses.dataclass
class Request:
    owner: Hashable
    rid: str
    length: int = 0  # alloced_len
    pages: list[int] = dataclasses.field(default_factory=list)
    script: list[int] = dataclasses.field(default_factory=list)  # the tests' own (their draws); never read here


@dataclasses.dataclass
class Owner:
    namespace: str = ""
    query_tokens: int = 0  # what its match items asked for
    hit_tokens: int = 0  # what they matched
    evictions: int = 0  # cached pages its allocs evicted


@dataclasses.dataclass
class Step:
    """A step's columns as plain lists (a StepBatch's, a StepRequest's). Token lists:
    None when absent; ``match_max_tokens`` and ``alloc_expected_lens``: [] when absent,
    -1 for "none" in an item."""

    release_slots: list[int] = dataclasses.field(default_factory=list)
    release_tokens: list[list[int]] | None = None
    truncate_slots: list[int] = dataclasses.field(default_factory=list)
    truncate_lens: list[int] = dataclasses.field(default_factory=list)
    cache_slots: list[int] = dataclasses.field(default_factory=list)
    cache_tokens: list[list[int]] | None = None
    match_slots: list[int] = dataclasses.field(default_factory=list)
    match_tokens: list[list[int]] | None = None
    match_max_tokens: list[int] = dataclasses.field(default_factory=list)
    alloc_slots: list[int] = dataclasses.field(default_factory=list)
    alloc_needs: list[int] = dataclasses.field(default_factory=list)
    alloc_expected_lens: list[int] = dataclasses.field(default_factory=list)
    atomic: bool = False

    @classmethod
    def of(
        cls, *, release_slots: Sequence[int] = (), release_tokens: Sequence[Sequence[int]] | None = None,
        truncate_slots: Sequence[int] = (), truncate_lens: Sequence[int] = (),
        cache: Sequence[tuple[int, Sequence[int]]] = (), match: Sequence[tuple[Any, ...]] = (),
        alloc_slots: Sequence[int] = (), alloc_needs: Sequence[int] = (),
        alloc_expected_lens: Sequence[int] | None = None, atomic: bool = False,
    ) -> Step:  # fmt: skip
        """From the keyword arguments :meth:`kvmem.server.core.StepBatch.of` takes."""
        limits = [m[2] if len(m) > 2 else -1 for m in match]
        return cls(
            list(release_slots), None if release_tokens is None else [list(t) for t in release_tokens],
            list(truncate_slots), list(truncate_lens), [c[0] for c in cache],
            [list(c[1]) for c in cache] if cache else None, [m[0] for m in match],
            [list(m[1]) for m in match] if match else None, limits if any(x != -1 for x in limits) else [],
            list(alloc_slots), list(alloc_needs), list(alloc_expected_lens or ()), atomic,
        )  # fmt: skip


@dataclasses.dataclass
class Answer:
    """What the core says a step did, per alloc item and in total."""

    status: list[int]
    kv: list[list[int]]
    pages: list[list[int]]
    released: int
    match_lens: list[int]
    switched: list[int]
    cached: int
    evicted: int
    changed_rows: list[int] | None = None  # None: not reported (the wire has none)

    @classmethod
    def of(cls, res: Any) -> Answer:
        """From a :class:`kvmem.server.core.StepOutcome`."""
        n = len(res.alloc_status)
        return cls(
            res.alloc_status.tolist(), split(res.kv_loc.tolist(), res.kv_loc_offsets.tolist(), n, "kv_loc"),
            split(res.new_pages.tolist(), res.new_page_offsets.tolist(), n, "new_pages"), res.num_pages_released,
            res.match_lens.tolist(), res.cache_switched.tolist(), res.num_pages_cached, res.num_pages_evicted,
            res.changed_rows.tolist(),
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Stored:
    """An expected PagesStored event: a run of pages a step cached, in chain order."""

    keys: list[Key]
    parent: Key | None
    tokens: list[int]
    namespace: str


@dataclasses.dataclass(frozen=True)
class Removed:
    keys: list[Key]  # in eviction order


@dataclasses.dataclass
class Effects:
    """What a step did beyond its answer: its events, in order, and some counts."""

    events: list[Stored | Removed] = dataclasses.field(default_factory=list)
    inserted: int = 0  # pages cached
    release_switched: int = 0  # pages of released rows the cache had (freed, the cache's touched)
    query: int = 0  # tokens its match items asked for
    capped: int = 0  # match items the quota stopped short of a longer run
    evicted: list[int] = dataclasses.field(default_factory=list)


class KVModel:
    """The core's state and rules (see the module's docstring)."""

    def __init__(
        self, num_pages: int, page_size: int, max_requests: int, max_context_len: int, *, prefix_cache: bool = True
    ) -> None:
        self.num_pages, self.page_size = num_pages, page_size
        self.max_requests, self.max_context_len = max_requests, max_context_len
        self.prefix_cache = prefix_cache
        self.requests: dict[int, Request] = {}  # open slot -> request, in the order they were opened
        self.slot_stack = list(range(max_requests, 0, -1))  # free request slots, the top last
        self.owners: dict[Hashable, Owner] = {}
        self.ref: collections.Counter[int] = collections.Counter()  # held pages only
        self.free: set[int] = set(range(1, num_pages))
        self.index: dict[Key, int] = {}  # key -> cached page
        self.key: dict[int, Key] = {}  # cached page -> key
        self.cached_by: dict[int, Hashable] = {}  # cached page -> the owner whose step cached it
        self.lru: list[int] = []  # evictable cached pages, oldest first
        self.quarantined: dict[Hashable, set[int]] = {}
        self.tickets: dict[str, tuple[Hashable, str]] = {}  # open ticket -> (giver, namespace), in issue order
        self.query_tokens = self.hit_tokens = self.evictions = 0

    def restart_counters(self) -> None:
        """A core restored by a new process counts hits, queries and evictions from 0
        (``kvmem.server.core.restore``): so does the model, in total and per owner."""
        self.query_tokens = self.hit_tokens = self.evictions = 0
        for o in self.owners.values():
            o.query_tokens = o.hit_tokens = o.evictions = 0

    # ------------------------------------------------------------------ views

    def requests_of(self, owner: Hashable) -> dict[int, Request]:
        """An owner's open requests by slot, in the order they were opened."""
        return {slot: r for slot, r in self.requests.items() if r.owner == owner}

    def held(self, owner: Hashable) -> int:
        return sum(len(r.pages) for r in self.requests.values() if r.owner == owner)

    def cached_prefix(self, row: list[int]) -> list[int]:
        """The token ids of a row's cached pages (always its first columns)."""
        known: list[int] = []
        for p in row:
            k = self.key.get(p)
            if k is None:
                break
            known = list(k[1])
        return known

    def stats(self) -> dict[str, int]:
        """What the core's stats say, by their names."""
        return {
            "num_pages_total": self.num_pages - 1,
            "num_free_pages": len(self.free),
            "num_cached_pages": len(self.lru),
            "num_used_pages": len(self.ref),
            "num_quarantined_pages": sum(map(len, self.quarantined.values())),
            "num_open_requests": len(self.requests),
            "num_free_request_slots": self.max_requests - len(self.requests),
            "num_cache_entries": len(self.index),
            "num_evictions": self.evictions,
            "prefix_query_tokens": self.query_tokens,
            "prefix_hit_tokens": self.hit_tokens,
            "num_handoff_tickets": len(self.tickets),
            "num_handoff_pages": self.held(HOLDER),
        }

    def usage(self, owner: Hashable) -> tuple[int, int, str, int, int, int]:
        """An owner's requests, pages held, namespace, query and hit tokens, evictions."""
        o = self.owners[owner]
        held = self.requests_of(owner)
        pages = sum(len(r.pages) for r in held.values())
        return len(held), pages, o.namespace, o.query_tokens, o.hit_tokens, o.evictions

    def table(self, shape: tuple[int, ...]) -> np.ndarray:
        """The block table: each open request's row is its pages then zeros."""
        want = np.zeros(shape, dtype=np.int32)
        for slot, r in self.requests.items():
            want[slot, : len(r.pages)] = r.pages
        return want

    def check(self) -> None:
        """The model's own invariants (a broken one is a bug of the model or its test)."""
        ps = self.page_size
        rows = collections.Counter(p for r in self.requests.values() for p in r.pages)
        assert rows == self.ref, f"the model's counts {dict(self.ref)} are not its rows' {dict(rows)}"
        for slot, r in self.requests.items():
            assert len(r.pages) == ceil_div(r.length, ps) and r.length <= self.max_context_len, (slot, r)
            keyed = [self.key.get(p) for p in r.pages]
            ns = self.tickets[r.rid][1] if r.owner == HOLDER else self.owners[r.owner].namespace
            for c, k in enumerate(keyed):  # cached pages: a prefix of the row, one chain in its namespace
                if k is not None:
                    assert all(keyed[:c]) and k[0] == ns and len(k[1]) == (c + 1) * ps, (slot, r, keyed)
                    before = keyed[c - 1] if c else None
                    assert before is None or before[1] == k[1][: c * ps], (slot, keyed)
        assert all(self.index[k] == p for p, k in self.key.items()) and len(self.index) == len(self.key)
        assert len(set(self.lru)) == len(self.lru) and set(self.lru) == self.key.keys() - self.ref.keys()
        held = set().union(*self.quarantined.values())
        parts = [self.ref.keys(), self.free, set(self.lru), held]
        assert sum(map(len, parts)) == self.num_pages - 1 and set().union(*parts) == set(range(1, self.num_pages))
        assert self.free.isdisjoint(self.key) and held.isdisjoint(self.key)
        stack = set(self.slot_stack)
        assert len(stack) == len(self.slot_stack) and stack.isdisjoint(self.requests)
        assert stack | self.requests.keys() == set(range(1, self.max_requests + 1))

    # ----------------------------------------------------------------- owners

    def add_owner(self, owner: Hashable, namespace: str = "") -> None:
        assert owner not in self.owners
        self.owners[owner] = Owner(namespace)

    def remove_owner(self, owner: Hashable, quarantine: bool = False) -> int:
        """Release its requests in ascending slot order (without tokens); with
        ``quarantine`` the pages this leaves unheld and uncached are held for it.
        Returns the number of requests."""
        hold: set[int] | None = set() if quarantine else None
        self.release_tickets([t for t, (giver, _) in self.tickets.items() if giver == owner], hold)
        slots = sorted(self.requests_of(owner))
        self._unref([p for s in slots for p in self._close(s).pages], hold)
        if hold:
            self.quarantined[owner] = hold
        del self.owners[owner]
        return len(slots)

    # -------------------------------------------------------------- hand-offs

    def ticket_slots(self) -> dict[str, int]:
        """Each open ticket's slot."""
        return {r.rid: slot for slot, r in self.requests.items() if r.owner == HOLDER}

    def hand_off(self, owner: Hashable, slots: Sequence[int], tickets: Sequence[str]) -> None:
        """A valid hand-off (the tickets are the core's answer): each slot to the holder."""
        assert len(tickets) == len(slots) == len(set(tickets)) and not set(tickets) & self.tickets.keys()
        for slot, ticket in zip(slots, tickets, strict=True):
            r = self.requests[slot]
            assert r.owner == owner and ticket.split(".")[0] == str(slot), (slot, ticket)
            r.owner, r.rid = HOLDER, ticket
            self.tickets[ticket] = (owner, self.owners[owner].namespace)

    def handoff_faults(self, owner: Hashable, slots: Sequence[int], states: Sequence[bytes]) -> set[str]:
        """The reasons hand-off items (with no other item) may be refused for."""
        if owner not in self.owners:
            return {"UNKNOWN_SESSION"}
        faults = set()
        mine = self.requests_of(owner)
        if len(slots) > self.max_requests:
            faults.add("BAD_VALUE")
        if any(s not in mine for s in slots):
            faults.add("SLOT_NOT_FOUND")
        if len(set(slots)) != len(slots):
            faults.add("DUPLICATE_SLOT")
        if states and len(states) != len(slots):
            faults.add("LENGTH_MISMATCH")
        if any(len(s) > 256 * 1024 for s in states):
            faults.add("BAD_VALUE")
        return faults

    def adopt_faults(self, owner: Hashable, tickets: Sequence[str], rids: Sequence[str], quota: int | None) -> set[str]:
        """The reasons adopt items (with no other item) may be refused for."""
        if owner not in self.owners:
            return {"UNKNOWN_SESSION"}
        faults = set()
        slots = self.ticket_slots()
        have = {r.rid for r in self.requests_of(owner).values()}
        if len(tickets) != len(rids):
            faults.add("LENGTH_MISMATCH")
        if len(tickets) > self.max_requests or len(rids) > self.max_requests:
            faults.add("BAD_VALUE")
        if len(set(tickets)) != len(tickets) or len(set(rids)) != len(rids) or set(rids) & have:
            faults.add("BAD_VALUE")
        if any(not rid or utf8_len(rid) > MAX_REQUEST_ID_BYTES for rid in rids):
            faults.add("BAD_VALUE")
        if any(t not in slots for t in tickets):
            faults.add("TICKET_NOT_FOUND")
        if any(t in slots and self.tickets[t][1] != self.owners[owner].namespace for t in tickets):
            faults.add("NAMESPACE_MISMATCH")
        if not faults and quota is not None:
            gain = sum(len(self.requests[slots[t]].pages) for t in set(tickets))
            if self.held(owner) + gain > quota:
                faults.add("QUOTA_EXCEEDED")
        return faults

    def adopt(self, owner: Hashable, tickets: Sequence[str], rids: Sequence[str]) -> list[tuple[int, int]]:
        """Valid adopt items: each ticket's request to ``owner`` under its id. Returns
        each one's (slot, length)."""
        slots = self.ticket_slots()
        out = []
        for ticket, rid in zip(tickets, rids, strict=True):
            r = self.requests[slots[ticket]]
            r.owner, r.rid = owner, rid
            del self.tickets[ticket]
            out.append((slots[ticket], r.length))
        return out

    def release_tickets(self, tickets: Sequence[str], hold: set[int] | None = None) -> int:
        """Release the open ones of ``tickets`` as one release of their slots, in order."""
        slots = self.ticket_slots()
        known = [t for t in tickets if t in self.tickets]
        pages = []
        for t in known:
            pages += self._close(slots[t]).pages
            del self.tickets[t]
        self._unref(pages, hold)
        return len(known)

    def release_quarantine(self, owner: Hashable) -> int:
        pages = self.quarantined.pop(owner, set())
        self.free.update(pages)
        return len(pages)

    # ------------------------------------------------------------------- open

    def open_faults(self, owner: Hashable, rids: Sequence[str]) -> set[str]:
        """The reasons an Open may be refused for (empty: it is valid)."""
        reasons = set()
        if owner not in self.owners:
            reasons.add("UNKNOWN_SESSION")
        elif len(self._new_ids(owner, rids)) > len(self.slot_stack):
            reasons.add("NO_FREE_REQUEST_SLOT")
        if len(rids) > self.max_requests or any(not rid or utf8_len(rid) > MAX_REQUEST_ID_BYTES for rid in rids):
            reasons.add("BAD_VALUE")
        return reasons

    def open(self, owner: Hashable, rids: Sequence[str]) -> list[int]:
        """A valid Open: an id the owner has keeps its slot; new ones, in order, take
        the free slots from the top of the stack. Returns the slots."""
        assert not self.open_faults(owner, rids), self.open_faults(owner, rids)
        have = {r.rid: slot for slot, r in self.requests_of(owner).items()}
        for rid in self._new_ids(owner, rids):
            have[rid] = slot = self.slot_stack.pop()
            self.requests[slot] = Request(owner, rid)
        return [have[rid] for rid in rids]

    def _new_ids(self, owner: Hashable, rids: Sequence[str]) -> list[str]:
        have = {r.rid for r in self.requests_of(owner).values()}
        return list(dict.fromkeys(rid for rid in rids if rid not in have))

    def _close(self, slot: int) -> Request:
        self.slot_stack.append(slot)
        return self.requests.pop(slot)

    # ------------------------------------------------------------------- step

    def step_faults(self, owner: Hashable, it: Step) -> set[str]:
        """The reasons each item of a step could be refused for, in any order of checks
        (empty: it is valid)."""
        if owner not in self.owners:
            return {"UNKNOWN_SESSION"}
        ps, reasons = self.page_size, set()
        mine = self.requests_of(owner)
        rel, tr, tl, al, an = it.release_slots, it.truncate_slots, it.truncate_lens, it.alloc_slots, it.alloc_needs
        ae, cs, ms, limits = it.alloc_expected_lens, it.cache_slots, it.match_slots, it.match_max_tokens
        if max(len(rel), len(tr), len(tl), len(al), len(an), len(ae), len(cs), len(ms)) > self.max_requests:
            reasons.add("BAD_VALUE")
        if len(tr) != len(tl) or len(al) != len(an) or (ae and len(ae) != len(al)):
            reasons.add("LENGTH_MISMATCH")
        for column, lists in ((rel, it.release_tokens), (cs, it.cache_tokens), (ms, it.match_tokens)):
            if (lists is None and column and column is not rel) or (lists is not None and len(lists) != len(column)):
                reasons.add("LENGTH_MISMATCH")  # not one token list per item
        if limits and len(limits) != len(ms):
            reasons.add("LENGTH_MISMATCH")

        def slots(column: list[int], released: Sequence[int]) -> None:
            seen = set()
            for x in column:
                if x not in mine or x in released:
                    reasons.add("SLOT_NOT_FOUND")
                if x in mine and x in seen:
                    reasons.add("DUPLICATE_SLOT")
                seen.add(x)

        slots(rel, [])
        slots(tr, rel)
        for x, n in zip(tr, tl, strict=False):
            if n < 0:
                reasons.add("BAD_VALUE")
            elif x in mine and n > mine[x].length:
                reasons.add("TRUNCATE_BEYOND_ALLOCED")
        slots(ms, rel)
        slots(al, rel)
        if any(n < 0 or n > INT32_MAX for n in an):
            reasons.add("BAD_VALUE")
        after = {x: r.length for x, r in mine.items()}
        after.update(zip(tr, tl, strict=False))  # a truncated slot's length in this step (the last item wins)
        for x, e in zip(al, ae, strict=False):
            if e < -1 or (e != -1 and x in ms):  # a matched alloc's length is the match's to decide
                reasons.add("BAD_VALUE")
            elif e != -1 and x in mine and e != after[x]:
                reasons.add("ALLOCED_LEN_MISMATCH")
        # The prefix cache's checks.
        slots(cs, rel)
        if any(x in mine and after[x] != 0 for x in ms):
            reasons.add("ALLOCED_LEN_MISMATCH")  # a match needs a fresh request
        if any(v < -1 for v in limits):
            reasons.add("BAD_VALUE")
        for x, n in zip(tr, tl, strict=False):  # into the middle of a cached page
            if x in mine and 0 <= n < mine[x].length and n % ps and mine[x].pages[n // ps] in self.key:
                reasons.add("PAGE_SHARED")
        ns = self.owners[owner].namespace
        for column, lists in ((rel, it.release_tokens), (cs, it.cache_tokens)):
            for x, tokens in zip(column, lists or [], strict=False):
                if x not in mine:
                    continue
                if len(tokens) > (mine[x].length if column is rel else after[x]):
                    reasons.add("ALLOCED_LEN_MISMATCH")
                    continue
                row = mine[x].pages
                for c, k in enumerate(chain_keys(ns, tokens, len(tokens) // ps, ps)):
                    if c < len(row) and row[c] in self.key and self.key[row[c]] != k:
                        reasons.add("BAD_VALUE")  # the tokens differ from those its page is cached with
                        break
        return reasons

    def step(self, owner: Hashable, it: Step, quota: int | None, answer: Answer) -> Effects:
        """A valid step of ``owner`` under ``quota`` (None: none), which the core
        answered with ``answer``: check every field the model predicts, take the new
        pages from it, and return what else the step did."""
        faults = self.step_faults(owner, it)
        assert not faults, f"the model was given a step it finds invalid ({sorted(faults)}): {it}"
        ps, o, fx = self.page_size, self.owners[owner], Effects()
        for x, tokens in zip(it.release_slots, it.release_tokens or [], strict=False):  # None: no tokens
            fx.release_switched += self._insert(owner, self.requests[x].pages, tokens, fx)
        dropped = [p for x in it.release_slots for p in self._close(x).pages]
        self._unref(dropped)
        cut: list[int] = []  # one drop of every truncate item's tail
        for x, n in zip(it.truncate_slots, it.truncate_lens, strict=True):
            r, keep = self.requests[x], ceil_div(n, ps)
            cut += r.pages[keep:]
            r.pages, r.length = r.pages[:keep], n
        self._unref(cut)
        cache = zip(it.cache_slots, it.cache_tokens or [], strict=True)
        switched = [self._insert(owner, self.requests[x].pages, tokens, fx) for x, tokens in cache]
        changed = [x for x, n in zip(it.cache_slots, switched, strict=True) if n]
        quota_left = None if quota is None else quota - self.held(owner)
        match_lens = []
        for i, (x, tokens) in enumerate(zip(it.match_slots, it.match_tokens or [], strict=True)):
            limit = len(tokens)
            if it.match_max_tokens and it.match_max_tokens[i] >= 0:
                limit = min(limit, it.match_max_tokens[i])
            fx.query += limit
            most = min(limit // ps, self.max_context_len // ps)
            k = most if quota_left is None else min(most, max(quota_left, 0))
            run: list[int] = []
            for key in chain_keys(o.namespace, tokens, most, ps):
                page = self.index.get(key)
                if page is None:
                    break
                if len(run) == k:  # the quota stops a longer match
                    fx.capped += 1
                    break
                run.append(page)
            self._share(run)
            self.requests[x].pages, self.requests[x].length = run, len(run) * ps
            match_lens.append(len(run) * ps)
            if quota_left is not None:
                quota_left -= len(run)
        changed += [x for x, n in zip(it.match_slots, match_lens, strict=True) if n]
        o.query_tokens += fx.query
        o.hit_tokens += sum(match_lens)
        self.query_tokens += fx.query
        self.hit_tokens += sum(match_lens)
        # Allocs: a matched slot's alloc asks for the request's whole length; it gets what the match did not cover.
        matched = dict(zip(it.match_slots, match_lens, strict=True))
        needs = [
            max(n - matched[x], 0) if x in matched else n for x, n in zip(it.alloc_slots, it.alloc_needs, strict=True)
        ]
        status, total = self._admit(owner, it.alloc_slots, needs, quota, it.atomic)
        free_before = set(self.free)
        short = max(total - len(self.free), 0)
        fx.evicted, self.lru = self.lru[:short], self.lru[short:]
        if short:
            fx.events.append(Removed([self._uncache(p) for p in fx.evicted]))
            self.free.update(fx.evicted)
            o.evictions += short
            self.evictions += short
        got = (answer.status, answer.released, answer.match_lens, answer.switched, answer.cached, answer.evicted)
        want = (status, len(dropped) + len(cut), match_lens, switched, fx.inserted, short)
        assert got == want, (
            f"(alloc status, pages released, match_lens, cache_switched, pages cached, pages evicted) = {got}, "
            f"the model {want}"
        )
        assert answer.changed_rows in (None, changed), f"changed_rows {answer.changed_rows}, the model {changed}"
        self._take(it.alloc_slots, needs, status, answer, free_before, fx.evicted)
        return fx

    def _admit(
        self, owner: Hashable, slots: list[int], needs: list[int], quota: int | None, atomic: bool
    ) -> tuple[list[int], int]:
        """Each alloc item's status (greedy, in item order, then ``atomic``) and the pages the OK ones take."""
        quota_left = None if quota is None else quota - self.held(owner)
        pool_left = len(self.free) + len(self.lru)
        status, total = [], 0
        for x, need in zip(slots, needs, strict=True):
            cur = self.requests[x].length
            n = ceil_div(cur + need, self.page_size) - ceil_div(cur, self.page_size)
            if cur + need > self.max_context_len:
                status.append(CONTEXT_TOO_LONG)
            elif quota_left is not None and n > quota_left:
                status.append(QUOTA_EXCEEDED)
            elif n > pool_left:
                status.append(OUT_OF_PAGES)
            else:
                status.append(OK)
                pool_left -= n
                total += n
                if quota_left is not None:
                    quota_left -= n
        if atomic and any(s != OK for s in status):
            return [ABORTED if s == OK else s for s in status], 0
        return status, total

    def _take(
        self, slots: list[int], needs: list[int], status: list[int], answer: Answer, free_before: set[int],
        evicted: list[int],
    ) -> None:  # fmt: skip
        """The allocs' new pages, read from the answer: every free page before any
        evicted one, then exactly the evicted ones in order; and their kv_loc."""
        ps = self.page_size
        flat = [p for pages in answer.pages for p in pages]
        from_free = len(flat) - len(evicted)
        assert from_free >= 0 and flat[from_free:] == evicted, (
            f"new pages {flat}, the model evicts {evicted} (the least recently queued cached pages)"
        )
        taken = set(flat[:from_free])
        assert len(taken) == from_free and taken <= free_before, (
            f"new pages {flat[:from_free]} are not distinct free pages (free: {sorted(free_before)})"
        )
        assert not evicted or taken == free_before, f"evicted {evicted} while {sorted(free_before - taken)} were free"
        self.free.difference_update(flat)
        for i, (x, need) in enumerate(zip(slots, needs, strict=True)):
            kv, pages = answer.kv[i], answer.pages[i]
            if status[i] != OK:
                assert not kv and not pages, f"refused item {i} (slot {x}) got kv_loc {kv} or pages {pages}"
                continue
            r = self.requests[x]
            cur = r.length
            assert len(pages) == ceil_div(cur + need, ps) - len(r.pages), f"item {i} (slot {x}) took pages {pages}"
            r.pages += pages
            self.ref.update(pages)
            r.length = cur + need
            want = [r.pages[t // ps] * ps + t % ps for t in range(cur, cur + need)]
            assert kv == want, f"item {i} (slot {x}) kv_loc {kv[:20]}, the model {want[:20]}"

    # ------------------------------------------------------------ the pages

    def _insert(self, owner: Hashable, row: list[int], tokens: list[int], fx: Effects) -> int:
        """A release or cache item: cache the row's full pages of ``tokens``; where a key
        is cached on another page, switch the row to it (its own copy is dropped).
        Each run of pages cached is one :class:`Stored`. Returns the pages switched."""
        if not self.prefix_cache:
            return 0
        ps, ns = self.page_size, self.owners[owner].namespace
        keys = chain_keys(ns, tokens, len(tokens) // ps, ps)
        new, old, start = [], [], -1
        for c, k in enumerate([*keys, None]):
            have = None if k is None else self.index.get(k)
            if k is not None and have is None:
                assert row[c] not in self.key, f"the model caches page {row[c]} twice"
                self.index[k], self.key[row[c]], self.cached_by[row[c]] = row[c], k, owner
                fx.inserted += 1
                start = c if start < 0 else start
                continue
            if start >= 0:
                parent = keys[start - 1] if start else None
                fx.events.append(Stored(keys[start:c], parent, list(tokens[start * ps : c * ps]), ns))
                start = -1
            if have is not None and have != row[c]:
                new.append(have)
                old.append(row[c])
                row[c] = have
        self._share(new)
        self._unref(old)
        return len(new)

    def _uncache(self, page: int) -> Key:
        k = self.key.pop(page)
        del self.index[k], self.cached_by[page]
        return k

    def _share(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self.ref:
                self.lru.remove(p)
            self.ref[p] += 1

    def _unref(self, pages: list[int], hold: set[int] | None = None) -> None:
        """Drop one reference per entry; the pages reaching 0, in order of first
        appearance: cached ones join the queue's end reversed, the others go free (or
        into ``hold``)."""
        for p in pages:
            assert self.ref[p] > 0, f"the model drops page {p}, which no row holds"
            self.ref[p] -= 1
        zero = [p for p in dict.fromkeys(pages) if self.ref[p] == 0]
        for p in zero:
            del self.ref[p]
        self.lru.extend(reversed([p for p in zero if p in self.key]))
        (self.free if hold is None else hold).update(p for p in zero if p not in self.key)
