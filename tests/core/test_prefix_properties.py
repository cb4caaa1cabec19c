"""Property tests of the prefix cache: random steps of several owners against a simple model.

The model (no numpy cleverness) keeps, per open request, the token ids it has written
(a prefix of its *script*, drawn when it opens: a prefix of one of a few "system
prompts" and a tail from a three-token alphabet, so keys collide often) and its list of
page ids; the cached chains as a dict ``(namespace, all tokens up to and including the
page) -> page``; a reference count per page; the evictable cached pages in LRU order
(oldest first: a holder's pages are pushed when the last holder lets go, chain end first,
so a row's last column is the oldest of them); the free pages; the quarantines; the
prefix counters, in total and per owner.

It predicts everything but the page ids an alloc takes: match lengths and the pages a
match attaches, the pages a cache item switches a row to, which duplicates a release
frees (a release with tokens switches its row to the cache's equal pages before it lets
go, so those are queued again with the new pages, chain end first), which cached pages
an alloc evicts (the LRU head), what an alloc of a slot matched in the same Step gets
(the length it asks for less what the match covered), and the events of every call
(``PagesStored`` runs with their parent and tokens, ``PagesRemoved`` in eviction order).
The pages of an alloc are read from its result and must be the model's free pages (the
evicted ones included). After every rule the core must agree: block-table rows, lengths,
reference counts, the key index (keys recomputed here from the documented XXH3 recipe),
the evictable queue in order, the free stack, per-page cache metadata, stats, per-owner
usage, and the set of keys obtained by replaying every event the sink received.

Owners (2 or 3, in 1 or 2 namespaces, each with a quota or none) interleave: open,
general steps (releases with or without tokens, truncates incl. to page boundaries and
into the middle of a cached page, which must raise PAGE_SHARED and change nothing, cache
items, match items with and without max tokens, allocs; any combination in one Step,
e.g. release with tokens + match + alloc of the remainder), decode-shaped steps (the
fast path), remove_owner with and without quarantine, release_quarantine, snapshots of
the events, and invalid prefix items (each must raise and change nothing). One example
in ten runs with the prefix cache off (nothing is cached, nothing matches).

Not observable here: the context cap on a match (no cached chain is longer than a
request may be). Runtime: about 30 s with CI=true (hypothesis's ci profile, fixed
seeds); ``KVMEM_PREFIX_EXAMPLES=5000`` for a long run (about 4 minutes).
"""

from __future__ import annotations

import collections
import dataclasses
import os

import numpy as np
import xxhash
from core_state import snapshot
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvmem.server.core import AllocStatus, CoreConfig, KVCore, StepBatch, StepResult
from kvmem.server.core.events import AllCleared, CacheEvent, PagesRemoved, PagesStored
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


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def assert_same_snapshot(before: dict, after: dict) -> None:
    for key, value in before.items():
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(after[key], value, err_msg=key)
        else:
            assert after[key] == value, key


def full_snapshot(core: KVCore) -> dict:
    """core_state's snapshot plus the prefix cache: index, evictable queue, counters."""
    snap = snapshot(core)
    cache = core.cache
    snap["index"] = dict(cache.index)
    snap["queued"] = cache.queued().copy()
    snap["cache_counters"] = (cache.num_evictions, cache.num_inserted, cache.query_tokens, cache.hit_tokens)
    snap["owner_prefix"] = {
        i: (o.prefix_query_tokens, o.prefix_hit_tokens, o.num_evictions, o.namespace)
        for i, o in core.slots.owners.items()
    }
    return snap


def same_event(got: CacheEvent, want: tuple) -> bool:
    if want[0] == "stored":
        _, keys, parent, tokens, ps, ns = want
        return (
            isinstance(got, PagesStored)
            and got.keys == keys
            and got.parent_key == parent
            and got.token_ids.dtype == np.int32
            and got.token_ids.tolist() == tokens
            and got.page_size == ps
            and got.namespace == ns
        )
    return isinstance(got, PagesRemoved) and got.keys == want[1]


