"""Property tests of the prefix cache: random steps of several owners against the reference model.

The model (``tests/kvmodel.py``, shared with the core's machine and the wire fuzzer)
keeps, per open request, its length and its list of page ids; the cached chains as a
dict ``(namespace, all tokens up to and including the page) -> page``; a reference count
per page; the evictable cached pages in LRU order (oldest first: a holder's pages are
pushed when the last holder lets go, chain end first, so a row's last column is the
oldest of them); the free pages; the quarantines; the prefix counters, in total and per
owner. Each request also carries its *script* here (the tokens it writes: a prefix of
one of a few "system prompts" and a tail from a three-token alphabet, so keys collide
often), drawn when it opens; the tokens written so far are ``script[:length]``.

The model predicts everything but the page ids an alloc takes: match lengths and the
pages a match attaches, the pages a cache item switches a row to, which duplicates a
release frees (a release with tokens switches its row to the cache's equal pages before
it lets go, so those are queued again with the new pages, chain end first), which cached
pages an alloc evicts (the LRU head), what an alloc of a slot matched in the same Step
gets (the length it asks for less what the match covered), and the events of every call
(``PagesStored`` runs with their parent and tokens, ``PagesRemoved`` in eviction order).
The pages of an alloc are read from its result: the free pages, all of them before the
evicted ones, which come last in eviction order. After every rule the core must agree:
block-table rows, lengths, reference counts, the key index (keys recomputed here from the
documented XXH3 recipe), the evictable queue in order, the free stack, per-page cache
metadata, stats, per-owner usage, and the set of keys obtained by replaying every event
the sink received.

Owners (2 or 3, in 1 or 2 namespaces, each with a quota or none) interleave: open,
general steps (releases with or without tokens, truncates incl. to page boundaries and
into the middle of a cached page, which must raise PAGE_SHARED and change nothing, cache
items, match items with and without max tokens, allocs; any combination in one Step,
e.g. release with tokens + match + alloc of the remainder), decode-shaped steps (the
fast path), remove_owner with and without quarantine, release_quarantine, snapshots of
the events, and invalid prefix items (each must raise a reason the model's
``step_faults`` names too, and change nothing). One example in ten runs with the prefix
cache off (nothing is cached, nothing matches).

Not observable here: the context cap on a match (no cached chain is longer than a
request may be). Strength: hypothesis's profile (``tests/conftest.py``): a handful of
examples by default; 500 of 50 steps with ``--hypothesis-profile=thorough`` (``.ci/run``;
about 30 s with CI=true, hypothesis's fixed seeds); ``KVMEM_PREFIX_EXAMPLES=5000`` for a
long run (about 4 minutes), whatever the profile.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import xxhash
from conftest import capped
from core_state import snapshot
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kvmodel import Answer, Effects, KVModel, Removed, Request, Step, Stored

from kvmem.server.core import CoreConfig, KVCore, StepBatch
from kvmem.server.core.events import AllCleared, CacheEvent, PagesRemoved, PagesStored
from kvmem.server.core.image import CoreImage
from kvmem.server.core.restore import layout_for, restore
from kvmem.server.errors import KVMemError, Reason

OWNERS = ("o0", "o1", "o2")
# Namespaces of the owners: at least two owners share one in every layout.
LAYOUTS = (("", ""), ("", "", ""), ("", "", "b"), ("", "b", "b"), ("a", "a", "b"))
# Shared prompt prefixes (the first two agree on 5 tokens) and the alphabet of the rest.
SYSTEM = ((1, 2, 1, 2, 0, 1, 1, 2, 2, 0, 1, 2), (1, 2, 1, 2, 0, 2, 0, 0, 1, 2, 2, 1), (2, 2, 2, 2, 1, 1, 1, 1))
TOKEN = st.integers(0, 2)
# The role of each of an owner's requests in a general step (repeats weigh the draw): a
# fresh one mostly matches and allocs its prompt; a running one decodes, caches, is
# truncated (or truncated to 0 and matched again) or ends, mostly with its tokens.
FRESH_ROLE = st.sampled_from(("match+alloc", "match+alloc", "match+alloc", "match", "alloc", "none"))
RUNNING_ROLE = st.sampled_from(
    (
        "alloc", "alloc", "alloc", "alloc", "release", "release+tokens", "release+tokens", "truncate",
        "truncate+alloc", "cache", "cache+alloc", "cache+alloc", "truncate+cache", "truncate+match+alloc", "none",
    )
)  # fmt: skip
BOOL = st.booleans()
QUOTA = st.one_of(st.none(), st.none(), st.integers(0, 12))
LEN_KIND = st.sampled_from(("all", "all", "pages", "any"))
TRUNC_KIND = st.sampled_from(("boundary", "boundary", "any", "zero", "mid_cached"))
ROOT_TAG = b"kvmem/v1 namespace\0"


def assert_same_snapshot(before: dict, after: dict) -> None:
    for key, value in before.items():
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(after[key], value, err_msg=key)
        else:
            assert after[key] == value, key


def full_snapshot(core: KVCore) -> dict:
    """core_state's snapshot (its stats hold the owners' prefix counters) plus the
    prefix cache: index, evictable queue, counters."""
    snap = snapshot(core)
    cache = core.cache
    snap["index"] = dict(cache.index)
    snap["queued"] = cache.queued().copy()
    snap["cache_counters"] = (cache.num_evictions, cache.num_inserted, cache.query_tokens, cache.hit_tokens)
    return snap


def both(**columns) -> tuple[StepBatch, Step]:
    """A step for the core and the same for the model, from StepBatch.of's arguments."""
    return StepBatch.of(**columns), Step.of(**columns)


