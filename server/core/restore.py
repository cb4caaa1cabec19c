"""Restoring a core from a state image (:mod:`.image`) another process wrote:
:func:`restore` reads its facts, repairs what a crash can leave half done, and builds a
core on the same image and block table with the same rows, lengths, request ids,
owners, cached chains and quarantines. What is derived (reference counts, the free and
evictable stacks, the key index, the owners' accounting) is derived again, so a state
cut at any instant comes back consistent: no page lost, none held twice, every row
agreeing with its length, the audit clean.

Repairs, each reported in one line (:attr:`Restoration.repaired`):

* a cached page whose chain is broken (its parent not cached, a key cached twice, a
  depth that does not follow its parent's) is no longer cached, nor its descendants;
* a slot whose owner is unknown, or whose request id is missing or held twice by one
  owner, is closed;
* a row entry past a request's pages is zeroed; a length whose row lacks pages (an
  entry 0 or out of range) is cut to the pages the row has;
* a page that is not cached but in two rows (a Step cut between a release and an alloc
  cannot leave one, but a torn image could) stays in the first row only: the others
  are cut before it;
* a quarantined page that is in a row or cached leaves its quarantine.

Before any of that, a Step the crash cut (its undo record open, not committed: see
:mod:`.undo`) is undone, so that it was not applied at all; :attr:`Restoration.undone`
says so. Each owner's session (its id, name, quota and the number of its last Step
applied) is read back for the server to resume it by (:attr:`Restoration.sessions`).

The free stack keeps its order when it still holds exactly the free pages (a clean
stop); otherwise it is rebuilt, lowest page on top. The same for the free slots.
O(pool + requests * width), once per start.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from kvmem.server.core.config import CoreConfig
from kvmem.server.core.events import CacheEvent
from kvmem.server.core.handoff import HOLDER_NAME
from kvmem.server.core.hashing import PageKeys, XXH3Keys
from kvmem.server.core.image import CoreImage, ImageLayout, ImageMismatch
from kvmem.server.core.kvcore import KVCore
from kvmem.server.core.tier import HostTier
from kvmem.server.core.undo import pending, undo
from kvmem.server.errors import CorruptionError

__all__ = ["DEFAULT_MAX_OWNERS", "Restoration", "RestoredSession", "layout_for", "restore"]

DEFAULT_MAX_OWNERS = 4096


@dataclasses.dataclass(frozen=True, slots=True)
class RestoredSession:
    """A restored owner's session, as its Attach wrote it into the image ("" id: none)."""

    owner: int
    session_id: str
    name: str
    quota_pages: int | None
    cache_namespace: str
    applied_seq: int  # its last Step applied whole


@dataclasses.dataclass(frozen=True, slots=True)
class Restoration:
    """What :func:`restore` took over, and what it repaired."""

    owners: int
    requests: int
    pages_in_rows: int
    cached_pages: int
    quarantined_pages: int
    repaired: tuple[str, ...]
    sessions: tuple[RestoredSession, ...] = ()
    undone: str = ""  # the cut Step undone, described; "" if none was cut

    def describe(self) -> str:
        """One line for the log ("adopted ...": the word of the log and of the wire's ``StateOrigin``)."""
        repaired = f"; repaired: {'; '.join(self.repaired)}" if self.repaired else "; nothing to repair"
        undone = f"; {self.undone}" if self.undone else ""
        return (
            f"adopted {self.owners} owners, {self.requests} open requests holding {self.pages_in_rows} pages, "
            f"{self.cached_pages} cached pages, {self.quarantined_pages} quarantined{undone}{repaired}"
        )


def layout_for(
    config: CoreConfig, page_keys: PageKeys | None = None, max_owners: int = DEFAULT_MAX_OWNERS, host_pages: int = 0
) -> ImageLayout:
    """The image layout of a core of ``config`` keyed by ``page_keys``, with a host
    tier of ``host_pages`` pages (0: none)."""
    key_bytes = len((page_keys or XXH3Keys()).root(""))
    return ImageLayout(
        config.num_pages,
        config.page_size,
        config.max_requests,
        config.max_pages_per_request,
        key_bytes,
        max_owners,
        host_pages,
    )


