"""Property test of the cluster tier: two nodes (two cores, each with a host tier and a
store link) share one store that may lose or corrupt anything, and go down and up.

Random interleavings, on either node, of requests that match (on either tier, or from
the store), compute and write their K/V, cache or release into the prefix cache, and
of allocs that evict; and, on the store, values lost, bytes flipped in a value's header
or payload, the store down or back. After every operation both nodes settle (their
store threads and copy threads done, what they handed back taken) and:

* each core audits both its tiers after every call (``audit_every_step``: every page
  free, used, cached or quarantined once; every host page free, cached or being read
  from the store once, the pinned ones exactly those in copy or waiting for their write);
* every running request's K/V on either node, read through its row, is what was written
  for its tokens at their positions (the pattern is a function of the token and the
  position, so a page node B took from node A's write must equal B's own): a value the
  store corrupted is never loaded, a lost one is a miss.

The store here is the simple model of one (``ModelStore``: a dict of values); the real
stores run in tests/store."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tier_properties import BASES, patterns  # the host tier's property test: its prompts, its K/V

from kvmem.client.loads import PageLoads
from kvmem.server.core import AllocStatus, CoreConfig, KVCore, StepBatch
from kvmem.server.core.tier import HostTier
from kvmem.server.memory.geometry import KVGeometry, PoolSpec
from kvmem.server.memory.host import HostPages, planes_of
from kvmem.server.store.base import Parts, Store, StoreError, StoreURL
from kvmem.server.store.link import StoreLink
from kvmem.server.store.value import HEADER_BYTES

PS = 2
GEOMETRY = KVGeometry("mha", num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32", page_size=PS)


class ModelStore(Store):
    """A store as kvmem sees one: values by key, a put that keeps an existing key's
    value, reads into the parts; ``down`` makes every call fail."""

    name = "model"

    def __init__(self) -> None:
        super().__init__(StoreURL.parse("model://store:1"), None, 1.0)
        self.values: dict[str, bytes] = {}
        self.down = False

    def _up(self) -> None:
        if self.down:
            raise StoreError("model store: down")

    def connect(self) -> None:
        self._up()

    def put(self, keys: Sequence[str], values: Sequence[Parts]) -> list[bool]:
        self._up()
        for key, parts in zip(keys, values, strict=True):
            self.values.setdefault(key, b"".join(bytes(p) for p in parts))
        return [True] * len(keys)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._up()
        return [k in self.values for k in keys]

    def get_into(self, keys: Sequence[str], values: Sequence[Parts]) -> list[int]:
        self._up()
        out = []
        for key, parts in zip(keys, values, strict=True):
            value = self.values.get(key)
            if value is None:
                out.append(-1)
                continue
            if len(value) == sum(len(p) for p in parts):
                at = 0
                for part in parts:
                    part[:] = value[at : at + len(part)]
                    at += len(part)
            out.append(len(value))
        return out

    def close(self) -> None:
        pass


class Node:
    """A core with a host tier (write-through, as with a store) and a link to the store."""

    def __init__(self, store: Store, num_pages: int, host_pages: int) -> None:
        spec = PoolSpec(GEOMETRY, num_pages, 8, 10)
        self.raw = np.zeros(spec.kv_bytes, dtype=np.uint8)
        cfg = CoreConfig(num_pages=num_pages, page_size=PS, max_requests=8, max_context_len=10)
        self.mover = HostPages([self.raw], GEOMETRY, num_pages, host_pages)
        self.tier = HostTier(host_pages, PS, self.mover, write_through=True)
        self.link = StoreLink(
            store, self.mover.page, self.mover.buffers(), GEOMETRY, 1, "xxh3-128", None, None,
            max_writes=max(1, host_pages // 2), max_fetch_pages=max(1, host_pages // 4),
        )  # fmt: skip
        self.tier.link = self.link
        self.link.start()
        assert self.link.set_model("model@1") is None
        self.core = KVCore(cfg, audit_every_step=True, host_tier=self.tier, page_bytes=GEOMETRY.page_bytes)
        self.owner = self.core.add_owner()
        self.loads = PageLoads(self.mover.counters, GEOMETRY.num_layers, PS)
        self.slots = self.raw.reshape(planes_of(GEOMETRY), num_pages * PS, -1)
        self.running: dict[int, list[int]] = {}
        self.n = 0

    def settle(self) -> None:
        """Until the store thread and the copy thread are done and what they handed back
        is taken (a fetch goes thread, loop, thread, loop)."""
        for _ in range(20):
            self.link.wait_idle()
            self.mover.wait_idle()
            if not self.link.results and not self.mover.finished:
                return
            self.core.finish_loads()
        raise AssertionError("the store link did not settle")

    def check(self) -> None:
        for slot, toks in self.running.items():
            row = self.core.block_table[slot]
            pages = row[: -(-len(toks) // PS)].astype(np.int64)
            self.loads.wait(pages, timeout=10)
            if not toks:
                continue
            pos = np.arange(len(toks))
            locs = row[pos // PS].astype(np.int64) * PS + pos % PS
            want = patterns(toks, 0, self.slots.shape[0], self.slots.shape[2])
            wrong = np.flatnonzero((self.slots[:, locs] != want).any(axis=(0, 2)))
            assert not wrong.size, (slot, wrong.tolist())

    def start(self, toks: list[int], cache: bool) -> None:
        if len(self.running) >= 6:
            return
        self.n += 1
        (slot,) = self.core.open(self.owner, [f"r{self.n}"]).tolist()
        r = self.core.step(
            self.owner, StepBatch.of(match=[(slot, toks, len(toks) - 1)], alloc_slots=[slot], alloc_needs=[len(toks)])
        )
        matched = int(r.match_lens[0])
        if r.alloc_status.tolist() != [AllocStatus.OK]:
            self.running[slot] = toks[:matched]
            self.release(slot, with_tokens=False)
            return
        self.slots[:, r.kv_loc] = patterns(toks[matched:], matched, self.slots.shape[0], self.slots.shape[2])
        self.running[slot] = list(toks)
        if cache:
            self.core.step(self.owner, StepBatch.of(cache=[(slot, toks)]))

    def release(self, slot: int, with_tokens: bool) -> None:
        toks = self.running.pop(slot)
        self.core.step(self.owner, StepBatch.of(release_slots=[slot], release_tokens=[toks] if with_tokens else None))

    def fill(self, n: int) -> None:
        self.n += 1
        (slot,) = self.core.open(self.owner, [f"f{self.n}"]).tolist()
        self.core.step(self.owner, StepBatch.of(alloc_slots=[slot], alloc_needs=[n], atomic=False))
        self.core.step(self.owner, StepBatch.of(release_slots=[slot]))

    def close(self) -> None:
        self.link.close()
        self.mover.close()


node = st.integers(0, 1)
ops = st.one_of(
    st.tuples(st.just("start"), node, st.integers(0, len(BASES) - 1), st.integers(3, 10), st.booleans()),
    st.tuples(st.just("start"), node, st.integers(0, len(BASES) - 1), st.just(10), st.just(False)),
    st.tuples(st.just("release"), node, st.integers(0, 7), st.booleans()),
    st.tuples(st.just("fill"), node, st.integers(1, 10)),
    st.tuples(st.just("lose"), st.integers(0, 63)),
    st.tuples(st.just("corrupt"), st.integers(0, 63), st.integers(0, HEADER_BYTES + GEOMETRY.page_bytes - 1)),
    st.tuples(st.just("down")),
    st.tuples(st.just("up")),
)


@settings(deadline=None)
@given(st.integers(6, 12), st.integers(2, 10), st.lists(ops, min_size=10, max_size=40))
def test_store_random_interleavings_on_two_nodes_never_load_a_lost_or_corrupted_page(
    num_pages: int, host_pages: int, plan: list
) -> None:
    store = ModelStore()
    nodes = [Node(store, num_pages, host_pages), Node(store, num_pages, host_pages)]
    try:
        for op in plan:
            kind = op[0]
            if kind == "start":
                nodes[op[1]].start(BASES[op[2]][: op[3]], op[4])
            elif kind == "release":
                n = nodes[op[1]]
                if n.running:
                    n.release(sorted(n.running)[op[2] % len(n.running)], op[3] if len(op) > 3 else True)
            elif kind == "fill":
                nodes[op[1]].fill(op[2])
            elif kind == "lose" and store.values:
                del store.values[sorted(store.values)[op[1] % len(store.values)]]
            elif kind == "corrupt" and store.values:
                key = sorted(store.values)[op[1] % len(store.values)]
                value = bytearray(store.values[key])
                value[op[2] % len(value)] ^= 0x5A
                store.values[key] = bytes(value)
            elif kind == "down":
                store.down = True
            elif kind == "up":
                store.down = False
            for n in nodes:
                n.settle()
                n.check()
        for n in nodes:
            n.settle()
            n.core.finish_loads()
            n.check()
            assert n.core.audit().ok
            st_ = n.core.stats().store
            assert st_ is not None and st_["writes_pending"] == 0, st_
    finally:
        for n in nodes:
            n.close()


def test_store_a_fetch_read_but_not_yet_installed_is_still_in_flight_for_a_second_match() -> None:
    """The window between the store thread's read and the loop's install: a match then
    (the scheduler holding the request matches it again) is told the pages are still being
    fetched and asks the store nothing; they are read once. (The thread used to mark them
    done before handing them back, and a match in that moment fetched them a second time.)"""
    store = ModelStore()
    a, b = Node(store, 8, 16), Node(store, 8, 16)  # fetches of up to 4 pages
    try:
        toks = BASES[0][:9]  # 4 full pages
        a.start(toks, True)
        a.settle()
        assert a.link.counters.pages_written == 4

        def match(release: bool = True) -> tuple[int, int, int]:
            (slot,) = b.core.open(b.owner, [f"m{b.n}"]).tolist()
            b.n += 1
            r = b.core.step(b.owner, StepBatch.of(match=[(slot, toks, len(toks) - 1)]))
            if release:
                b.core.step(b.owner, StepBatch.of(release_slots=[slot]))
            return int(r.match_lens[0]), int(r.match_fetching[0]), slot

        # Its release comes later: a Step takes the store's answers first (its lookup's, and
        # the read's), so the read must not be taken before the test holds it.
        *first, slot = match(release=False)
        assert first == [0, 8]  # asked: all of it, not known yet
        b.link.wait_idle()  # the store has 4 pages
        b.core.finish_loads()  # host pages reserved, the read sent
        b.link.wait_idle()  # read and checked: handed back, not installed yet
        held = list(b.link.results)
        assert [k for k, _ in held] == ["fetched"]
        b.link.results.clear()  # a Step in the moment before the loop takes it
        b.core.step(b.owner, StepBatch.of(release_slots=[slot]))
        fetches = b.link.counters.fetches
        assert match()[:2] == (0, 8)
        b.link.wait_idle()
        assert b.link.counters.fetches == fetches  # nothing asked again
        b.link.results.extend(held)
        b.settle()
        assert match()[:2] == (8, 0)
        assert b.link.counters.pages_read == 4
        b.settle()
        assert b.core.audit().ok
    finally:
        a.close()
        b.close()