@dataclasses.dataclass
class Plan:
    """One general step's items, as drawn."""

    release: list[tuple[int, list[int] | None]] = dataclasses.field(default_factory=list)
    truncate: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    cache: list[tuple[int, list[int]]] = dataclasses.field(default_factory=list)
    match: list[tuple[int, list[int], int]] = dataclasses.field(default_factory=list)

    def columns(self, al: list[int], need: list[int], expected: list[int] | None, atomic: bool) -> dict:
        """The keyword arguments of StepBatch.of (and the model's Step.of)."""
        rel_tokens = None
        if any(t is not None for _, t in self.release):
            rel_tokens = [t or [] for _, t in self.release]
        return dict(
            release_slots=[s for s, _ in self.release],
            release_tokens=rel_tokens,
            truncate_slots=[s for s, _ in self.truncate],
            truncate_lens=[n for _, n in self.truncate],
            cache=self.cache,
            match=self.match,
            alloc_slots=al,
            alloc_needs=need,
            alloc_expected_lens=expected,
            atomic=atomic,
        )


class PrefixMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.core: KVCore | None = None
        self.ticks = 0  # rules run: the rare rules are enabled one tick in a few

    # ------------------------------------------------------------------ setup

    @initialize(
        page_size=st.integers(2, 4),
        num_pages=st.one_of(st.integers(9, 14), st.integers(9, 24), st.integers(9, 41)),
        max_requests=st.integers(3, 8),
        ctx_pages=st.integers(3, 6),
        ctx_extra=st.integers(0, 3),
        layout=st.sampled_from(LAYOUTS),
        quotas=st.lists(QUOTA, min_size=3, max_size=3),
        enabled=st.integers(0, 9).map(bool),  # off one time in ten
    )
    def setup(self, page_size, num_pages, max_requests, ctx_pages, ctx_extra, layout, quotas, enabled) -> None:
        ps = self.ps = page_size
        max_ctx = ctx_pages * ps + min(ctx_extra, ps - 1)
        self.cfg = CoreConfig(num_pages, ps, max_requests, max_ctx)
        self.width = self.cfg.max_pages_per_request
        self.enabled = enabled
        self.sink: list[list[CacheEvent]] = []
        self.image = bytearray(layout_for(self.cfg).size)  # the state image a restart restores
        self.core = KVCore(
            self.cfg, audit_every_step=True, prefix_cache=enabled, event_sink=self.sink.append,
            image=CoreImage.create(self.image, layout_for(self.cfg)),
        )  # fmt: skip
        self.restarts = 0
        self.model = KVModel(num_pages, ps, max_requests, max_ctx, prefix_cache=enabled)  # owners: the core's indices
        self.names = OWNERS[: len(layout)]
        self.ns = dict(zip(self.names, layout, strict=True))
        self.quota = dict(zip(self.names, quotas[: len(layout)], strict=True))
        self.ids = {name: self.core.add_owner(self.ns[name]) for name in self.names}
        for name, index in self.ids.items():
            self.model.add_owner(index, self.ns[name])
        self.gone: list[int] = []
        self.replay: dict[bytes, int] = {}  # keys from the events: key -> depth
        self.next_rid = 0
        self._kb: dict[tuple[str, tuple[int, ...]], bytes] = {}

    @property
    def reqs(self) -> dict[int, Request]:
        return self.model.requests

    # ------------------------------------------------------------------ keys

    def kb(self, ns: str, tokens: tuple[int, ...]) -> bytes:
        """The page key the documented recipe gives: XXH3-128(parent || tokens LE),
        from the namespace's root."""
        got = self._kb.get((ns, tokens))
        if got is None:
            if not tokens:
                got = xxhash.xxh3_128_digest(ROOT_TAG + ns.encode())
            else:
                parent = self.kb(ns, tokens[: -self.ps])
                got = xxhash.xxh3_128_digest(parent + np.asarray(tokens[-self.ps :], dtype="<i4").tobytes())
            self._kb[(ns, tokens)] = got
        return got

    # ------------------------------------------------------------- model views

    def held(self, owner: str) -> int:
        return self.model.held(self.ids[owner])

    def slots_of(self, owner: str) -> list[int]:
        return sorted(self.model.requests_of(self.ids[owner]))

    # ------------------------------------------------------------- events

    def check_events(self, want: list[Stored | Removed]) -> None:
        """The call gave the sink exactly the events the model expects (one list, or
        no call when there are none); replay them."""
        calls, self.sink[:] = list(self.sink), []
        if not want:
            assert calls == [], calls
            return
        assert len(calls) == 1, calls
        (got,) = calls
        assert len(got) == len(want), (got, want)
        for g, w in zip(got, want, strict=True):
            assert self.same_event(g, w), (g, w)
        for e in got:
            self.replay_event(e)

    def same_event(self, got: CacheEvent, want: Stored | Removed) -> bool:
        if isinstance(want, Stored):
            parent = None if want.parent is None else self.kb(*want.parent)
            return (
                isinstance(got, PagesStored)
                and got.keys == [self.kb(*k) for k in want.keys]
                and got.parent_key == parent
                and got.token_ids.dtype == np.int32
                and got.token_ids.tolist() == want.tokens
                and got.page_size == self.ps
                and got.namespace == want.namespace
            )
        return isinstance(got, PagesRemoved) and got.keys == [self.kb(*k) for k in want.keys]

    def replay_event(self, e: CacheEvent) -> None:
        if isinstance(e, PagesStored):
            depth = 0 if e.parent_key is None else self.replay[e.parent_key] + 1
            for k in e.keys:
                assert k not in self.replay, "a key stored twice"
                self.replay[k] = depth
                depth += 1
        elif isinstance(e, PagesRemoved):
            for k in e.keys:
                del self.replay[k]
        else:
            assert isinstance(e, AllCleared)
            self.replay.clear()

    # ---------------------------------------------------------------- draws

    def draw_script(self, data) -> list[int]:
        system = data.draw(st.sampled_from(((), *SYSTEM)), label="system")
        cut = data.draw(st.one_of(st.just(len(system)), st.integers(0, len(system))), label="cut")
        size = self.cfg.max_context_len + 2 - min(cut, self.cfg.max_context_len)
        tail = data.draw(st.lists(TOKEN, min_size=size, max_size=size), label="tail")
        return list(system[:cut]) + tail

    def open_new(self, data, owner: str) -> None:
        if len(self.reqs) >= self.cfg.max_requests:
            return
        self.next_rid += 1
        rid = f"r{self.next_rid}"
        (slot,) = self.core.open(self.ids[owner], [rid]).tolist()
        assert [slot] == self.model.open(self.ids[owner], [rid])
        self.reqs[slot].script = self.draw_script(data)

    def draw_owner(self, data) -> str:
        busy = [name for name in sorted(self.names) if self.slots_of(name)]
        if busy and data.draw(st.integers(0, 3), label="prefer_busy"):
            return data.draw(st.sampled_from(busy), label="busy_owner")
        return data.draw(st.sampled_from(self.names), label="owner")

    def draw_len(self, data, n: int) -> int:
        kind = data.draw(LEN_KIND, label="len_kind")
        if kind == "all":
            return n
        if kind == "pages":
            return n // self.ps * self.ps
        return data.draw(st.integers(0, n), label="len")

    def draw_truncate(self, data, req: Request) -> int:
        ps, n = self.ps, req.length
        kind = data.draw(TRUNC_KIND, label="truncate_kind")
        if kind == "zero":
            return 0
        if kind == "mid_cached":
            cols = [c for c, p in enumerate(req.pages) if p in self.model.key]
            if cols:
                c = data.draw(st.sampled_from(cols), label="cached_col")
                return c * ps + data.draw(st.integers(1, ps - 1), label="into")
            kind = "any"
        if kind == "boundary":
            return data.draw(st.integers(0, n // ps), label="pages") * ps
        return data.draw(st.integers(0, n), label="truncate_len")

    # ------------------------------------------------------------------ rules

    @rule(data=st.data())
    def open_requests(self, data) -> None:
        owner = data.draw(st.sampled_from(self.names), label="owner")
        mine = self.slots_of(owner)
        if mine and data.draw(BOOL, label="reopen"):  # an id it already has keeps its slot
            s = data.draw(st.sampled_from(mine), label="slot")
            rid = self.reqs[s].rid
            assert self.core.open(self.ids[owner], [rid]).tolist() == [s] == self.model.open(self.ids[owner], [rid])
            return
        if len(self.reqs) >= self.cfg.max_requests:
            assert self.model.open_faults(self.ids[owner], ["extra"]) == {"NO_FREE_REQUEST_SLOT"}
            try:
                self.core.open(self.ids[owner], ["extra"])
            except KVMemError as err:
                assert err.reason is Reason.NO_FREE_REQUEST_SLOT
            else:
                raise AssertionError("open beyond the free request slots succeeded")
            return
        self.open_new(data, owner)

    @rule(data=st.data())
    def step(self, data) -> None:
        """A general step of one owner: each of its requests gets a role; releases
        (with or without tokens), truncates, cache items, match items and allocs in
        random orders, all in one Step."""
        owner = self.draw_owner(data)
        for _ in range(data.draw(st.integers(0 if self.slots_of(owner) else 1, 2), label="num_new")):
            self.open_new(data, owner)
        plan = Plan()
        diverge: dict[int, list[int]] = {}  # a new script's tail after a truncate, or a matched one's new script
        after: dict[int, int] = {}  # the lengths after the truncates
        match_alloc: set[int] = set()
        plain_alloc: list[int] = []
        for s in self.slots_of(owner):
            req = self.reqs[s]
            role = data.draw(RUNNING_ROLE if req.length else FRESH_ROLE, label="role")
            if role.startswith("release"):
                toks = req.script[: self.draw_len(data, req.length)] if role.endswith("tokens") else None
                plan.release.append((s, toks))
                continue
            n = req.length
            if "truncate" in role:
                n = 0 if "match" in role else self.draw_truncate(data, req)
                plan.truncate.append((s, n))
                if n < req.length and data.draw(st.integers(0, 2), label="diverge") == 0:
                    size = len(req.script) - n
                    diverge[s] = data.draw(st.lists(TOKEN, min_size=size, max_size=size), label="new_tail")
            after[s] = n
            if "cache" in role:
                script = req.script[:n] + diverge[s] if s in diverge else req.script
                plan.cache.append((s, script[: self.draw_len(data, n)]))
            if "match" in role:
                if data.draw(st.integers(0, 3), label="new_script") == 0:
                    diverge[s] = self.draw_script(data)
                script = diverge.get(s, req.script) if n == 0 else req.script
                most = data.draw(st.sampled_from((self.cfg.max_context_len, len(script))), label="beyond")
                size = data.draw(st.integers(0, most), label="prompt_len")
                cap = data.draw(st.sampled_from(("none", "len-1", "any")), label="max_tokens")
                limit = -1 if cap == "none" else max(size - 1, 0) if cap == "len-1" else None
                if limit is None:
                    limit = data.draw(st.integers(0, size + self.ps), label="limit")
                plan.match.append((s, script[:size], limit))
                if "alloc" in role:
                    match_alloc.add(s)
            elif "alloc" in role:
                plain_alloc.append(s)
        for name in ("release", "truncate", "cache", "match"):
            items = getattr(plan, name)
            if len(items) > 1:
                setattr(plan, name, data.draw(st.permutations(items), label=f"{name}_order"))
        atomic = data.draw(BOOL, label="atomic")

        # A truncate into the middle of a cached page: PAGE_SHARED, nothing changes.
        al = sorted(plain_alloc + list(match_alloc))
        columns = plan.columns(al, [0] * len(al), None, atomic)
        faults = self.model.step_faults(self.ids[owner], Step.of(**columns))
        if faults:
            assert faults == {"PAGE_SHARED"}, faults
            event("PAGE_SHARED")
            self.expect_error(owner, Reason.PAGE_SHARED, *both(**columns))
            return
        self.run_step(data, owner, plan, diverge, after, match_alloc, plain_alloc, atomic)

    # Aliases: most calls are general steps (and each alias is a feature of its own to
    # hypothesis's swarm testing, so few examples run with no step at all).
    @rule(data=st.data())
    def step_again(self, data) -> None:
        self.step(data)

    @rule(data=st.data())
    def step_once_more(self, data) -> None:
        self.step(data)

    @rule(data=st.data())
    def step_yet_again(self, data) -> None:
        self.step(data)

    def run_step(
        self,
        data,
        owner: str,
        plan: Plan,
        diverge: dict[int, list[int]],
        after: dict[int, int],
        match_alloc: set[int],
        plain_alloc: list[int],
        atomic: bool,
    ) -> None:
        """The allocs drawn (order, needs, expected lengths), then the step on the core
        and on the model; the events, the scripts that diverged."""
        # An alloc of a slot matched in this step asks for the request's whole length
        # (its sender cannot know the match): it gets what the match did not cover.
        prompt = {s: len(toks) for s, toks, _ in plan.match}
        al = list(match_alloc) + plain_alloc
        if len(al) > 1:
            al = data.draw(st.permutations(sorted(al)), label="alloc_order")
        need = []
        for s in al:
            matched = s in match_alloc
            if matched and data.draw(st.integers(0, 3), label="need_kind"):
                sent = prompt[s]
            else:
                room = max(self.cfg.max_context_len - (0 if matched else after[s]), 0)
                sent = data.draw(st.one_of(st.integers(0, room), st.integers(0, room + 2)), label="need")
            need.append(sent)
        expected = None
        if al and data.draw(BOOL, label="with_expected"):
            expected = [-1 if s in match_alloc or not data.draw(BOOL, label="expect") else after[s] for s in al]
        columns = plan.columns(al, need, expected, atomic)
        oid = self.ids[owner]
        res = self.core.step(oid, StepBatch.of(**columns), self.quota[owner])
        fx = self.model.step(oid, Step.of(**columns), self.quota[owner], Answer.of(res))
        self.check_events(fx.events)
        self.count(owner, plan, res.match_lens.tolist(), res.cache_switched.tolist(), fx)
        matched = {s for s, _, _ in plan.match}
        for s, tail in diverge.items():
            if s in matched:
                self.reqs[s].script = tail
            elif after.get(s):
                self.reqs[s].script = self.reqs[s].script[: after[s]] + tail

    def count(self, owner: str, plan: Plan, match_lens: list[int], switched: list[int], fx: Effects) -> None:
        """What the step did, for hypothesis's statistics (``--hypothesis-show-statistics``)."""
        ps, ns, model = self.ps, self.ns[owner], self.model
        if fx.release_switched:
            event("release frees duplicates")
        if any(switched):
            event("cache item switches")
        for (s, toks, _), m in zip(plan.match, match_lens, strict=True):
            event("match hit" if m else "match miss")
            if any(model.cached_by[p] != self.ids[owner] for p in self.reqs[s].pages[: m // ps]):
                event("match hit on pages another owner cached")
            nxt = tuple(toks[: m + ps])
            elsewhere = any((o, nxt) in model.index for o in ("", "a", "b") if o != ns)
            if len(nxt) == m + ps and (ns, nxt) not in model.index and elsewhere:
                event("match miss where another namespace has the page")
        if fx.evicted:
            event("alloc evicts")

    def expect_error(self, owner: str | int, reason: Reason, batch: StepBatch, step: Step) -> None:
        """The step raises ``reason``, one the model names too, and changes nothing."""
        core = self.core
        before = full_snapshot(core)
        oid = self.ids[owner] if isinstance(owner, str) else owner
        quota = self.quota[owner] if isinstance(owner, str) else None
        faults = self.model.step_faults(oid, step)
        assert reason.name in faults, (reason, faults)
        try:
            core.step(oid, batch, quota)
        except KVMemError as err:
            assert err.reason is reason, (reason, err.reason, str(err))
        else:
            raise AssertionError(f"an invalid step was accepted (expected {reason.name})")
        assert_same_snapshot(before, full_snapshot(core))
        assert self.sink == []

    @rule(data=st.data())
    def decode(self, data) -> None:
        """Every request of one owner asks for the same few tokens (the fast path)."""
        owner = self.draw_owner(data)
        mine = data.draw(st.permutations(self.slots_of(owner)), label="decode_order")
        k = data.draw(st.integers(1, 2), label="tokens")
        atomic = data.draw(BOOL, label="atomic")
        expected = None
        if data.draw(BOOL, label="with_expected"):
            expected = [self.reqs[s].length if data.draw(BOOL, label="expect") else -1 for s in mine]
        columns = dict(alloc_slots=mine, alloc_needs=[k] * len(mine), alloc_expected_lens=expected, atomic=atomic)
        oid = self.ids[owner]
        res = self.core.step(oid, StepBatch.of(**columns), self.quota[owner])
        fx = self.model.step(oid, Step.of(**columns), self.quota[owner], Answer.of(res))
        if fx.evicted:
            event("alloc evicts")
        self.check_events(fx.events)

    @rule(data=st.data())
    def decode_again(self, data) -> None:
        self.decode(data)

    @precondition(lambda self: self.ticks % 6 == 5)
    @rule(data=st.data())
    def remove_owner(self, data) -> None:
        """Remove an owner (its requests released without tokens, the pages left
        unreferenced free or quarantined; cached ones wait in the LRU) and add it back."""
        core, model = self.core, self.model
        owner = data.draw(st.sampled_from(self.names), label="owner")
        old = self.ids[owner]
        quarantine = data.draw(BOOL, label="quarantine")
        assert core.remove_owner(old, quarantine=quarantine) == model.remove_owner(old, quarantine)
        assert core.quarantined_pages(old) == len(model.quarantined.get(old, ()))
        self.check_events([])
        self.gone.append(old)
        if data.draw(BOOL, label="new_namespace"):
            self.ns[owner] = data.draw(st.sampled_from(("", "a", "b")), label="namespace")
        self.quota[owner] = data.draw(QUOTA, label="quota")
        self.ids[owner] = core.add_owner(self.ns[owner])
        model.add_owner(self.ids[owner], self.ns[owner])

    @precondition(lambda self: self.ticks % 6 == 2)
    @rule(data=st.data())
    def release_quarantine(self, data) -> None:
        held = sorted(self.model.quarantined)
        if held and data.draw(BOOL, label="a_held_one"):
            index = data.draw(st.sampled_from(held), label="held_index")
        else:
            index = data.draw(st.sampled_from([0, *self.ids.values(), *self.gone]), label="index")
        assert self.core.release_quarantine(index) == self.model.release_quarantine(index)
        self.check_events([])

    @precondition(lambda self: self.ticks % 6 == 3)
    @rule()
    def snapshot_events(self) -> None:
        """A resync: AllCleared, then one PagesStored per cached page, parents first;
        replayed, it gives the model's keys, parents, tokens and namespaces."""
        events = self.core.snapshot_events()
        assert isinstance(events[0], AllCleared)
        seen: set[bytes] = set()
        want = {self.kb(*mk): mk for mk in self.model.index}
        for e in events[1:]:
            assert isinstance(e, PagesStored) and len(e.keys) == 1
            (key,) = e.keys
            ns, toks = want[key]
            parent = self.kb(ns, toks[: -self.ps]) if len(toks) > self.ps else None
            assert e.parent_key == parent and (parent is None or parent in seen)
            assert e.token_ids.tolist() == list(toks[-self.ps :]) and e.namespace == ns and e.page_size == self.ps
            seen.add(key)
        assert seen == set(want)

    @precondition(lambda self: self.ticks % 3 == 1)
    @rule(data=st.data())
    def invalid_prefix_step(self, data) -> None:
        """A step with one bad prefix item: it raises the right reason, nothing changes."""
        owner = self.draw_owner(data)
        mine = self.slots_of(owner)
        if not mine:
            self.open_new(data, owner)
            mine = self.slots_of(owner)
            if not mine:
                return
        ps = self.ps
        key = self.model.key
        written = [s for s in mine if self.reqs[s].length]
        fresh = [s for s in mine if not self.reqs[s].length]
        with_cached = [s for s in mine if any(p in key for p in self.reqs[s].pages)]
        theirs = [s for s, r in self.reqs.items() if r.owner != self.ids[owner]]
        kinds = ["dup_cache", "dup_match", "max_negative", "released_cache", "count_mismatch"]
        if written:
            kinds += ["release_too_long", "cache_too_long", "truncated_cache_too_long", "match_not_fresh"]
        if fresh:
            kinds += ["matched_alloc_expected"]
        if with_cached:
            kinds += ["differ_release", "differ_cache"]
        if theirs:
            kinds += ["foreign_cache"]
        kind = data.draw(st.sampled_from(kinds), label="invalid_kind")
        event(f"invalid: {kind}")
        s = data.draw(st.sampled_from(mine), label="slot")
        req = self.reqs[s]
        toks = req.script[: req.length]
        if kind in ("release_too_long", "cache_too_long", "truncated_cache_too_long", "match_not_fresh"):
            s = data.draw(st.sampled_from(written), label="written")
            req = self.reqs[s]
            toks = req.script[: req.length + data.draw(st.integers(1, 2), label="extra")]
        if kind in ("differ_release", "differ_cache"):
            s = data.draw(st.sampled_from(with_cached), label="cached_slot")
            req = self.reqs[s]
            toks = req.script[: req.length]
            col = data.draw(st.sampled_from([c for c, p in enumerate(req.pages) if p in key]), label="col")
            pos = col * ps + data.draw(st.integers(0, ps - 1), label="pos")
            toks[pos] = (toks[pos] + 1) % 3
        if kind == "release_too_long":
            b, reason = both(release_slots=[s], release_tokens=[toks]), Reason.ALLOCED_LEN_MISMATCH
        elif kind == "cache_too_long":
            b, reason = both(cache=[(s, toks)]), Reason.ALLOCED_LEN_MISMATCH
        elif kind == "truncated_cache_too_long":
            cut = (req.length - 1) // ps * ps  # a boundary below its length: never PAGE_SHARED
            toks = req.script[: req.length]
            b = both(truncate_slots=[s], truncate_lens=[cut], cache=[(s, toks)])
            reason = Reason.ALLOCED_LEN_MISMATCH
        elif kind == "match_not_fresh":
            b, reason = both(match=[(s, toks)]), Reason.ALLOCED_LEN_MISMATCH
        elif kind == "matched_alloc_expected":
            s = data.draw(st.sampled_from(fresh), label="fresh")
            script = self.reqs[s].script
            b = both(match=[(s, script)], alloc_slots=[s], alloc_needs=[1], alloc_expected_lens=[0])
            reason = Reason.BAD_VALUE
        elif kind == "differ_release":
            b, reason = both(release_slots=[s], release_tokens=[toks]), Reason.BAD_VALUE
        elif kind == "differ_cache":
            b, reason = both(cache=[(s, toks)]), Reason.BAD_VALUE
        elif kind == "dup_cache":
            b, reason = both(cache=[(s, toks[:ps]), (s, toks)]), Reason.DUPLICATE_SLOT
        elif kind == "dup_match":
            b, reason = both(match=[(s, req.script), (s, req.script)]), Reason.DUPLICATE_SLOT
            if req.length:
                b = both(truncate_slots=[s], truncate_lens=[0], match=[(s, req.script), (s, req.script)])
        elif kind == "max_negative":
            b = both(truncate_slots=[s], truncate_lens=[0], match=[(s, req.script, -2)])
            reason = Reason.BAD_VALUE
        elif kind == "released_cache":
            b = both(release_slots=[s], cache=[(s, [])])
            reason = Reason.SLOT_NOT_FOUND
        elif kind == "foreign_cache":
            b, reason = both(cache=[(data.draw(st.sampled_from(theirs)), [])]), Reason.SLOT_NOT_FOUND
        else:  # count_mismatch: two cache slots, one token list
            batch = dataclasses.replace(StepBatch.of(cache=[(s, toks)]), cache_slots=np.array([s, s], dtype=np.int64))
            b, reason = (batch, Step(cache_slots=[s, s], cache_tokens=[toks])), Reason.LENGTH_MISMATCH
        self.expect_error(owner, reason, *b)

    @rule()
    def restart(self) -> None:
        """The server restarts: a new core restores the old one's state image and block
        table (a clean state: nothing to repair); the model goes on unchanged but for
        the counters since start."""
        old = self.core
        core, report = restore(
            self.cfg, old.block_table, self.image, prefix_cache=self.enabled, audit_every_step=True,
            event_sink=self.sink.append,
        )  # fmt: skip
        assert report.repaired == (), report
        assert report.requests == len(self.reqs) and report.owners == len(self.model.owners), report
        self.core = core
        self.model.restart_counters()
        self.restarts += 1
        event("restarts")

    # -------------------------------------------------------------- invariant

    @invariant()
    def agrees_with_the_model(self) -> None:
        core, model = self.core, self.model
        if core is None:
            return
        self.ticks += 1
        model.check()
        ps, cfg = self.ps, self.cfg
        snap = snapshot(core)
        bt = snap["block_table"]
        np.testing.assert_array_equal(bt, model.table(bt.shape), err_msg="the block table")
        for slot, req in self.reqs.items():
            assert snap["alloced"][slot] == req.length, (slot, req)
            # cached pages (a prefix of the row, one chain: the model checks) hold the row's tokens
            for c, p in enumerate(req.pages):
                mk = model.key.get(p)
                assert mk is None or mk == (self.ns_of(req), tuple(req.script[: (c + 1) * ps])), (slot, c, mk)
        assert snap["ref_cnt"].tolist() == [model.ref[p] for p in range(cfg.num_pages)]
        # the key index, page metadata, the evictable queue in LRU order
        cache = core.cache
        assert cache.index == {self.kb(*mk): p for mk, p in model.index.items()}
        for p, (ns, toks) in model.key.items():
            assert cache.namespace[p] == ns and cache.tokens[p].tolist() == list(toks[-ps:])
            assert int(cache.depth[p]) == len(toks) // ps - 1
            assert cache.parent[p] == self.kb(ns, toks[:-ps])
        assert cache.queued().tolist() == model.lru, (cache.queued().tolist(), model.lru)
        # free stack: the model's free pages, none of them cached
        free = snap["free_stack"].tolist()
        assert len(set(free)) == len(free) == snap["num_free"] and set(free) == model.free
        assert not any(cache.cached[p] for p in free)
        assert snap["free_slots"] == model.slot_stack, "the free request slots, in stack order"
        # the events replayed give the index's keys, at their depths
        assert self.replay == {k: int(cache.depth[p]) for k, p in cache.index.items()}
        stats = snap["stats"]
        want = model.stats()
        assert {name: getattr(stats, name) for name in want} == want
        total = stats.num_free_pages + stats.num_cached_pages + stats.num_used_pages + stats.num_quarantined_pages
        assert total == stats.num_pages_total == cfg.num_pages - 1
        usage = {o.owner: (o.num_requests, o.num_pages_held, o.namespace, o.prefix_query_tokens,
                           o.prefix_hit_tokens, o.num_evictions) for o in stats.owners}  # fmt: skip
        assert usage == {index: model.usage(index) for index in model.owners}
        for name, quota in self.quota.items():
            if quota is not None and self.held(name) > quota:
                raise AssertionError(f"{name} holds {self.held(name)} pages over its quota {quota}")

    def ns_of(self, req: Request) -> str:
        return self.model.owners[req.owner].namespace


# At full strength (500 examples of 50 steps) well under a minute on two slow cores;
# KVMEM_PREFIX_EXAMPLES=5000 for a long run, whatever the profile.
PrefixMachine.TestCase.settings = capped(
    500,
    50,
    deadline=None,
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
if os.environ.get("KVMEM_PREFIX_EXAMPLES"):
    PrefixMachine.TestCase.settings = settings(
        PrefixMachine.TestCase.settings, max_examples=int(os.environ["KVMEM_PREFIX_EXAMPLES"]), stateful_step_count=50
    )
TestPrefixMachine = PrefixMachine.TestCase


# ------------------------------------------------------------- invalid items, one by one


def test_invalid_prefix_items_raise_and_change_nothing() -> None:
    """Each bad prefix item raises its reason and changes nothing: rows, counts, free
    stack, lengths, stats, the key index, the evictable queue, no event."""
    sink: list[list[CacheEvent]] = []
    core = KVCore(CoreConfig(9, 2, 4, 8), audit_every_step=True, event_sink=sink.append)
    o, other = core.add_owner(), core.add_owner()
    a, b, c = core.open(o, ["a", "b", "c"]).tolist()
    (d,) = core.open(other, ["d"]).tolist()
    core.step(o, StepBatch.of(alloc_slots=[a, b], alloc_needs=[4, 3]))
    core.step(o, StepBatch.of(cache=[(a, [1, 2, 3, 4])]))  # a's two pages are cached
    sink.clear()
    cases = {
        "release tokens beyond alloced_len": (
            StepBatch.of(release_slots=[a], release_tokens=[[1, 2, 3, 4, 5]]), Reason.ALLOCED_LEN_MISMATCH,
        ),
        "cache tokens beyond alloced_len": (StepBatch.of(cache=[(b, [1, 2, 3, 4])]), Reason.ALLOCED_LEN_MISMATCH),
        "cache tokens beyond the truncated length": (
            StepBatch.of(truncate_slots=[a], truncate_lens=[2], cache=[(a, [1, 2, 3, 4])]), Reason.ALLOCED_LEN_MISMATCH,
        ),
        "cache tokens differ from a cached page's": (StepBatch.of(cache=[(a, [1, 2, 3, 9])]), Reason.BAD_VALUE),
        "release tokens differ from a cached page's": (
            StepBatch.of(release_slots=[a], release_tokens=[[9, 2, 3, 4]]), Reason.BAD_VALUE,
        ),
        "duplicate cache slot": (StepBatch.of(cache=[(b, [1, 2]), (b, [1, 2])]), Reason.DUPLICATE_SLOT),
        "duplicate match slot": (StepBatch.of(match=[(c, [1, 2]), (c, [1, 2])]), Reason.DUPLICATE_SLOT),
        "match on a running request": (StepBatch.of(match=[(a, [1, 2, 3, 4])]), Reason.ALLOCED_LEN_MISMATCH),
        "expected length on a matched alloc": (
            StepBatch.of(match=[(c, [1, 2, 3, 4])], alloc_slots=[c], alloc_needs=[6], alloc_expected_lens=[0]),
            Reason.BAD_VALUE,
        ),
        "negative max tokens": (StepBatch.of(match=[(c, [1, 2, 3, 4], -2)]), Reason.BAD_VALUE),
        "cache of a slot released in the step": (
            StepBatch.of(release_slots=[b], cache=[(b, [1, 2])]), Reason.SLOT_NOT_FOUND,
        ),
        "match of another owner's slot": (StepBatch.of(match=[(d, [1, 2])]), Reason.SLOT_NOT_FOUND),
        "truncate into a cached page": (StepBatch.of(truncate_slots=[a], truncate_lens=[3]), Reason.PAGE_SHARED),
        "token lists fewer than cache items": (
            dataclasses.replace(StepBatch.of(cache=[(b, [1, 2])]), cache_slots=np.array([b, a], dtype=np.int64)),
            Reason.LENGTH_MISMATCH,
        ),
    }  # fmt: skip
    for name, (batch, reason) in cases.items():
        before = full_snapshot(core)
        try:
            core.step(o, batch)
        except KVMemError as err:
            assert err.reason is reason, (name, err.reason, str(err))
        else:
            raise AssertionError(f"{name}: accepted")
        assert_same_snapshot(before, full_snapshot(core))
        assert sink == [], name
    # and the same state still serves: a truncate to a page boundary, then a match of both pages
    chain = core.block_table[a, :2].tolist()
    res = core.step(o, StepBatch.of(truncate_slots=[a], truncate_lens=[2], match=[(c, [1, 2, 3, 4, 5])]))
    assert res.match_lens.tolist() == [4] and core.block_table[c, :2].tolist() == chain
    assert core.cache.queued().tolist() == [] and core.audit().ok


# ------------------------------------------------- core bugs found by the machine above
# Their smallest reproductions.


def test_rows_sharing_a_chain_released_together_queue_the_chain_end_first() -> None:
    # CORE BUG 1, found by the machine, fixed since (a regression test now):
    # PagePool._unref_repeated pushed pages listed more than once in one unref (two rows
    # sharing cached pages, released or truncated in one step, or by remove_owner) to the
    # evictable queue sorted by page id, not in chain order. When a chain's parent has the
    # larger id it was queued as the older one and evicted first: its child stayed cached
    # with no parent (the audit: "cached pages whose parent key is neither a root nor
    # cached"; a router saw a removed parent under a stored child).
    core = KVCore(CoreConfig(num_pages=4, page_size=2, max_requests=3, max_context_len=8))
    o = core.add_owner()
    x, a, b = core.open(o, ["x", "a", "b"]).tolist()
    core.step(o, StepBatch.of(alloc_slots=[x, a], alloc_needs=[2, 2]))  # x: page 1, a: page 2
    core.step(o, StepBatch.of(release_slots=[x]))  # page 1 free again
    core.step(o, StepBatch.of(alloc_slots=[a], alloc_needs=[2]))  # a: [2, 1]
    core.step(o, StepBatch.of(cache=[(a, [5, 6, 7, 8])]))  # the chain: page 2, then its child page 1
    assert core.step(o, StepBatch.of(match=[(b, [5, 6, 7, 8])])).match_lens.tolist() == [4]  # b: [2, 1]
    core.step(o, StepBatch.of(release_slots=[a, b]))  # the last two holders let go together
    assert core.cache.queued().tolist() == [1, 2]  # the chain end (page 1) is the oldest
    (c,) = core.open(o, ["c"]).tolist()
    res = core.step(o, StepBatch.of(alloc_slots=[c], alloc_needs=[4]))  # the free page 3 and one eviction
    assert sorted(res.new_pages.tolist()) == [1, 3]
    assert core.audit().ok, core.audit().problems


def test_release_tokens_onto_an_evictable_prefix_keep_the_chain_end_first() -> None:
    # CORE BUG 2, found by the machine, fixed since (a regression test now):
    # prefix_step.insert_released, given a release with tokens whose first pages
    # duplicate cached pages that wait in the evictable queue, freed the duplicates and
    # inserted the later pages as their children, but left the cached parents where they
    # were in the queue: older than their new children, so evicted first, and the
    # children were left with no parent. (The fix switches the row to the cache's pages
    # before the release lets go, as a cache item does, so the parents are queued again
    # with their children, chain end first.)
    core = KVCore(CoreConfig(num_pages=4, page_size=2, max_requests=3, max_context_len=8))
    o = core.add_owner()
    a, b, c = core.open(o, ["a", "b", "c"]).tolist()
    core.step(o, StepBatch.of(alloc_slots=[a], alloc_needs=[2]))  # a: page 1
    core.step(o, StepBatch.of(release_slots=[a], release_tokens=[[5, 6]]))  # page 1 cached, evictable
    core.step(o, StepBatch.of(alloc_slots=[b], alloc_needs=[4]))  # b: pages 2, 3 (it did not match)
    core.step(o, StepBatch.of(release_slots=[b], release_tokens=[[5, 6, 7, 8]]))  # 2: a duplicate; 3: child of 1
    assert core.cache.queued().tolist()[0] == 3  # the chain end goes first
    res = core.step(o, StepBatch.of(alloc_slots=[c], alloc_needs=[4]))  # the free page 2 and one eviction
    assert sorted(res.new_pages.tolist()) == [2, 3]
    assert core.audit().ok, core.audit().problems