def restore(
    config: CoreConfig,
    block_table: np.ndarray,
    buffer: Any,
    *,
    page_keys: PageKeys | None = None,
    prefix_cache: bool = True,
    audit_every_step: bool = False,
    event_sink: Callable[[list[CacheEvent]], None] | None = None,
    max_owners: int = DEFAULT_MAX_OWNERS,
    host_tier: HostTier | None = None,
    page_bytes: int = 0,
) -> tuple[KVCore, Restoration]:
    """A core over the image in ``buffer`` and ``block_table`` (the previous process's),
    with its state: see the module's docstring. :class:`ImageMismatch` names what does
    not fit (another geometry or version, not an image); nothing is changed then. The
    caller makes sure no process writes the image any more (the server: the kept
    state's lock, which a running server holds; a pid would not do, pids are reused)."""
    keys = page_keys or XXH3Keys()
    layout = layout_for(config, keys, max_owners, 0 if host_tier is None else host_tier.num_pages)
    old = CoreImage.open(buffer, layout)
    if block_table.shape != config.block_table_shape:
        raise ImageMismatch(
            f"the block table is {block_table.shape}, the image's geometry needs {config.block_table_shape}"
        )
    facts = _Facts(old, block_table, config, keys)
    if host_tier is not None:
        facts.read_tier(old, host_tier)
    core = KVCore(
        config,
        block_table,
        audit_every_step=False,
        prefix_cache=prefix_cache,
        page_keys=keys,
        event_sink=event_sink,
        image=CoreImage.create(buffer, layout),
        host_tier=host_tier,
        page_bytes=page_bytes,
    )
    report = facts.install(core, prefix_cache)
    found = core.audit()
    if not found.ok:
        raise CorruptionError(f"the adopted state fails its audit: {'; '.join(found.problems[:8])}")
    core.audit_every_step = audit_every_step
    return core, report