class Request:
    __slots__ = ("n", "owner", "pages", "rid", "script")

    def __init__(self, owner: str, rid: str, script: list[int]) -> None:
        self.owner = owner
        self.rid = rid
        self.script = script  # the tokens it writes; tokens written so far: script[:n]
        self.n = 0  # alloced_len
        self.pages: list[int] = []

    @property
    def tokens(self) -> list[int]:
        return self.script[: self.n]


@dataclasses.dataclass
class Plan:
    """One general step's items, as drawn."""

    release: list[tuple[int, list[int] | None]] = dataclasses.field(default_factory=list)
    truncate: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    cache: list[tuple[int, list[int]]] = dataclasses.field(default_factory=list)
    match: list[tuple[int, list[int], int]] = dataclasses.field(default_factory=list)


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
        self.core = KVCore(self.cfg, audit_every_step=True, prefix_cache=enabled, event_sink=self.sink.append)
        self.names = OWNERS[: len(layout)]
        self.ns = dict(zip(self.names, layout, strict=True))
        self.quota = dict(zip(self.names, quotas[: len(layout)], strict=True))
        self.ids = {name: self.core.add_owner(self.ns[name]) for name in self.names}
        self.gone: list[int] = []
        # usage per core owner index: [query tokens, hit tokens, evictions]
        self.usage = {i: [0, 0, 0] for i in self.ids.values()}
        self.reqs: dict[int, Request] = {}
        self.ref: collections.Counter[int] = collections.Counter()
        self.free: set[int] = set(range(1, num_pages))
        self.cached: dict[tuple[str, tuple[int, ...]], int] = {}  # (namespace, tokens through the page) -> page
        self.key_of: dict[int, tuple[str, tuple[int, ...]]] = {}  # page -> its model key
        self.lru: list[int] = []  # evictable cached pages, oldest first
        self.quarantined: dict[int, set[int]] = {}
        self.query = self.hits = self.evictions = 0
        self.replay: dict[bytes, int] = {}  # keys from the events: key -> depth
        self.want: list[tuple] = []  # events the model expects from the current call
        self.step_cached = 0
        self.acting = ""  # the owner whose step runs (for coverage events)
        self.cached_by: dict[int, str] = {}
        self.next_rid = 0
        self._kb: dict[tuple[str, tuple[int, ...]], bytes] = {}

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

    # ------------------------------------------------------------- model ops

    def held(self, owner: str) -> int:
        return sum(len(r.pages) for r in self.reqs.values() if r.owner == owner)

    def slots_of(self, owner: str) -> list[int]:
        return sorted(s for s, r in self.reqs.items() if r.owner == owner)

    def unref(self, pages: list[int], hold: set[int] | None = None) -> None:
        """Drop one reference per entry; pages reaching 0, in order of first appearance
        (chain order within a row): cached ones join the LRU end reversed (chain ends
        oldest), the others go free or into ``hold``."""
        for p in pages:
            self.ref[p] -= 1
            assert self.ref[p] >= 0
        zero = [p for p in dict.fromkeys(pages) if self.ref[p] == 0]
        for p in zero:
            del self.ref[p]
        self.lru.extend(reversed([p for p in zero if p in self.key_of]))
        rest = [p for p in zero if p not in self.key_of]
        (self.free if hold is None else hold).update(rest)

    def share(self, pages: list[int]) -> None:
        for p in pages:
            if self.ref[p] == 0:
                self.lru.remove(p)
            self.ref[p] += 1

    def insert(self, ns: str, pages: list[int], tokens: list[int]) -> list[int]:
        """Cache a chain held by a request; returns per column the page its key is on."""
        ps = self.ps
        out: list[int] = []
        start = -1
        for col, page in enumerate(pages):
            mk = (ns, tuple(tokens[: (col + 1) * ps]))
            have = self.cached.get(mk)
            if have is None:
                assert page not in self.key_of, "the model sent tokens that differ from a cached page's"
                self.cached[mk] = page
                self.key_of[page] = mk
                self.cached_by[page] = self.acting
                start = col if start < 0 else start
                out.append(page)
            else:
                if start >= 0:
                    self.stored(ns, tokens, start, col)
                    start = -1
                out.append(have)
        if start >= 0:
            self.stored(ns, tokens, start, len(pages))
        return out

    def stored(self, ns: str, tokens: list[int], start: int, end: int) -> None:
        ps = self.ps
        keys = [self.kb(ns, tuple(tokens[: (c + 1) * ps])) for c in range(start, end)]
        parent = self.kb(ns, tuple(tokens[: start * ps])) if start else None
        self.want.append(("stored", keys, parent, tokens[start * ps : end * ps], ps, ns))
        self.step_cached += end - start

    def evict(self, owner_id: int, n: int) -> None:
        pages, self.lru = self.lru[:n], self.lru[n:]
        keys = []
        for p in pages:
            mk = self.key_of.pop(p)
            del self.cached[mk]
            keys.append(self.kb(*mk))
        self.free.update(pages)
        self.want.append(("removed", keys))
        self.evictions += n
        self.usage[owner_id][2] += n

    def admit(self, owner: str, items: list[tuple[int, int]], atomic: bool) -> list[AllocStatus]:
        """Alloc statuses (items admitted one by one), and the evictions they cause."""
        quota = self.quota[owner]
        quota_left = None if quota is None else quota - self.held(owner)
        pool_left = len(self.free) + len(self.lru)
        want: list[AllocStatus] = []
        total = 0
        for s, need in items:
            cur = self.reqs[s].n
            c = ceil_div(cur + need, self.ps) - ceil_div(cur, self.ps)
            if cur + need > self.cfg.max_context_len:
                want.append(AllocStatus.CONTEXT_TOO_LONG)
            elif quota_left is not None and c > quota_left:
                want.append(AllocStatus.QUOTA_EXCEEDED)
            elif c > pool_left:
                want.append(AllocStatus.OUT_OF_PAGES)
            else:
                want.append(AllocStatus.OK)
                pool_left -= c
                total += c
                if quota_left is not None:
                    quota_left -= c
        if atomic and any(w != AllocStatus.OK for w in want):
            want = [AllocStatus.ABORTED if w == AllocStatus.OK else w for w in want]
            total = 0
        if total > len(self.free):
            self.evict(self.ids[owner], total - len(self.free))
            event("alloc evicts")
        return want

    def apply_allocs(self, res: StepResult, items: list[tuple[int, int]], want: list[AllocStatus]) -> None:
        ps = self.ps
        assert [AllocStatus(int(x)) for x in res.alloc_status] == want
        assert res.num_refused == sum(w != AllocStatus.OK for w in want)
        assert res.new_page_offsets.shape == (len(items) + 1,) and res.kv_loc_offsets.shape == (len(items) + 1,)
        taken: list[int] = []
        for i, (s, need) in enumerate(items):
            pages = res.new_pages[res.new_page_offsets[i] : res.new_page_offsets[i + 1]].tolist()
            kv = res.kv_loc[res.kv_loc_offsets[i] : res.kv_loc_offsets[i + 1]].tolist()
            if want[i] != AllocStatus.OK:
                assert pages == [] and kv == []
                continue
            req = self.reqs[s]
            cur, end = req.n, req.n + need
            assert len(pages) == ceil_div(end, ps) - ceil_div(cur, ps)
            taken += pages
            req.pages += pages
            req.n = end
            assert kv == [req.pages[pos // ps] * ps + pos % ps for pos in range(cur, end)]
        assert len(set(taken)) == len(taken) and set(taken) <= self.free, (taken, self.free)
        self.free.difference_update(taken)
        for p in taken:
            self.ref[p] = 1

    # ------------------------------------------------------------- events

    def check_events(self) -> None:
        """The call gave the sink exactly the events the model expects (one list, or
        no call when there are none); replay them."""
        calls, self.sink[:] = list(self.sink), []
        want, self.want = self.want, []
        if not want:
            assert calls == [], calls
            return
        assert len(calls) == 1, calls
        (got,) = calls
        assert len(got) == len(want), (got, want)
        for g, w in zip(got, want, strict=True):
            assert same_event(g, w), (g, w)
        for e in got:
            self.replay_event(e)

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
        assert slot not in self.reqs
        self.reqs[slot] = Request(owner, rid, self.draw_script(data))

    def draw_owner(self, data) -> str:
        busy = sorted({r.owner for r in self.reqs.values()})
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
        ps, n = self.ps, req.n
        kind = data.draw(TRUNC_KIND, label="truncate_kind")
        if kind == "zero":
            return 0
        if kind == "mid_cached":
            cols = [c for c, p in enumerate(req.pages) if p in self.key_of]
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
            assert self.core.open(self.ids[owner], [self.reqs[s].rid]).tolist() == [s]
            return
        if len(self.reqs) >= self.cfg.max_requests:
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
        diverge: dict[int, list[int]] = {}
        match_alloc: set[int] = set()
        plain_alloc: list[int] = []
        for s in self.slots_of(owner):
            req = self.reqs[s]
            role = data.draw(RUNNING_ROLE if req.n else FRESH_ROLE, label="role")
            if role.startswith("release"):
                toks = req.script[: self.draw_len(data, req.n)] if role.endswith("tokens") else None
                plan.release.append((s, toks))
                continue
            n = req.n
            if "truncate" in role:
                n = 0 if "match" in role else self.draw_truncate(data, req)
                plan.truncate.append((s, n))
                if n < req.n and data.draw(st.integers(0, 2), label="diverge") == 0:
                    size = len(req.script) - n
                    diverge[s] = data.draw(st.lists(TOKEN, min_size=size, max_size=size), label="new_tail")
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
        for s, n in plan.truncate:
            req = self.reqs[s]
            if n % self.ps and n < req.n and req.pages[n // self.ps] in self.key_of:
                event("PAGE_SHARED")
                al = sorted(plain_alloc + list(match_alloc))
                self.expect_error(owner, Reason.PAGE_SHARED, self.batch(plan, al, [0] * len(al), None, atomic))
                return
        self.run_step(data, owner, plan, diverge, match_alloc, plain_alloc, atomic)

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

    def batch(self, plan: Plan, al: list[int], need: list[int], expected: list[int] | None, atomic: bool) -> StepBatch:
        rel_tokens = None
        if any(t is not None for _, t in plan.release):
            rel_tokens = [t for _, t in plan.release]
        return StepBatch.of(
            release_slots=[s for s, _ in plan.release],
            release_tokens=rel_tokens,
            truncate_slots=[s for s, _ in plan.truncate],
            truncate_lens=[n for _, n in plan.truncate],
            cache=plan.cache,
            match=plan.match,
            alloc_slots=al,
            alloc_needs=need,
            alloc_expected_lens=expected,
            atomic=atomic,
        )

    def run_step(
        self,
        data,
        owner: str,
        plan: Plan,
        diverge: dict[int, list[int]],
        match_alloc: set[int],
        plain_alloc: list[int],
        atomic: bool,
    ) -> None:
        ps, ns, oid = self.ps, self.ns[owner], self.ids[owner]
        self.step_cached = 0
        self.acting = owner
        # Releases: full pages of the tokens enter the cache first; then the rows go. A
        # page whose key the cache has on another page is a duplicate: freed, and the
        # cache's page is touched (as if the row held it when it let go, so a chain
        # keeps its end before its beginning in the LRU).
        for s, toks in plan.release:
            req, k = self.reqs[s], len(toks or ()) // ps
            if k and self.enabled:
                kept = self.insert(ns, req.pages[:k], toks)
                moved = [c for c in range(k) if kept[c] != req.pages[c]]
                old = [req.pages[c] for c in moved]
                for c in moved:
                    req.pages[c] = kept[c]
                self.share([kept[c] for c in moved])
                self.unref(old)
                if moved:
                    event("release frees duplicates")
        dropped = [p for s, _ in plan.release for p in self.reqs.pop(s).pages]
        num_dropped = len(dropped)
        self.unref(dropped)
        # Truncates (one drop of every item's tail, item after item).
        dropped = []
        for s, n in plan.truncate:
            req = self.reqs[s]
            keep = ceil_div(n, ps)
            dropped += req.pages[keep:]
            del req.pages[keep:]
            req.n = n
            if s in diverge and n:
                req.script = req.script[:n] + diverge.pop(s)
        num_dropped += len(dropped)
        self.unref(dropped)
        # Cache items: insert; a key on another page switches the row there.
        switched: list[int] = []
        changed: list[int] = []
        for s, toks in plan.cache:
            req, k = self.reqs[s], len(toks) // ps
            if not (k and self.enabled):
                switched.append(0)
                continue
            kept = self.insert(ns, req.pages[:k], toks)
            moved = [c for c in range(k) if kept[c] != req.pages[c]]
            old = [req.pages[c] for c in moved]
            for c in moved:
                req.pages[c] = kept[c]
            self.share([kept[c] for c in moved])
            self.unref(old)
            switched.append(len(moved))
            if moved:
                changed.append(s)
                event("cache item switches")
        # Matches: the longest cached run, within max tokens, the context and the quota.
        quota = self.quota[owner]
        quota_left = None if quota is None else quota - self.held(owner)
        lens: list[int] = []
        for s, toks, cap in plan.match:
            req = self.reqs[s]
            if s in diverge:
                req.script = diverge.pop(s)
            limit = len(toks) if cap < 0 else min(len(toks), cap)
            self.query += limit
            self.usage[oid][0] += limit
            k = min(limit // ps, self.cfg.max_context_len // ps)
            if quota_left is not None:
                k = min(k, max(quota_left, 0))
            run: list[int] = []
            for j in range(k):
                page = self.cached.get((ns, tuple(toks[: (j + 1) * ps])))
                if page is None:
                    break
                run.append(page)
            self.share(run)
            req.pages = run
            req.n = len(run) * ps
            lens.append(req.n)
            self.hits += req.n
            self.usage[oid][1] += req.n
            if quota_left is not None:
                quota_left -= len(run)
            event("match hit" if run else "match miss")
            if any(self.cached_by[p] != owner for p in run):
                event("match hit on pages another owner cached")
            nxt = tuple(toks[: (len(run) + 1) * ps])
            if len(run) < k and any((o, nxt) in self.cached for o in ("", "a", "b") if o != ns):
                event("match miss where another namespace has the page")
        changed += [s for (s, _, _), m in zip(plan.match, lens, strict=True) if m]
        # Allocs. One of a slot matched in this step asks for the request's whole length
        # (its sender cannot know the match): it gets what the match did not cover.
        prompt = {s: len(toks) for s, toks, _ in plan.match}
        al = list(match_alloc) + plain_alloc
        if len(al) > 1:
            al = data.draw(st.permutations(sorted(al)), label="alloc_order")
        need, items = [], []
        for s in al:
            matched = s in match_alloc
            if matched and data.draw(st.integers(0, 3), label="need_kind"):
                sent = prompt[s]
            else:
                room = max(self.cfg.max_context_len - (0 if matched else self.reqs[s].n), 0)
                sent = data.draw(st.one_of(st.integers(0, room), st.integers(0, room + 2)), label="need")
            need.append(sent)
            items.append((s, max(sent - self.reqs[s].n, 0) if matched else sent))
        expected = None
        if al and data.draw(BOOL, label="with_expected"):
            expected = [-1 if s in match_alloc or not data.draw(BOOL, label="expect") else self.reqs[s].n for s in al]
        evicted = self.evictions
        want = self.admit(owner, items, atomic)

        res = self.core.step(oid, self.batch(plan, al, need, expected, atomic), quota)

        assert res.num_pages_released == num_dropped
        assert res.match_lens.tolist() == lens
        assert res.cache_switched.tolist() == (switched if plan.cache else [])
        assert res.changed_rows.tolist() == changed
        assert res.num_pages_cached == self.step_cached
        self.apply_allocs(res, items, want)
        assert res.num_pages_evicted == self.evictions - evicted
        self.check_events()

    def expect_error(self, owner: str | int, reason: Reason, batch: StepBatch) -> None:
        core = self.core
        before = full_snapshot(core)
        oid = self.ids[owner] if isinstance(owner, str) else owner
        quota = self.quota[owner] if isinstance(owner, str) else None
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
            expected = [self.reqs[s].n if data.draw(BOOL, label="expect") else -1 for s in mine]
        items = [(s, k) for s in mine]
        before = self.evictions
        want = self.admit(owner, items, atomic)
        batch = StepBatch.of(alloc_slots=mine, alloc_needs=[k] * len(mine), alloc_expected_lens=expected, atomic=atomic)
        res = self.core.step(self.ids[owner], batch, self.quota[owner])
        self.apply_allocs(res, items, want)
        assert res.num_pages_evicted == self.evictions - before
        assert res.num_pages_released == 0
        self.check_events()

    @rule(data=st.data())
    def decode_again(self, data) -> None:
        self.decode(data)

    @precondition(lambda self: self.ticks % 6 == 5)
    @rule(data=st.data())
    def remove_owner(self, data) -> None:
        """Remove an owner (its requests released without tokens, the pages left
        unreferenced free or quarantined; cached ones wait in the LRU) and add it back."""
        core = self.core
        owner = data.draw(st.sampled_from(self.names), label="owner")
        mine = self.slots_of(owner)
        old = self.ids[owner]
        quarantine = data.draw(BOOL, label="quarantine")
        assert core.remove_owner(old, quarantine=quarantine) == len(mine)
        hold: set[int] | None = set() if quarantine else None
        self.unref([p for s in mine for p in self.reqs.pop(s).pages], hold)
        if hold:
            self.quarantined[old] = hold
        assert core.quarantined_pages(old) == len(hold or ())
        self.check_events()
        self.gone.append(old)
        del self.usage[old]
        if data.draw(BOOL, label="new_namespace"):
            self.ns[owner] = data.draw(st.sampled_from(("", "a", "b")), label="namespace")
        self.quota[owner] = data.draw(QUOTA, label="quota")
        self.ids[owner] = core.add_owner(self.ns[owner])
        self.usage[self.ids[owner]] = [0, 0, 0]

    @precondition(lambda self: self.ticks % 6 == 2)
    @rule(data=st.data())
    def release_quarantine(self, data) -> None:
        held = sorted(self.quarantined)
        if held and data.draw(BOOL, label="a_held_one"):
            index = data.draw(st.sampled_from(held), label="held_index")
        else:
            index = data.draw(st.sampled_from([0, *self.ids.values(), *self.gone]), label="index")
        pages = self.quarantined.pop(index, set())
        assert self.core.release_quarantine(index) == len(pages)
        self.free.update(pages)
        self.check_events()

    @precondition(lambda self: self.ticks % 6 == 3)
    @rule()
    def snapshot_events(self) -> None:
        """A resync: AllCleared, then one PagesStored per cached page, parents first;
        replayed, it gives the model's keys, parents, tokens and namespaces."""
        events = self.core.snapshot_events()
        assert isinstance(events[0], AllCleared)
        seen: set[bytes] = set()
        want = {self.kb(*mk): mk for mk in self.cached}
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
        written = [s for s in mine if self.reqs[s].n]
        fresh = [s for s in mine if not self.reqs[s].n]
        with_cached = [s for s in mine if any(p in self.key_of for p in self.reqs[s].pages)]
        theirs = [s for s, r in self.reqs.items() if r.owner != owner]
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
        toks = req.tokens
        if kind in ("release_too_long", "cache_too_long", "truncated_cache_too_long", "match_not_fresh"):
            s = data.draw(st.sampled_from(written), label="written")
            req = self.reqs[s]
            toks = req.script[: req.n + data.draw(st.integers(1, 2), label="extra")]
        if kind in ("differ_release", "differ_cache"):
            s = data.draw(st.sampled_from(with_cached), label="cached_slot")
            req = self.reqs[s]
            toks = list(req.tokens)
            col = data.draw(st.sampled_from([c for c, p in enumerate(req.pages) if p in self.key_of]), label="col")
            pos = col * ps + data.draw(st.integers(0, ps - 1), label="pos")
            toks[pos] = (toks[pos] + 1) % 3
        if kind == "release_too_long":
            b, reason = StepBatch.of(release_slots=[s], release_tokens=[toks]), Reason.ALLOCED_LEN_MISMATCH
        elif kind == "cache_too_long":
            b, reason = StepBatch.of(cache=[(s, toks)]), Reason.ALLOCED_LEN_MISMATCH
        elif kind == "truncated_cache_too_long":
            cut = (req.n - 1) // ps * ps  # a boundary below its length: never PAGE_SHARED
            toks = req.tokens
            b = StepBatch.of(truncate_slots=[s], truncate_lens=[cut], cache=[(s, toks)])
            reason = Reason.ALLOCED_LEN_MISMATCH
        elif kind == "match_not_fresh":
            b, reason = StepBatch.of(match=[(s, toks)]), Reason.ALLOCED_LEN_MISMATCH
        elif kind == "matched_alloc_expected":
            s = data.draw(st.sampled_from(fresh), label="fresh")
            script = self.reqs[s].script
            b = StepBatch.of(match=[(s, script)], alloc_slots=[s], alloc_needs=[1], alloc_expected_lens=[0])
            reason = Reason.BAD_VALUE
        elif kind == "differ_release":
            b, reason = StepBatch.of(release_slots=[s], release_tokens=[toks]), Reason.BAD_VALUE
        elif kind == "differ_cache":
            b, reason = StepBatch.of(cache=[(s, toks)]), Reason.BAD_VALUE
        elif kind == "dup_cache":
            b, reason = StepBatch.of(cache=[(s, toks[:ps]), (s, toks)]), Reason.DUPLICATE_SLOT
        elif kind == "dup_match":
            b, reason = StepBatch.of(match=[(s, req.script), (s, req.script)]), Reason.DUPLICATE_SLOT
            if req.n:
                b = StepBatch.of(truncate_slots=[s], truncate_lens=[0], match=[(s, req.script), (s, req.script)])
        elif kind == "max_negative":
            b = StepBatch.of(truncate_slots=[s], truncate_lens=[0], match=[(s, req.script, -2)])
            reason = Reason.BAD_VALUE
        elif kind == "released_cache":
            b = StepBatch.of(release_slots=[s], cache=[(s, [])])
            reason = Reason.SLOT_NOT_FOUND
        elif kind == "foreign_cache":
            b, reason = StepBatch.of(cache=[(data.draw(st.sampled_from(theirs)), [])]), Reason.SLOT_NOT_FOUND
        else:  # count_mismatch: two cache slots, one token list
            b = StepBatch.of(cache=[(s, toks)])
            b = dataclasses.replace(b, cache_slots=np.array([s, s], dtype=np.int64))
            reason = Reason.LENGTH_MISMATCH
        self.expect_error(owner, reason, b)

    # -------------------------------------------------------------- invariant

    @invariant()
    def agrees_with_the_model(self) -> None:
        core = self.core
        if core is None:
            return
        self.ticks += 1
        ps, cfg = self.ps, self.cfg
        bt = core.block_table
        assert not bt[0].any()
        refs: collections.Counter[int] = collections.Counter()
        for slot in range(1, cfg.max_requests + 1):
            req = self.reqs.get(slot)
            if req is None:
                assert not bt[slot].any(), (slot, bt[slot])
                continue
            assert len(req.pages) == ceil_div(req.n, ps)
            assert bt[slot].tolist() == req.pages + [0] * (self.width - len(req.pages)), (slot, bt[slot], req.pages)
            assert int(core.slots.alloced[slot]) == req.n
            refs.update(req.pages)
            # cached pages form a prefix of the row, cached with the row's tokens
            keyed = [self.key_of.get(p) for p in req.pages]
            for c, mk in enumerate(keyed):
                if mk is not None:
                    assert all(keyed[:c]) and mk == (self.ns[req.owner], tuple(req.tokens[: (c + 1) * ps]))
        assert +refs == +self.ref
        assert core.pool.ref_cnt.tolist() == [refs.get(p, 0) for p in range(cfg.num_pages)]
        # the key index, page metadata, the evictable queue in LRU order
        cache = core.cache
        assert cache.index == {self.kb(*mk): p for mk, p in self.cached.items()}
        for p, (ns, toks) in self.key_of.items():
            assert cache.namespace[p] == ns and cache.tokens[p].tolist() == list(toks[-ps:])
            assert int(cache.depth[p]) == len(toks) // ps - 1
            assert cache.parent[p] == self.kb(ns, toks[:-ps])
        assert set(self.lru) == {p for p in self.key_of if self.ref[p] == 0} and len(set(self.lru)) == len(self.lru)
        assert cache.queued().tolist() == self.lru, (cache.queued().tolist(), self.lru)
        # free stack: the model's free pages, none of them cached
        free = core.pool.free_pages().tolist()
        assert len(set(free)) == len(free) and set(free) == self.free
        assert not any(cache.cached[p] for p in free) and self.free.isdisjoint(self.key_of)
        held = set().union(*self.quarantined.values())
        parts = [set(self.ref), self.free, set(self.lru), held]
        assert sum(map(len, parts)) == cfg.num_pages - 1 and set().union(*parts) == set(range(1, cfg.num_pages))
        # the events replayed give the index's keys, at their depths
        assert self.replay == {k: int(cache.depth[p]) for k, p in cache.index.items()}
        stats = core.stats()
        assert stats.num_free_pages == len(self.free)
        assert stats.num_cached_pages == len(self.lru)
        assert stats.num_quarantined_pages == len(held)
        assert stats.num_used_pages == len(self.ref)
        total = stats.num_free_pages + stats.num_cached_pages + stats.num_used_pages + stats.num_quarantined_pages
        assert total == stats.num_pages_total == cfg.num_pages - 1
        assert stats.num_cache_entries == len(self.cached)
        assert stats.num_evictions == self.evictions
        assert (stats.prefix_query_tokens, stats.prefix_hit_tokens) == (self.query, self.hits)
        assert stats.num_open_requests == len(self.reqs)
        owners = {
            o.owner: (
                o.num_requests,
                o.num_pages_held,
                o.namespace,
                [o.prefix_query_tokens, o.prefix_hit_tokens, o.num_evictions],
            )
            for o in stats.owners
        }
        assert owners == {
            self.ids[n]: (len(self.slots_of(n)), self.held(n), self.ns[n], self.usage[self.ids[n]]) for n in self.names
        }
        for name, quota in self.quota.items():
            if quota is not None and self.held(name) > quota:
                raise AssertionError(f"{name} holds {self.held(name)} pages over its quota {quota}")


# Sized for well under a minute on two slow cores; KVMEM_PREFIX_EXAMPLES=5000 for a long run.
PrefixMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("KVMEM_PREFIX_EXAMPLES") or 500),
    stateful_step_count=50,
    deadline=None,
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
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
