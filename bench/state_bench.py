#!/usr/bin/env python3
"""Benchmark the core's state image (issue 22): what keeping it costs a Step, and how long
taking a core over from it takes.

1. step      -- the Steps of ``core_bench.py`` (256 requests, pages of 16, 4,096 pages)
                on a core that keeps a state image (``KVCore(..., image=...)``, what
                ``kvmem serve --keep-state`` runs) against the same core without one,
                interleaved in short rounds (core_bench's ``measure``: thread CPU time,
                the median of in-round ratios): a decode step (1 token to each request,
                1 in 16 taking a page), a prefill (512 tokens each from 0), a release of
                256 x 512 tokens, and a decode step whose every request also caches its
                full pages (a chunked-prefill Step: the cache's facts are written into
                the image). Target for the decode step: <= 1.05x.
2. adopt     -- restart to ready in the core: ``restore()`` of an image of 100,000 pages of
                16 with 64 owners and 16,000 open requests (6 pages each, one in four
                starting with one of 16 cached 4-page prompts), the audit included,
                against building a fresh core of the same geometry (``KVCore(...)`` with
                an image). Target: <= 1 s. Wall time, once each (a start is once).

Run: ``.venv/bin/python bench/state_bench.py`` (about a minute on 2 cores;
``--quick`` for a smoke run). Exit 2 when a check fails (the adopted state differs from
the one kept, or an audit fails).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from core_bench import CheckFailed, Contender, check, measure, paired_ratio

from kvmem.server.core import CoreConfig, KVCore, StepBatch
from kvmem.server.core.restore import layout_for, restore
from kvmem.server.core.image import CoreImage

PS, N = 16, 256


def core(imaged: bool, num_pages: int = 4096, max_requests: int = N, ctx: int = 8192) -> KVCore:
    cfg = CoreConfig(num_pages, PS, max_requests, ctx)
    image = CoreImage.private(layout_for(cfg)) if imaged else None
    return KVCore(cfg, image=image)


def pair(make: Any, name: str) -> list[Contender]:
    return [make(True, f"{name}, image"), make(False, f"{name}, none")]


class Numbered:
    """A core's Steps as the server makes them: numbered, each committed after it (with
    an image, each is recorded for undo first: see kvmem.server.core.undo)."""

    def __init__(self, c: KVCore) -> None:
        self.c, self.seq = c, 0

    def __call__(self, owner: int, batch: StepBatch) -> Any:
        self.seq += 1
        result = self.c.step(owner, batch, seq=self.seq)
        self.c.commit(self.seq)
        return result


def decode(imaged: bool, name: str) -> Contender:
    c = core(imaged)
    step = Numbered(c)
    o = c.add_owner()
    slots = c.open(o, [f"r{i}" for i in range(N)]).astype(np.int64)
    lens = 100 + np.arange(N, dtype=np.int64) % PS
    step(o, StepBatch(alloc_slots=slots, alloc_needs=lens))
    ones = np.ones(N, dtype=np.int64)

    def after(_: Any) -> None:
        step(o, StepBatch(truncate_slots=slots, truncate_lens=lens))

    return Contender(name, lambda: step(o, StepBatch(alloc_slots=slots, alloc_needs=ones)), after)


def prefill(imaged: bool, name: str) -> Contender:
    c = core(imaged, num_pages=N * 32 + 64)
    step = Numbered(c)
    o = c.add_owner()
    slots = c.open(o, [f"r{i}" for i in range(N)]).astype(np.int64)
    need = np.full(N, 512, dtype=np.int64)
    zero = np.zeros(N, dtype=np.int64)

    def after(_: Any) -> None:
        step(o, StepBatch(truncate_slots=slots, truncate_lens=zero))

    return Contender(name, lambda: step(o, StepBatch(alloc_slots=slots, alloc_needs=need)), after)


def release(imaged: bool, name: str) -> Contender:
    c = core(imaged, num_pages=N * 32 + 64)
    step = Numbered(c)
    o = c.add_owner()
    ids = [f"r{i}" for i in range(N)]
    need = np.full(N, 512, dtype=np.int64)
    state: dict[str, np.ndarray] = {}

    def setup() -> None:
        state["slots"] = c.open(o, ids).astype(np.int64)
        step(o, StepBatch(alloc_slots=state["slots"], alloc_needs=need))

    setup()
    return Contender(name, lambda: step(o, StepBatch(release_slots=state["slots"])), lambda _: setup())


def cache_items(imaged: bool, name: str) -> Contender:
    """A decode step whose requests also cache their first 6 full pages (new keys each time)."""
    c = core(imaged, num_pages=N * 16 + 4096)
    step = Numbered(c)
    o = c.add_owner()
    slots = c.open(o, [f"r{i}" for i in range(N)]).astype(np.int64)
    lens = np.full(N, 100, dtype=np.int64)
    step(o, StepBatch(alloc_slots=slots, alloc_needs=lens))
    ones = np.ones(N, dtype=np.int64)
    rng = np.random.default_rng(0)
    counter = [0]

    def run() -> Any:
        counter[0] += 1
        toks = rng.integers(0, 1 << 20, size=(N, 96)).astype(np.int32)
        items = [(int(s), toks[i]) for i, s in enumerate(slots.tolist())]
        return step(o, StepBatch.of(alloc_slots=slots, alloc_needs=ones, cache=items))

    def after(_: Any) -> None:
        step(o, StepBatch(release_slots=slots))  # the cached pages become evictable
        slots[:] = c.open(o, [f"r{counter[0]}-{i}" for i in range(N)])
        step(o, StepBatch(alloc_slots=slots, alloc_needs=lens))

    return Contender(name, run, after)


def part_step(repeat: int) -> dict[str, float]:
    out = {}
    for name, make in (("decode", decode), ("prefill", prefill), ("release", release), ("decode+cache", cache_items)):
        a, b = pair(make, name)
        measure([a, b], repeat, 3)
        out[name] = paired_ratio(a, b)
        print(f"  {name:>13}: with the image / without = {out[name]:.3f}x "
              f"(medians {np.median(a.times_us):.1f} / {np.median(b.times_us):.1f} µs)")  # fmt: skip
    return out


def part_adopt(num_pages: int, owners: int, requests: int) -> tuple[float, float]:
    cfg = CoreConfig(num_pages, PS, requests, 4096)
    layout = layout_for(cfg, max_owners=owners + 16)
    buf = bytearray(layout.size)
    table = np.zeros(cfg.block_table_shape, dtype=np.int32)
    c = KVCore(cfg, table, image=CoreImage.create(buf, layout))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 1 << 20, size=64).astype(np.int32) for _ in range(16)]
    ids = [c.add_owner(f"ns{i % 4}") for i in range(owners)]
    for o in ids:  # sessions, as Attach keeps them
        c.set_session(o, f"session-id-{o:04d}-" + "x" * 16, f"worker-{o}", None)
    per = requests // owners
    for o in ids:  # a cached prompt per namespace's first requests, then 6 pages a request
        slots = c.open(o, [f"{o}-{i}" for i in range(per)]).astype(np.int64)
        c.step(o, StepBatch(alloc_slots=slots, alloc_needs=np.full(per, 6 * PS)))
        firsts = slots[::4].tolist()
        items = [(int(s), np.concatenate([prompts[(o + i) % 16], [o, i] * 16])) for i, s in enumerate(firsts)]
        c.step(o, StepBatch.of(cache=items))
    kept = (table.copy(), c.slots.alloced.copy(), c.pool.ref_cnt.copy(), dict(c.cache.index), c.stats())
    print(f"  kept: {c.stats().num_open_requests} requests, {c.stats().num_used_pages} pages in use, "
          f"{c.stats().num_cache_entries} cached, {len(ids)} owners")  # fmt: skip
    started = time.perf_counter()
    new, report = restore(cfg, table, buf, max_owners=owners + 16)
    adopt_s = time.perf_counter() - started
    check(report.repaired == (), f"adopt repaired a clean state: {report.repaired}")
    check(np.array_equal(new.block_table, kept[0]) and np.array_equal(new.slots.alloced, kept[1]), "rows/lengths")
    check(np.array_equal(new.pool.ref_cnt, kept[2]) and new.cache.index == kept[3], "counts/cache index")
    check(new.stats().num_free_pages == kept[4].num_free_pages, "free pages")
    check(len([x for x in report.sessions if x.session_id]) == owners, "sessions")
    started = time.perf_counter()
    KVCore(cfg, np.zeros(cfg.block_table_shape, dtype=np.int32), image=CoreImage.create(bytearray(layout.size), layout))
    fresh_s = time.perf_counter() - started
    print(f"  adopt: {adopt_s * 1000:.0f} ms ({report.describe()}); a fresh core: {fresh_s * 1000:.0f} ms")
    return adopt_s, fresh_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=200, help="timed repetitions per contender (default 200)")
    parser.add_argument("--quick", action="store_true", help="20 repetitions and a 10,000-page adoption")
    args = parser.parse_args()
    repeat = 20 if args.quick else args.repeat
    try:
        print("1. Step cost, a core with a state image against one without:")
        ratios = part_step(repeat)
        print("2. restart to ready in the core:")
        adopt_s, _ = part_adopt(*((10_000, 8, 1600) if args.quick else (100_000, 64, 16_000)))
    except CheckFailed as exc:
        print(f"CHECK FAILED: {exc}", file=sys.stderr)
        return 2
    missed = [f"decode {ratios['decode']:.3f}x > 1.05x"] * (ratios["decode"] > 1.05)
    missed += [f"adopt {adopt_s:.2f} s > 1 s"] * (adopt_s > 1.0)
    print(f"missed: {'; '.join(missed)}" if missed else "every target met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