class _Facts:
    """The old image's facts, copied out (the new image is laid over the same buffer)."""

    def __init__(self, image: CoreImage, block_table: np.ndarray, config: CoreConfig, keys: PageKeys) -> None:
        n_slots = config.max_requests + 1
        self.config, self.keys = config, keys
        self.repaired: list[str] = []
        self.next_owner = image.get("next_owner")
        words, alloced, rid_len = image.slot_word.copy(), image.alloced.copy(), image.rid_len.copy()
        self.rows = block_table.copy()
        flags = image.page_cached.copy()
        cut = pending(image)
        records = np.flatnonzero(image.owner_id > 0)
        self.owners = {int(image.owner_id[r]): image.namespace_name(int(image.owner_ns[r])) for r in records}
        self.undone = ""
        if cut is not None:
            undo(cut, words, alloced, rid_len, self.rows, flags, config.page_size)
            self.undone = cut.describe(int(image.owner_id[cut.record]))
        self.slot_owner = (words[:n_slots] & 0xFFFFFFFF).astype(np.int64)  # the value half of each word
        self.lengths = alloced[:n_slots].astype(np.int64)
        self.rids = [
            image.rid[s, : int(rid_len[s])].tobytes().decode("utf-8", "surrogatepass") if rid_len[s] > 0 else ""
            for s in range(n_slots)
        ]
        self.free_slots = image.free_slots[: image.get("num_free_slots")].copy()
        self.sessions = {
            int(image.owner_id[r]): (*image.session(int(r)), int(image.owner_seq[r])) for r in records.tolist()
        }
        # The hand-off tickets' holder: its tickets were this process's only, so no one can
        # adopt its requests: they are closed (their givers dropped them), the holder forgotten.
        holders = [o for o, s in self.sessions.items() if s[:2] == ("", HOLDER_NAME)]
        held = np.isin(self.slot_owner, holders)
        self.tickets_closed = int(np.count_nonzero(held))
        self.slot_owner[held] = 0
        self.rows[held[: self.rows.shape[0]]] = 0
        self.owners = {o: ns for o, ns in self.owners.items() if o not in holders}
        self.sessions = {o: s for o, s in self.sessions.items() if o not in holders}
        self.cached = np.flatnonzero(flags[1:]) + 1
        c = self.cached
        self.key = [image.page_key[p].tobytes() for p in c.tolist()]
        self.parent = [image.page_parent[p].tobytes() for p in c.tolist()]
        self.depth = image.page_depth[c].copy()
        self.ns = [
            image.namespace_name(int(i)) if 0 <= i < image.get("num_namespaces") else None for i in image.page_ns[c]
        ]
        self.tokens = image.page_tokens[c].copy()
        self.lru = image.page_lru[c].copy()
        self.held_by = image.page_held_by.copy()
        self.free_pages = image.free_pages[: image.get("num_free_pages")].copy()
        # The host tier's (read_tier): its cached pages, and the device pages a cut load left half copied.
        self.host: np.ndarray | None = None
        self.half_loaded = np.zeros(0, dtype=np.int64)
        self.unreadable: set[int] = set()

    # ------------------------------------------------------------- host tier

    def read_tier(self, image: CoreImage, tier: HostTier) -> None:
        """The host tier's facts, and the loads the crash cut: device pages whose load
        counter never reached ``num_layers`` (their K/V half copied). Such a page is
        copied in again from its host page when the host holds its key; else it is
        uncached and the rows holding it are cut before it (its bytes are never read)."""
        hc = np.flatnonzero(image.host_cached)
        self.host = hc
        self.host_key = [image.host_key[p].tobytes() for p in hc.tolist()]
        self.host_parent = [image.host_parent[p].tobytes() for p in hc.tolist()]
        self.host_depth = image.host_depth[hc].copy()
        count = image.get("num_namespaces")
        self.host_ns = [image.namespace_name(int(i)) if 0 <= i < count else None for i in image.host_ns[hc]]
        self.host_tokens = image.host_tokens[hc].copy()
        self.host_lru = image.host_lru[hc].copy()
        counters, layers = tier.mover.counters, tier.mover.num_layers
        self.half_loaded = np.flatnonzero(counters[: self.config.num_pages] < layers)
        self.half_loaded = self.half_loaded[self.half_loaded > 0]

    def _half_loaded(self, keep: np.ndarray) -> tuple[list[int], list[int]]:
        """Of the cached device pages a cut load left half copied: those whose key the
        host tier holds (copied in again after the install: their host pages) and the
        others (uncached here; the rows holding them are cut before them). Returns
        (device pages, host pages) to copy."""
        half = self.half_loaded
        if not half.size:
            return [], []
        assert self.host is not None
        on_host = dict(zip(self.host_key, self.host.tolist(), strict=True))
        position = {int(p): i for i, p in enumerate(self.cached.tolist())}
        device, host, lost = [], [], 0
        for page in half.tolist():
            i = position.get(page)
            if i is None or not keep[i]:
                continue  # not cached (its load's Step was undone): free, never read
            h = on_host.get(self.key[i])
            if h is not None:
                device.append(page)
                host.append(h)
            else:
                keep[i] = False
                self.unreadable.add(page)
                lost += 1
        if device:
            self.repaired.append(f"{len(device)} page(s) a load left half copied copied in again from the host tier")
        if lost:
            self.repaired.append(f"{lost} page(s) a load left half copied, not on the host tier, uncached")
        return device, host

    def _install_tier(self, tier: HostTier, device_keys: set[bytes]) -> None:
        """The host tier's pages whose chains are whole (parents first: a parent a root,
        cached on the device, or kept here), least recently used first."""
        if self.host is None or not self.host.size:
            return
        kept: list[int] = []
        on_host: set[bytes] = set()
        roots: dict[str, bytes] = {}
        for i in np.argsort(self.host_depth, kind="stable").tolist():
            ns, key, parent = self.host_ns[i], self.host_key[i], self.host_parent[i]
            if ns is None or key in on_host:
                continue
            if ns not in roots:
                roots[ns] = self.keys.root(ns)
            ok = parent == roots[ns] if self.host_depth[i] == 0 else parent in on_host or parent in device_keys
            if ok:
                kept.append(i)
                on_host.add(key)
        dropped = self.host.size - len(kept)
        if dropped:
            self.repaired.append(f"{dropped} host-tier page(s) of broken chains dropped")
        pos = chain_safe_order(
            [self.host_key[i] for i in kept],
            [self.host_parent[i] for i in kept],
            self.host_depth[kept],
            self.host_lru[kept],
        )
        order = [kept[i] for i in pos.tolist()]
        tier.install(
            self.host[order],
            [self.host_key[i] for i in order],
            [self.host_parent[i] for i in order],
            [str(self.host_ns[i]) for i in order],
            self.host_tokens[order],
            self.host_depth[order],
        )

    # ------------------------------------------------------------------ cache

    def _chains(self) -> np.ndarray:
        """The cached pages whose chains are whole (a mask over ``self.cached``)."""
        n = self.cached.size
        keep = np.zeros(n, dtype=bool)
        where: dict[bytes, int] = {}  # key -> its position among the kept
        roots: dict[str, bytes] = {}
        dropped = 0
        for i in np.argsort(self.depth, kind="stable").tolist():
            ns, key, parent, depth = self.ns[i], self.key[i], self.parent[i], int(self.depth[i])
            if ns is None or key in where:
                dropped += 1
                continue
            if ns not in roots:
                roots[ns] = self.keys.root(ns)
            if depth == 0:
                ok = parent == roots[ns]
            else:
                up = where.get(parent)
                ok = up is not None and int(self.depth[up]) == depth - 1 and self.ns[up] == ns
            if ok:
                keep[i] = True
                where[key] = i
            else:
                dropped += 1
        if dropped:
            self.repaired.append(f"{dropped} cached page(s) of broken chains uncached")
        return keep

    # ------------------------------------------------------------------- rows

    def _requests(self, cached_mask: np.ndarray) -> np.ndarray:
        """The slots kept open, their rows and lengths repaired in place."""
        ps, num_pages = self.config.page_size, self.config.num_pages
        width = self.rows.shape[1]
        slot_owner, lengths, rows = self.slot_owner, self.lengths, self.rows
        slot_ids = np.arange(slot_owner.size)
        closing = (slot_owner != 0) & ~np.isin(slot_owner, list(self.owners))
        closing[0] = slot_owner[0] != 0
        seen: set[tuple[int, str]] = set()
        for s in np.flatnonzero(slot_owner).tolist():
            key = (int(slot_owner[s]), self.rids[s])
            if not self.rids[s] or key in seen:
                closing[s] = True
            seen.add(key)
        if self.tickets_closed:
            self.repaired.append(f"{self.tickets_closed} hand-off ticket(s) not adopted released (not kept)")
        if np.count_nonzero(closing):
            self.repaired.append(f"{int(np.count_nonzero(closing))} request slot(s) of unknown owners or ids closed")
        slot_owner[closing] = 0
        lengths[slot_owner == 0] = 0
        open_slots = slot_ids[slot_owner != 0]
        lengths[:] = np.clip(lengths, 0, width * ps)
        valid = (rows > 0) & (rows < num_pages)
        need = (lengths + ps - 1) // ps
        have = np.where(valid.all(axis=1), width, np.argmin(valid, axis=1))  # leading valid entries
        short = (need > have) & (slot_owner != 0)
        if np.count_nonzero(short):
            self.repaired.append(f"{int(np.count_nonzero(short))} length(s) cut to the pages their rows hold")
            lengths[short] = have[short] * ps
        self._one_row_per_page(open_slots, cached_mask)
        self._cut_unreadable(open_slots)
        need = (lengths + ps - 1) // ps
        past = np.arange(width)[None, :] >= need[:, None]
        stray = past & (rows != 0)
        if np.count_nonzero(stray):
            self.repaired.append(f"{int(np.count_nonzero(stray))} row entries past their requests' pages zeroed")
        rows[past] = 0
        return open_slots

    def _one_row_per_page(self, open_slots: np.ndarray, cached_mask: np.ndarray) -> None:
        ps, num_pages = self.config.page_size, self.config.num_pages
        lengths, rows = self.lengths, self.rows
        is_cached = np.zeros(num_pages, dtype=bool)
        is_cached[self.cached[cached_mask]] = True
        owner: dict[int, int] = {}
        cut = 0
        for s in open_slots.tolist():
            n = -(-int(lengths[s]) // ps)
            for col, page in enumerate(rows[s, :n].tolist()):
                if is_cached[page]:
                    continue
                if page in owner:
                    lengths[s] = col * ps
                    cut += 1
                    break
                owner[page] = s
        if cut:
            self.repaired.append(f"{cut} row(s) cut before a page another row holds")

    def _cut_unreadable(self, open_slots: np.ndarray) -> None:
        """Rows holding a page a cut load left half copied (and the host tier lost)
        end before it: its bytes are never read."""
        bad = self.unreadable
        if not bad:
            return
        ps, cut = self.config.page_size, 0
        for s in open_slots.tolist():
            n = -(-int(self.lengths[s]) // ps)
            for col, page in enumerate(self.rows[s, :n].tolist()):
                if page in bad:
                    self.lengths[s] = col * ps
                    cut += 1
                    break
        if cut:
            self.repaired.append(f"{cut} row(s) cut before a page a load left half copied")

    # ---------------------------------------------------------------- install

    def install(self, core: KVCore, prefix_cache: bool) -> Restoration:
        config, ps = self.config, self.config.page_size
        keep = self._chains() if prefix_cache else np.zeros(self.cached.size, dtype=bool)
        if not prefix_cache and self.cached.size:
            self.repaired.append(f"{self.cached.size} cached page(s) dropped: this server runs without a prefix cache")
        recopy = self._half_loaded(keep)
        open_slots = self._requests(keep)
        lengths = self.lengths[open_slots]
        need = (lengths + ps - 1) // ps
        rows = self.rows[open_slots]
        in_rows = rows[np.arange(rows.shape[1])[None, :] < need[:, None]]
        ref = np.bincount(in_rows, minlength=config.num_pages)[: config.num_pages]
        ref[0] = 0
        owners = sorted((o, ns) for o, ns in self.owners.items())
        next_owner = max([self.next_owner, *(o + 1 for o, _ in owners)])
        free_slots = _keep_order(self.free_slots, np.setdiff1d(np.arange(1, config.max_requests + 1), open_slots))
        core.slots.install(
            owners,
            next_owner,
            open_slots,
            self.slot_owner[open_slots],
            lengths,
            rows,
            [self.rids[s] for s in open_slots.tolist()],
            free_slots,
        )
        cached = self.cached[keep]
        is_cached = np.zeros(config.num_pages, dtype=bool)
        is_cached[cached] = True
        held_by = self.held_by
        bad_hold = (held_by != 0) & ((ref > 0) | is_cached)
        if np.count_nonzero(bad_hold):
            self.repaired.append(f"{int(np.count_nonzero(bad_hold))} quarantined page(s) in use or cached released")
            held_by[bad_hold] = 0
        held_by[0] = 0
        free = np.flatnonzero((ref == 0) & ~is_cached & (held_by == 0))
        free = free[free > 0].astype(np.int32)
        core.pool.install(ref, _keep_order(self.free_pages, free[::-1]), int(np.count_nonzero(held_by)))
        quarantine: dict[int, list[np.ndarray]] = {}
        for owner in np.unique(held_by[held_by != 0]).tolist():
            quarantine[int(owner)] = [np.flatnonzero(held_by == owner).astype(np.int32)]
        core.install_quarantine(quarantine)
        sessions = []
        for owner, namespace in owners:
            sid, name, quota, seq = self.sessions[owner]
            core.set_session(owner, sid, name, quota)
            core.install_seq(owner, seq)
            sessions.append(RestoredSession(owner, sid, name, quota, namespace, seq))
        if cached.size:
            kept = np.flatnonzero(keep)
            order = chain_safe_order(
                [self.key[i] for i in kept], [self.parent[i] for i in kept], self.depth[keep], self.lru[keep]
            )
            evictable = cached[order][ref[cached[order]] == 0]
            core.cache.install(
                cached,
                [self.key[i] for i in kept],
                [self.parent[i] for i in kept],
                self.depth[keep],
                [str(self.ns[i]) for i in kept],
                self.tokens[keep],
                evictable.astype(np.int32),
            )
        tier = core.host_tier
        if tier is not None and self.host is not None:
            self._install_tier(tier, set(core.cache.index))
            device, host = recopy
            if device:  # now, before anyone reads them (the server does not serve yet)
                tier.mover.copy_now(np.array(host, dtype=np.int64), np.array(device, dtype=np.int64))
            tier.mover.counters[:] = tier.mover.num_layers
        return Restoration(
            len(owners),
            int(open_slots.size),
            int(in_rows.size),
            int(cached.size),
            int(np.count_nonzero(held_by)),
            tuple(self.repaired),
            tuple(sessions),
            self.undone,
        )


def chain_safe_order(keys: list[bytes], parents: list[bytes], depth: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """An eviction order (least recently used first) of cached pages in which a page
    never comes before a descendant of it: each page's last use, lifted to its latest
    descendant's, then deeper pages first among equals. The order a running server keeps
    (a parent is used whenever its child is), but a restored state may not carry it
    whole: pages a row or a load held had no place in the queue when the process
    ended. Returns positions. O(n log n), once per start."""
    eff = seq.astype(np.int64).copy()
    where = {key: i for i, key in enumerate(keys)}
    for i in np.argsort(-depth, kind="stable").tolist():  # children before their parents
        up = where.get(parents[i])
        if up is not None and eff[up] < eff[i]:
            eff[up] = eff[i]
    return np.lexsort((-depth.astype(np.int64), eff))


def _keep_order(old: np.ndarray, want: np.ndarray) -> np.ndarray:
    """``old`` (a stack as it was) when it holds exactly the elements of ``want``, else ``want``."""
    if old.size == want.size and np.array_equal(np.sort(old), np.sort(want)):
        return old.astype(want.dtype)
    return want
