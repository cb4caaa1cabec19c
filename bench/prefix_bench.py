#!/usr/bin/env python3
"""Benchmark kvmem's prefix cache (issue 12): match cost, its effect on decode, and
the pages two schedulers save by sharing one system prompt.

Scenarios (pages of 16 tokens):

1. match    -- a 4,096-token prompt (256 pages) matched in full against a warm cache of
               100,000 pages (chains of 16..256 pages of random tokens, one of them the
               prompt), hashing included. Timed: the server's own path for one Step with
               one match item, from the deserialised StepRequest on
               (``kvmem.server.edge.wire.step_batch``, then ``KVCore.step``: keys of the 256
               pages, the index lookups, the row write, the page references). Not timed:
               the release of the slot without tokens and its re-open, which put the
               state back (the 256 pages become evictable again), so every repetition is
               the same match. Baseline in the same run, interleaved: vLLM v1's default
               block hashing of the same prompt (its ``sha256`` recipe: per block
               ``sha256(pickle.dumps((parent_hash, tuple(block_tokens), None)))``,
               chained from a 32-byte seed hash, slicing the token list and building the
               tuple as vLLM's loop does). Target: kvmem's match <= 0.5x that baseline.
               Informational rows: kvmem's page keys alone (xxh3-128 of the 256 pages),
               and the match over the unix socket (a ``kvmem serve --device none``
               subprocess, filled the same way through the client; timed: the
               ``KVMemClient.step(match=...)`` round trip, wall clock), against the same
               baseline timed in wall clock in the same rounds, against a Step with no
               items (the bare round trip) and against a match of 4,096 tokens that
               misses at its first page (the same request size: what the transfer of
               16 KiB of token ids costs), all interleaved.
2. decode   -- one Step allocating 1 token to each of 256 requests holding 100 + i % 16
               tokens (1 in 16 opens a new page, as in core_bench.py), on a core whose
               prefix cache holds 100,000 evictable pages and whose free stack serves
               the new pages, against the same Step on a core with the prefix cache off.
               Target: <= 1.05x.
3. evict    -- the same Step when the free stack is empty, so every page the allocs take
               is evicted from the cache (16 per Step), against scenario 2's cache-on
               core with a free pool. Target: <= 1.3x.
               What each timed repetition of 2 and 3 contains: exactly one decode Step
               (the batch built inside the timed call, as core_bench.py does). After it,
               untimed and the same on all three cores: a truncate Step back to the
               starting lengths (the Step's 16 new pages are uncached: they go to the
               free stack), then a "sink" request allocs 256 tokens and so takes those
               16 pages for good (a new sink request every 16 times). The evicting
               core's free stack is thus empty before every timed Step (checked), each
               of its Steps evicts exactly 16 pages (checked; 16 x the Steps run, out of
               a cache of 100,000+) and the other cores evict none (checked); the
               pool leaves room for the pages the sinks take. The after-work inserts
               nothing into the cache: a version whose after-work released a filler
               request with tokens (a cache insert per repetition) slowed the next Step
               on every core by 3-4 µs, the cache-on core's more, which measured the
               after-work's cache footprint rather than the Step.
4. sharing  -- two schedulers (two owners in one namespace), each admitting 32 requests
               of one 2,048-token system prompt plus a distinct 20-token suffix. With the
               cache: the first scheduler's first request allocs its prompt and caches it
               with a cache item (chunked-prefill style); every other request (31 of the
               first scheduler, 32 of the second) matches with ``len - 1`` tokens (one
               token left to compute) and allocs the rest in the same Step. Without: the same requests on
               a core with the prefix cache off. Reported: the pages in use (held by any
               request) in both, their ratio, and the system prompt's copies in each
               (expected: 1 instead of 64).

Timing: each scenario's contenders take turns in short rounds (each runs 2 untimed then
5 timed repetitions, who goes first alternating), with the garbage collector off; a
ratio is the median over rounds of the ratio of the two contenders' medians within the
round (milliseconds apart, so a shared machine's drift cancels); the spread shown is the
interquartile range of those in-round ratios. In-process times are the thread's CPU time
(``--clock``); the socket row is wall time, as a round trip has to be.

Checks (a failure exits 2): full match lengths and the matched row equal to the cached
chain's pages; kvmem's keys equal to the ones the fill inserted; the decode kv_loc
against the block table; eviction counts; audits before and after timing; the page
counts of scenario 4 against their closed form.

Exit status: 0 (a measurement, not a test) unless ``--strict`` and a target is missed
(1), or a check or the server fails (2).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import pathlib
import pickle
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

BENCH_DIR = pathlib.Path(__file__).resolve().parent
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))
from _table import render  # noqa: E402

from kvmem.server.core import CoreConfig, KVCore, StepBatch  # noqa: E402
from kvmem.server.core.batch import TokenLists  # noqa: E402
from kvmem.server.core.hashing import XXH3Keys  # noqa: E402
from kvmem.server.process.tuning import keep_freed_memory  # noqa: E402
from kvmem.server.edge.wire import step_batch  # noqa: E402
from kvmem.v1 import kvmem_pb2  # noqa: E402

PAGE_SIZE = 16
PROMPT_TOKENS = 4096  # the matched prompt: 256 pages
PROMPT_PAGES = PROMPT_TOKENS // PAGE_SIZE
MAX_CONTEXT_LEN = 4096
MAX_REQUESTS = 512
CHAIN_PAGES = (16, 256)  # fill chains: lengths drawn in this range (pages)
FILL_BATCH = 64  # fill requests per Step
NUM_DECODE = 256
DECODE_BASE_LEN = 100  # decode request i holds 100 + i % 16 tokens
SINK_TOKENS = 256  # scenarios 2-3: the untimed sink alloc after each Step takes 16 pages
SYSTEM_PROMPT_TOKENS = 2048
SUFFIX_TOKENS = 20
SHARING_REQUESTS = 32  # per scheduler
SHARING_SCHEDULERS = 2
VOCAB = 150_000  # fill tokens are drawn below this; filler tokens lie far above it
OWNER_NS = ""  # the shared default namespace

TARGETS: dict[str, tuple[str, float, str] | None] = {
    # key: (comparison, value, what the ratio is); None: informational
    "match": ("<=", 0.5, "kvmem match Step / vLLM v1 block hashing of the same prompt"),
    "match_keys": None,
    "match_socket": None,
    "match_socket_rtt": None,
    "match_socket_miss": None,
    "decode_cache_on": ("<=", 1.05, "decode Step, cache on (warm, free pool) / cache off"),
    "decode_evict": ("<=", 1.3, "decode Step, every alloc evicts / cache on, free pool"),
    "decode_evict_vs_off": None,
    "sharing": None,  # judged on prompt copies, see sharing_verdict
}


class CheckFailed(AssertionError):
    pass


def check(cond: bool, what: str) -> None:
    if not cond:
        raise CheckFailed(what)


# --------------------------------------------------------------------------- timing

CLOCKS = {"cpu": time.thread_time_ns, "wall": time.perf_counter_ns}
ROUND = 5  # timed repetitions of one contender in a row, per round
ROUND_WARMUP = 2  # untimed repetitions that open each contender's turn in a round


@dataclass
class Contender:
    """``run()`` is timed; ``after(result)`` (untimed) checks it and puts the state back
    for the next repetition. ``rounds`` holds the timings round by round."""

    name: str
    run: Callable[[], Any]
    after: Callable[[Any], None]
    rounds: list[list[float]] = field(default_factory=list)

    @property
    def times_us(self) -> list[float]:
        return [t for r in self.rounds for t in r]


def measure(contenders: list[Contender], repeat: int, warmup: int, clock_name: str) -> None:
    """``warmup`` untimed repetitions each, then rounds until ``repeat`` timed ones each:
    in a round every contender in turn (who goes first alternates) runs ROUND_WARMUP
    untimed then up to ROUND timed repetitions. Garbage collector off throughout."""
    clock = CLOCKS[clock_name]

    def once(c: Contender, into: list[float] | None) -> None:
        t0 = clock()
        out = c.run()
        t1 = clock()
        c.after(out)
        out = None  # freed here, untimed
        if into is not None:
            into.append((t1 - t0) / 1e3)

    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        for c in contenders:
            for _ in range(warmup):
                once(c, None)
        done = k = 0
        while done < repeat:
            per = min(ROUND, repeat - done)
            for c in contenders if k % 2 == 0 else contenders[::-1]:
                times: list[float] = []
                for _ in range(ROUND_WARMUP):
                    once(c, None)
                for _ in range(per):
                    once(c, times)
                c.rounds.append(times)
            done += per
            k += 1
    finally:
        if was:
            gc.enable()


def round_ratios(num: Contender, den: Contender) -> list[float]:
    return [statistics.median(a) / statistics.median(b) for a, b in zip(num.rounds, den.rounds, strict=True)]


def quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def ratio_summary(num: Contender, den: Contender) -> dict[str, Any]:
    r = round_ratios(num, den)
    return {
        "ratio": statistics.median(r),
        "q1": quantile(r, 0.25),
        "q3": quantile(r, 0.75),
        "min": min(r),
        "max": max(r),
        "rounds": len(r),
        "ratio_of_medians": statistics.median(num.times_us) / statistics.median(den.times_us),
    }


def summary(times_us: list[float]) -> dict[str, float]:
    s = sorted(times_us)
    return {"median": statistics.median(s), "min": s[0], "p90": quantile(s, 0.9), "n": len(s)}


# ------------------------------------------------------------------- vLLM baseline

VLLM_SEED_HASH = hashlib.sha256(b"prefix_bench: vLLM NONE_HASH stand-in").digest()  # 32 bytes


def vllm_block_hashes(token_ids: list[int], block_size: int = PAGE_SIZE) -> list[bytes]:
    """vLLM v1's block hashes of a request's full blocks by its default ``sha256``
    recipe (``hash_block_tokens`` with ``sha256`` = SHA-256 of the pickled object):
    per full block, ``sha256(pickle.dumps((parent_hash, tuple(block_tokens), extra_keys)))``
    with ``extra_keys`` None, chained from NONE_HASH (a 32-byte hash). The token ids
    are a list, as a vLLM request holds them; each block is a list slice made a tuple,
    as vLLM's per-block loop does."""
    sha256, dumps, proto = hashlib.sha256, pickle.dumps, pickle.HIGHEST_PROTOCOL
    parent = VLLM_SEED_HASH
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        parent = sha256(dumps((parent, tuple(block), None), protocol=proto)).digest()
        hashes.append(parent)
    return hashes


# ----------------------------------------------------------------- state builders


def new_core(num_pages: int, prefix_cache: bool) -> KVCore:
    return KVCore(CoreConfig(num_pages, PAGE_SIZE, MAX_REQUESTS, MAX_CONTEXT_LEN), prefix_cache=prefix_cache)


def chain_lengths(rng: np.random.Generator, total_pages: int) -> list[int]:
    """Chain lengths (pages) drawn from CHAIN_PAGES that add up to ``total_pages``."""
    out: list[int] = []
    left = total_pages
    while left > 0:
        n = min(int(rng.integers(CHAIN_PAGES[0], CHAIN_PAGES[1] + 1)), left)
        out.append(n)
        left -= n
    return out


def fill_cache(
    core: KVCore, owner: int, rng: np.random.Generator, lengths: list[int], tag: str,
    first: np.ndarray | None = None,
) -> np.ndarray | None:  # fmt: skip
    """Cache chains of ``lengths`` pages (random tokens below VOCAB) the way a scheduler
    does: open requests, alloc their tokens, release them with their tokens. With
    ``first`` (tokens), the first chain is those tokens, and the pages its request held
    are returned (the rows a full match of it must reproduce)."""
    first_row = None
    k = 0
    for b in range(0, len(lengths), FILL_BATCH):
        batch = lengths[b : b + FILL_BATCH]
        slots = core.open(owner, [f"{tag}-{k + i}" for i in range(len(batch))]).astype(np.int64)
        toks = [rng.integers(0, VOCAB, size=n * PAGE_SIZE, dtype=np.int32) for n in batch]
        if b == 0 and first is not None:
            check(first.size == batch[0] * PAGE_SIZE, "fill: the first chain's length")
            toks[0] = first
        needs = np.array([t.size for t in toks], dtype=np.int64)
        res = core.step(owner, StepBatch(alloc_slots=slots, alloc_needs=needs))
        check(bool((res.alloc_status == 0).all()), f"fill {tag}: alloc failed (pool too small?)")
        if b == 0 and first is not None:
            first_row = core.block_table[slots[0], : batch[0]].copy()
        res = core.step(owner, StepBatch(release_slots=slots, release_tokens=TokenLists.of(toks)))
        k += len(batch)
    return first_row


def machine_info() -> dict[str, Any]:
    import xxhash

    model = None
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = None
    return {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "xxhash": xxhash.VERSION,
        "cpu_model": model or platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
    }


# ------------------------------------------------------------------- scenario 1


@dataclass
class Sizes:
    cache_pages: int  # the warm cache of scenarios 1-3
    repeat: int
    warmup: int


def match_request(slot: int, prompt: np.ndarray) -> kvmem_pb2.StepRequest:
    """The StepRequest a client sends for one match item, as the server has it after
    deserialising (the bytes fields as gRPC hands them over)."""
    return kvmem_pb2.StepRequest(
        session_id="bench",
        match_slots=[slot],
        match_token_ids=prompt.astype("<i4").tobytes(),
        match_token_offsets=np.array([0, prompt.size], dtype="<i4").tobytes(),
    )


def scenario_match(sizes: Sizes, clock: str, say: Callable[..., None]) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, VOCAB, size=PROMPT_TOKENS, dtype=np.int32)
    lengths = [PROMPT_PAGES, *chain_lengths(rng, sizes.cache_pages - PROMPT_PAGES)]
    core = new_core(sizes.cache_pages + 8192, prefix_cache=True)
    owner = core.add_owner(OWNER_NS)
    t = time.perf_counter()
    row = fill_cache(core, owner, rng, lengths, "fill", first=prompt)
    assert row is not None
    stats = core.stats()
    check(
        stats.num_cached_pages == sizes.cache_pages,
        f"match: {stats.num_cached_pages} pages cached, not {sizes.cache_pages}",
    )
    say(f"  cache filled: {stats.num_cached_pages:,} pages in {len(lengths)} chains ({time.perf_counter() - t:.1f} s)")

    keys = XXH3Keys()
    root = keys.root(OWNER_NS)
    own_keys = list(keys.keys(OWNER_NS, root, prompt, PROMPT_PAGES, PAGE_SIZE))
    check([core.cache.index.get(k) for k in own_keys] == row.tolist(), "match: the prompt's keys map to other pages")

    slot_box = [int(core.open(owner, ["prompt"])[0])]
    request = match_request(slot_box[0], prompt)

    def kv_run() -> Any:
        return core.step(owner, step_batch(request))

    def kv_after(res: Any) -> None:
        slot = slot_box[0]
        check(res.match_lens.size == 1 and int(res.match_lens[0]) == PROMPT_TOKENS, "match: not a full match")
        check(np.array_equal(core.block_table[slot, :PROMPT_PAGES], row), "match: the row is not the cached chain")
        core.step(owner, StepBatch(release_slots=np.array([slot], dtype=np.int64)))  # no tokens: nothing to insert
        again = int(core.open(owner, ["prompt"])[0])
        if again != slot:  # the freed slot is normally handed out again; rebuild the request if not
            slot_box[0] = again
            request.match_slots[0] = again

    token_list = prompt.tolist()
    expect_vllm = vllm_block_hashes(token_list)
    check(len(expect_vllm) == PROMPT_PAGES and len(set(expect_vllm)) == PROMPT_PAGES, "vLLM hashes")

    def vllm_after(out: Any) -> None:
        check(out == expect_vllm, "vLLM hashes are not deterministic")

    def keys_run() -> Any:
        return list(keys.keys(OWNER_NS, root, prompt, PROMPT_PAGES, PAGE_SIZE))

    def keys_after(out: Any) -> None:
        check(out == own_keys, "kvmem keys differ")

    check(core.audit().ok, "match: audit before timing")
    kv = Contender("kvmem match", kv_run, kv_after)
    vl = Contender("vLLM hashing", lambda: vllm_block_hashes(token_list), vllm_after)
    ks = Contender("kvmem keys", keys_run, keys_after)
    measure([kv, vl, ks], sizes.repeat, sizes.warmup, clock)
    report = core.audit()
    check(report.ok, f"match: audit after timing: {report.problems}")
    check(core.stats().num_cached_pages == sizes.cache_pages, "match: cached pages changed while timing")
    return {
        "contenders": {c.name: c for c in (kv, vl, ks)},
        "cache_pages": sizes.cache_pages,
        "chains": len(lengths),
        "prompt": prompt,
        "lengths": lengths,
        "checked": "full match (4,096 tokens), row = the cached chain's pages, keys = the inserted ones, "
        "vLLM hashes deterministic and distinct, audit before and after",
    }


# --------------------------------------------------------- scenario 1 over the socket


def scenario_match_socket(sizes: Sizes, m: dict[str, Any], say: Callable[..., None]) -> dict[str, Any]:
    """The match of scenario 1 through a ``kvmem serve`` subprocess and the client."""
    from rpc_bench import BenchFailed, Servers

    from kvmem.client import KVMemClient

    class PrefixServer(Servers):
        """Only the kvmem server (no echo), with no KV memory (``--device none``): the
        pool is page ids only, as in-process."""

        def start(self) -> None:
            env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}
            cmd = [
                sys.executable, "-m", "kvmem.cli", "serve",
                "--socket", self.kv_socket, "--device", "none",
                "--num-pages", str(self.num_pages), "--page-size", str(PAGE_SIZE),
                "--max-requests", str(MAX_REQUESTS), "--max-context", str(MAX_CONTEXT_LEN),
                "--log-level", "warning",
            ]  # fmt: skip
            import subprocess

            log = self.dir / "kvmem.log"
            self.logs["kvmem"] = log
            with open(log, "wb") as out:
                self.procs["kvmem"] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env)
            self._wait_ready("kvmem", self.kv_socket, "kvmem.v1.KVMemory")

    prompt: np.ndarray = m["prompt"]
    lengths: list[int] = m["lengths"]
    server = PrefixServer(sizes.cache_pages + 8192)
    client = None
    try:
        t = time.perf_counter()
        server.start()
        say(f"  server up ({time.perf_counter() - t:.1f} s); filling {sizes.cache_pages:,} pages through the client")
        client = KVMemClient(f"unix:{server.kv_socket}", name="prefix-bench")
        rng = np.random.default_rng(2)
        k = 0
        for b in range(0, len(lengths), FILL_BATCH // 2):
            batch = lengths[b : b + FILL_BATCH // 2]
            slots = client.open([f"fill-{k + i}" for i in range(len(batch))])
            toks = [rng.integers(0, VOCAB, size=n * PAGE_SIZE, dtype=np.int32) for n in batch]
            if b == 0:
                toks[0] = prompt
            res = client.step(alloc_slots=slots, alloc_needs=[t.size for t in toks])
            check(res.ok, "socket fill: alloc failed")
            client.release(slots, toks)
            k += len(batch)
        st = client.stats()
        check(st.num_cached_pages == sizes.cache_pages, f"socket: {st.num_cached_pages} pages cached")
        say(f"  filled ({time.perf_counter() - t:.1f} s since start)")

        slot_box = [int(client.open(["prompt"])[0])]

        def run() -> Any:
            return client.step(match=[(slot_box[0], prompt)])

        def after(res: Any) -> None:
            check(res.match_lens.numel() == 1 and int(res.match_lens[0]) == PROMPT_TOKENS, "socket: not a full match")
            client.release([slot_box[0]])
            slot_box[0] = int(client.open(["prompt"])[0])

        def empty_after(res: Any) -> None:
            check(res.ok and res.kv_loc.numel() == 0, "socket: the empty Step")

        # A prompt that misses at its first page: the same request size and round trip,
        # one page hashed, nothing attached (the slot stays fresh: nothing to undo).
        stranger = np.full(PROMPT_TOKENS, VOCAB + 7, dtype=np.int32)

        def miss_after(res: Any) -> None:
            check(res.match_lens.numel() == 1 and int(res.match_lens[0]) == 0, "socket: the miss matched")

        token_list = prompt.tolist()
        kv = Contender("kvmem match, socket", run, after)
        vl = Contender("vLLM hashing (wall)", lambda: vllm_block_hashes(token_list), lambda out: None)
        rtt = Contender("empty Step, socket", lambda: client.step(), empty_after)
        miss = Contender("match miss, socket", lambda: client.step(match=[(slot_box[0], stranger)]), miss_after)
        measure([kv, vl, rtt, miss], sizes.repeat, sizes.warmup, "wall")
        st = client.stats(audit=True)
        check(st.num_cached_pages == sizes.cache_pages, "socket: cached pages changed while timing")
        check(st.audit.ran and st.audit.ok, f"socket: server audit: {list(st.audit.problems)}")
        server.check_alive()
        return {
            "contenders": {c.name: c for c in (kv, vl, rtt, miss)},
            "checked": "full match each repetition, the cache's size unchanged, server audit after timing",
        }
    except BenchFailed as exc:
        raise CheckFailed(str(exc)) from None
    finally:
        if client is not None:
            client.close()
        server.stop()


# ------------------------------------------------------------- scenarios 2 and 3


def decode_lens() -> np.ndarray:
    return DECODE_BASE_LEN + (np.arange(NUM_DECODE, dtype=np.int64) % PAGE_SIZE)


class DecodeCore:
    """A core with 256 decode requests and a warm cache (or the cache off). ``mode``:
    ``off`` (prefix cache off, same fill: released pages are simply freed), ``free``
    (cache on, ``cache_pages`` evictable, a free stack that serves every Step), ``evict``
    (cache on, every free page cached: an empty free stack).

    After each timed Step (:meth:`after`, untimed, the same on every core): a truncate
    Step back to the starting lengths, whose 16 freed pages (new, uncached) a sink
    request then takes with an alloc of 256 tokens, so the free stack never regains
    them: on the evicting core it stays empty and every Step evicts, on the others it
    shrinks by 16 pages an iteration (the pool has room for the run)."""

    def __init__(self, mode: str, num_pages: int, cache_pages: int, seed: int) -> None:
        self.mode = mode
        self.core = core = new_core(num_pages, prefix_cache=mode != "off")
        self.owner = core.add_owner(OWNER_NS)
        self.lens = decode_lens()
        self.ones = np.ones(NUM_DECODE, dtype=np.int64)
        self.slots = core.open(self.owner, [f"dec-{i}" for i in range(NUM_DECODE)]).astype(np.int64)
        res = core.step(self.owner, StepBatch(alloc_slots=self.slots, alloc_needs=self.lens))
        check(bool((res.alloc_status == 0).all()), "decode setup alloc")
        rng = np.random.default_rng(seed)
        fill = core.pool.num_free if mode == "evict" else cache_pages
        fill_cache(core, self.owner, rng, chain_lengths(rng, fill), "fill")
        self.crossers = int(np.count_nonzero(self.lens % PAGE_SIZE == 0))
        self.sink = np.zeros(1, dtype=np.int64)  # the sink request's slot
        self.sink_len = MAX_CONTEXT_LEN  # full: the first sink() opens one
        self.num_sinks = 0
        self.sink_need = np.array([SINK_TOKENS], dtype=np.int64)
        if mode == "evict":
            check(core.pool.num_free == 0, "evict: the free stack is not empty")
        if mode != "off":
            check(core.cache.num_evictable >= cache_pages, "decode: fewer evictable pages than asked")

    def run(self) -> Any:
        return self.core.step(self.owner, StepBatch(alloc_slots=self.slots, alloc_needs=self.ones))

    def after(self, res: Any) -> None:
        core, owner = self.core, self.owner
        check(res.kv_loc.size == NUM_DECODE and res.num_refused == 0, f"{self.mode}: decode not all OK")
        evicted = self.crossers if self.mode == "evict" else 0
        check(res.num_pages_evicted == evicted, f"{self.mode}: evicted {res.num_pages_evicted} pages, not {evicted}")
        core.step(owner, StepBatch(truncate_slots=self.slots, truncate_lens=self.lens))
        self.sink_pages()

    def sink_pages(self) -> None:
        """The sink request takes the 16 pages the truncate freed (a new sink request
        every 16 times: one holds at most max_context tokens)."""
        core, owner = self.core, self.owner
        if self.sink_len + SINK_TOKENS > MAX_CONTEXT_LEN:
            self.sink[0] = int(core.open(owner, [f"sink-{self.num_sinks}"])[0])
            self.num_sinks += 1
            self.sink_len = 0
        res = core.step(owner, StepBatch(alloc_slots=self.sink, alloc_needs=self.sink_need))
        check(res.num_refused == 0 and res.num_pages_evicted == 0, f"{self.mode}: sink alloc")
        self.sink_len += SINK_TOKENS
        if self.mode == "evict":
            check(core.pool.num_free == 0, "evict: the free stack is not empty before the next Step")

    def check_first(self) -> None:
        """Once, untimed: a decode Step's kv_loc against the block table, then back."""
        core = self.core
        res = self.run()
        pos = self.lens
        want = core.block_table[self.slots, pos // PAGE_SIZE].astype(np.int64) * PAGE_SIZE + pos % PAGE_SIZE
        check(np.array_equal(res.kv_loc, want.astype(np.int32)), f"{self.mode}: kv_loc disagrees with the block table")
        check(np.unique(res.kv_loc).size == NUM_DECODE, f"{self.mode}: kv_loc not distinct")
        check(res.new_pages.size == self.crossers, f"{self.mode}: {res.new_pages.size} new pages")
        self.after(res)
        report = core.audit()
        check(report.ok, f"{self.mode}: audit: {report.problems}")


def decode_iterations(sizes: Sizes) -> int:
    """Decode Steps each core makes: the check, the warm-up, the timed ones and the
    untimed ones that open each round."""
    rounds = -(-sizes.repeat // ROUND)
    return 1 + sizes.warmup + sizes.repeat + rounds * ROUND_WARMUP


def max_decode_iterations() -> int:
    """The sink requests use the request slots the decode requests leave."""
    return (MAX_REQUESTS - NUM_DECODE - 1) * (MAX_CONTEXT_LEN // SINK_TOKENS)


def scenario_decode(sizes: Sizes, clock: str, say: Callable[..., None]) -> dict[str, Any]:
    iterations = decode_iterations(sizes)
    # Each iteration's sink takes 16 pages for good: room for all of them, plus the
    # decode requests' pages (at most 8 each) and a margin.
    num_pages = 1 + sizes.cache_pages + NUM_DECODE * 8 + (iterations + 16) * (SINK_TOKENS // PAGE_SIZE) + 1024
    t = time.perf_counter()
    cores = {
        mode: DecodeCore(mode, num_pages, sizes.cache_pages, seed) for seed, mode in enumerate(("off", "free", "evict"))
    }
    say(
        f"  cores built ({time.perf_counter() - t:.1f} s): pool {num_pages:,} pages; evictable: "
        + ", ".join(f"{m} {c.core.cache.num_evictable:,}" for m, c in cores.items())
        + "; free: "
        + ", ".join(f"{m} {c.core.pool.num_free:,}" for m, c in cores.items())
    )
    for c in cores.values():
        c.check_first()
    contenders = [Contender(mode, c.run, c.after) for mode, c in cores.items()]
    measure(contenders, sizes.repeat, sizes.warmup, clock)
    for c in cores.values():
        report = c.core.audit()
        check(report.ok, f"{c.mode}: audit after timing: {report.problems}")
    evict = cores["evict"].core.cache
    return {
        "contenders": {c.name: c for c in contenders},
        "num_pages": num_pages,
        "evictable": {m: c.core.cache.num_evictable for m, c in cores.items()},
        "evictions_total": evict.num_evictions,
        "checked": "kv_loc vs block table; 16 evictions per Step on the evicting core (free stack empty before "
        "each), none on the others; audits before and after",
        "sinks": {m: c.num_sinks for m, c in cores.items()},
    }


# ------------------------------------------------------------------- scenario 4


def scenario_sharing() -> dict[str, Any]:
    rng = np.random.default_rng(3)
    system = rng.integers(0, VOCAB, size=SYSTEM_PROMPT_TOKENS, dtype=np.int32)
    n_total = SHARING_SCHEDULERS * SHARING_REQUESTS
    # Distinct suffixes: the first token of each is the request's index (above VOCAB).
    prompts = []
    for i in range(n_total):
        suffix = rng.integers(0, VOCAB, size=SUFFIX_TOKENS, dtype=np.int32)
        suffix[0] = VOCAB + i
        prompts.append(np.concatenate([system, suffix]))
    length = SYSTEM_PROMPT_TOKENS + SUFFIX_TOKENS
    pages_per_request = -(-length // PAGE_SIZE)
    prompt_pages = SYSTEM_PROMPT_TOKENS // PAGE_SIZE
    own_pages = pages_per_request - prompt_pages
    num_pages = n_total * pages_per_request + 1024

    def admit(prefix_cache: bool) -> dict[str, Any]:
        core = KVCore(CoreConfig(num_pages, PAGE_SIZE, MAX_REQUESTS, MAX_CONTEXT_LEN), audit_every_step=True,
                      prefix_cache=prefix_cache)  # fmt: skip
        owners = [core.add_owner(OWNER_NS) for _ in range(SHARING_SCHEDULERS)]
        matched: list[int] = []
        for s, owner in enumerate(owners):
            mine = prompts[s * SHARING_REQUESTS : (s + 1) * SHARING_REQUESTS]
            slots = core.open(owner, [f"s{s}-r{i}" for i in range(SHARING_REQUESTS)]).astype(np.int64)
            start = 0
            if s == 0:
                # The first request computes the prompt (alloc), then caches it (cache item).
                res = core.step(owner, StepBatch.of(alloc_slots=slots[:1], alloc_needs=[length]))
                check(res.num_refused == 0, "sharing: first alloc")
                res = core.step(owner, StepBatch.of(cache=[(int(slots[0]), mine[0])]))
                start = 1
            # The rest, in one Step: match (keeping one token to compute) and alloc the
            # whole length, of which the server allocates what the match left.
            rest = slots[start:]
            res = core.step(
                owner,
                StepBatch.of(
                    match=[(int(sl), p, length - 1) for sl, p in zip(rest, mine[start:], strict=True)],
                    alloc_slots=rest,
                    alloc_needs=[length] * len(rest),
                ),
            )
            matched.extend(res.match_lens.tolist())
            check(res.num_refused == 0, "sharing: alloc of the remainders")
        st = core.stats()
        held = sum(core.pages_held(o) for o in owners)
        return {
            "pages_used": st.num_used_pages,
            "references": held,
            "cached": core.cache.num_entries,
            "matched": matched,
        }

    shared = admit(True)
    alone = admit(False)
    want_shared = prompt_pages + n_total * own_pages
    want_alone = n_total * pages_per_request
    check(all(m == SYSTEM_PROMPT_TOKENS for m in shared["matched"]), f"sharing: match lengths {set(shared['matched'])}")
    check(all(m == 0 for m in alone["matched"]), "sharing: a match with the cache off")
    check(shared["pages_used"] == want_shared, f"sharing: {shared['pages_used']} pages used, expected {want_shared}")
    check(
        alone["pages_used"] == want_alone, f"sharing: {alone['pages_used']} pages used without, expected {want_alone}"
    )
    check(shared["references"] == alone["references"] == want_alone, "sharing: page references")

    def copies(used: int) -> float:
        return (used - n_total * own_pages) / prompt_pages

    return {
        "shared": shared,
        "alone": alone,
        "ratio": shared["pages_used"] / alone["pages_used"],
        "prompt_copies": {"shared": copies(shared["pages_used"]), "alone": copies(alone["pages_used"])},
        "requests": n_total,
        "pages_per_request": pages_per_request,
        "prompt_pages": prompt_pages,
        "checked": "every match = 2,048 tokens (0 with the cache off); pages used equal to the closed form "
        f"({prompt_pages} + {n_total} x {own_pages} shared, {n_total} x {pages_per_request} alone); "
        "references equal; audit after every Step",
    }


# --------------------------------------------------------------------------- report

TITLES = {
    "match": f"match {PROMPT_TOKENS:,} tok ({PROMPT_PAGES} pages), in-process",
    "match_keys": "  of which page keys (xxh3-128)",
    "match_socket": "  same, over the socket (client.step)",
    "match_socket_rtt": "  socket match vs an empty Step",
    "match_socket_miss": "  socket match vs a miss at page 1",
    "decode_cache_on": f"decode {NUM_DECODE} req, cache on vs off",
    "decode_evict": "decode, every alloc evicts vs free pool",
    "decode_evict_vs_off": "  every alloc evicts vs cache off",
    "sharing": "2 x 32 req on a 2,048-tok prompt: pages",
}


def verdict(key: str, ratio: float | None) -> str:
    t = TARGETS.get(key)
    if ratio is None:
        return "SKIP" if t is not None else "info"
    if t is None:
        return "info"
    op, value, _ = t
    return "PASS" if (ratio <= value if op == "<=" else ratio >= value) else "MISS"


def timed_row(key: str, num: Contender, den: Contender, baseline: str, unit: str) -> dict[str, Any]:
    r = ratio_summary(num, den)
    t = TARGETS.get(key)
    return {
        "scenario": key,
        "title": TITLES[key].strip(),
        "unit": unit,
        "value": summary(num.times_us),
        "baseline": baseline,
        "baseline_value": summary(den.times_us),
        **r,
        "target": None if t is None else {"op": t[0], "value": t[1], "ratio_is": t[2]},
        "result": verdict(key, r["ratio"]),
    }


def build_rows(results: dict[str, Any], clock: str) -> list[dict[str, Any]]:
    rows = []
    unit = f"µs ({'thread CPU' if clock == 'cpu' else 'wall'})"
    m = results["match"]["contenders"]
    vllm = "vLLM v1 block hashing (sha256 of pickle), 256 blocks"
    rows.append(timed_row("match", m["kvmem match"], m["vLLM hashing"], vllm, unit))
    rows.append(timed_row("match_keys", m["kvmem keys"], m["vLLM hashing"], vllm, unit))
    sock = results.get("match_socket")
    if sock is not None and "contenders" in sock:
        s = sock["contenders"]
        rows.append(timed_row("match_socket", s["kvmem match, socket"], s["vLLM hashing (wall)"], vllm, "µs (wall)"))
        rows.append(timed_row("match_socket_rtt", s["kvmem match, socket"], s["empty Step, socket"],
                              "a Step with no items, same client and server", "µs (wall)"))  # fmt: skip
        rows.append(timed_row("match_socket_miss", s["kvmem match, socket"], s["match miss, socket"],
                              "a match of 4,096 tokens that misses at page 1", "µs (wall)"))  # fmt: skip
    else:
        for key, base in (("match_socket", vllm), ("match_socket_rtt", "a Step with no items"),
                          ("match_socket_miss", "a match that misses at page 1")):  # fmt: skip
            rows.append({
                "scenario": key, "title": TITLES[key].strip(), "value": None, "baseline": base,
                "baseline_value": None, "ratio": None, "target": None, "result": "SKIP",
                "note": (sock or {}).get("note", "skipped"),
            })  # fmt: skip
    d = results["decode"]["contenders"]
    rows.append(timed_row("decode_cache_on", d["free"], d["off"], "same Step, prefix cache off", unit))
    rows.append(timed_row("decode_evict", d["evict"], d["free"], "same Step, cache on, free pool", unit))
    rows.append(timed_row("decode_evict_vs_off", d["evict"], d["off"], "same Step, prefix cache off", unit))
    s = results["sharing"]
    copies = s["prompt_copies"]
    ok = copies["shared"] == 1 and copies["alone"] == s["requests"]
    rows.append({
        "scenario": "sharing", "title": TITLES["sharing"], "unit": "pages in use",
        "value": s["shared"]["pages_used"], "baseline": "the same requests, prefix cache off",
        "baseline_value": s["alone"]["pages_used"], "ratio": s["ratio"], "prompt_copies": copies,
        "target": {"op": "==", "value": 1, "ratio_is": f"system prompt copies held: 1 (against {s['requests']})"},
        "result": "PASS" if ok else "MISS",
    })  # fmt: skip
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    header = ("figure", "value", "baseline", "ratio", "spread (IQR)", "target", "result")
    lines = []
    for r in rows:
        if r["scenario"] == "sharing":
            c = r["prompt_copies"]
            v, b = f"{r['value']:,} pages", f"{r['baseline_value']:,} pages"
            spread = f"copies {c['shared']:g} vs {c['alone']:g}"
            target = "1 copy"
        elif r["value"] is None:
            v = b = spread = "n/a"
            target = "-"
        else:
            v, b = f"{r['value']['median']:,.1f} µs", f"{r['baseline_value']['median']:,.1f} µs"
            spread = f"{r['q1']:.2f}-{r['q3']:.2f}"
            t = r["target"]
            target = "-" if t is None else f"{'≤' if t['op'] == '<=' else '≥'} {t['value']:g}x"
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.3f}x" if r["ratio"] < 0.1 else f"{r['ratio']:.2f}x"
        lines.append((TITLES[r["scenario"]], v, b, ratio, spread, target, r["result"]))
    return render(header, lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="prefix_bench.py",
        description=(
            "Time kvmem's prefix cache: the match of a 4,096-token prompt against a warm 100,000-page cache "
            "(in-process and over the socket) against vLLM v1's hashing of the same prompt; a 256-request "
            "decode Step with the cache on against off, and with every alloc evicting against a free pool; "
            "and the pages two schedulers hold on one 2,048-token system prompt with and without sharing. "
            "Ratios compare figures measured in this same run: the median over short interleaved rounds of "
            "the in-round ratio, with its interquartile range."
        ),
        epilog=(
            "Targets: match <= 0.5x vLLM's hashing; decode with the cache on <= 1.05x off; decode with every "
            "alloc evicting <= 1.3x a free pool; sharing: one copy of the system prompt (instead of 64). Exit "
            "status 0 even on MISS (a measurement, not a test) unless --strict; 2 if a check or the server fails."
        ),
    )
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes for CI (a 2,000-page cache, 2 reps, 1 warm-up): checks that everything "
                        "runs and its checks hold, in seconds; the figures mean little")  # fmt: skip
    parser.add_argument(
        "--reps",
        type=int,
        default=None,
        metavar="N",
        help="timed repetitions of each contender, in rounds of 5 (default: 100; 2 with --quick)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        metavar="N",
        help="untimed repetitions of each contender first (default: 10; 1 with --quick)",
    )
    parser.add_argument(
        "--cache-pages",
        type=int,
        default=None,
        metavar="N",
        help="pages in the warm cache of scenarios 1-3 (default: 100000; 2000 with --quick)",
    )
    parser.add_argument("--no-socket", action="store_true", help="skip the match over the socket (no server)")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="cpu",
        help="in-process repetitions: 'cpu' (default) the thread's CPU time, which leaves out "
        "preemption by other processes; 'wall' elapsed time. The socket row is always wall time",
    )
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                        help="emit the figures and machine info as one JSON object: on stdout instead of the "
                        "table, or into PATH with the table still printed")  # fmt: skip
    parser.add_argument("--strict", action="store_true", help="exit 1 if a target is missed")
    args = parser.parse_args(argv)
    sizes = Sizes(
        cache_pages=args.cache_pages if args.cache_pages is not None else (2000 if args.quick else 100_000),
        repeat=args.reps if args.reps is not None else (2 if args.quick else 100),
        warmup=args.warmup if args.warmup is not None else (1 if args.quick else 10),
    )
    if sizes.repeat < 1 or sizes.warmup < 0 or sizes.cache_pages < PROMPT_PAGES + CHAIN_PAGES[0]:
        parser.error(f"--reps must be >= 1, --warmup >= 0, --cache-pages >= {PROMPT_PAGES + CHAIN_PAGES[0]}")
    if decode_iterations(sizes) > max_decode_iterations():
        parser.error(f"--reps and --warmup ask for {decode_iterations(sizes)} decode Steps per core; at most "
                     f"{max_decode_iterations()} fit (the sink requests' slots)")  # fmt: skip
    to_stdout = args.json == "-"
    t_start = time.monotonic()

    def say(*a: Any) -> None:
        print(f"[{time.monotonic() - t_start:5.1f}s]", *a, file=sys.stderr, flush=True)

    heap_kept = keep_freed_memory()  # as `kvmem serve` runs (server/process/tuning.py)
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    results: dict[str, Any] = {}
    try:
        say(f"scenario 1: match against a {sizes.cache_pages:,}-page cache, in-process")
        results["match"] = scenario_match(sizes, args.clock, say)
        say("scenarios 2-3: decode Step, cache off / on (free pool) / on (every alloc evicts)")
        results["decode"] = scenario_decode(sizes, args.clock, say)
        say("scenario 4: two schedulers sharing a system prompt")
        results["sharing"] = scenario_sharing()
        if args.no_socket:
            results["match_socket"] = {"note": "skipped: --no-socket"}
        else:
            say("scenario 1 over the socket")
            results["match_socket"] = scenario_match_socket(sizes, results["match"], say)
    except CheckFailed as exc:
        say(f"CHECK FAILED: {exc}")
        return 2
    elapsed = time.monotonic() - t_start

    rows = build_rows(results, args.clock)
    info = machine_info()
    info["load_average_1m_at_start"] = None if load_before is None else round(load_before, 2)
    m = results["match"]
    checked = {
        "match": m["checked"],
        "match_socket": results["match_socket"].get("checked", results["match_socket"].get("note")),
        "decode": results["decode"]["checked"],
        "sharing": results["sharing"]["checked"],
    }
    report: dict[str, Any] = {
        "benchmark": "kvmem prefix_bench",
        "statistic": f"value/baseline: median (min, p90) µs over all timed reps; ratio: median over rounds of the "
        f"in-round ratio of medians (a round: each contender {ROUND_WARMUP} untimed + {ROUND} timed reps in turn), "
        "q1/q3/min/max: the spread of those in-round ratios",
        "config": {
            "page_size": PAGE_SIZE,
            "quick": args.quick,
            "cache_pages": sizes.cache_pages,
            "cache_chains": m["chains"],
            "chain_pages": list(CHAIN_PAGES),
            "prompt_tokens": PROMPT_TOKENS,
            "decode_requests": NUM_DECODE,
            "decode_lens": f"{DECODE_BASE_LEN} + i % {PAGE_SIZE} (1 in {PAGE_SIZE} opens a new page)",
            "decode_pool_pages": results["decode"]["num_pages"],
            "decode_evictions_total": results["decode"]["evictions_total"],
            "sharing": {
                "schedulers": SHARING_SCHEDULERS,
                "requests_each": SHARING_REQUESTS,
                "system_prompt_tokens": SYSTEM_PROMPT_TOKENS,
                "suffix_tokens": SUFFIX_TOKENS,
            },
            "repeat": sizes.repeat,
            "warmup": sizes.warmup,
            "clock": args.clock,
            "heap_kept": heap_kept,
        },
        "checked": checked,
        "sharing": {k: v for k, v in results["sharing"].items() if k != "checked"},
        "machine": info,
        "elapsed_s": round(elapsed, 1),
        "scenarios": rows,
        "missed": [r["scenario"] for r in rows if r["result"] == "MISS"],
        "all_pass": all(r["result"] in ("PASS", "info", "SKIP") for r in rows),
    }
    if to_stdout:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(
            f"kvmem prefix-cache benchmark -- {info['cpu_model']}, {info['cpus_usable']}/{info['cpu_count']} cpus, "
            f"python {info['python']}, numpy {info['numpy']}, xxhash {info['xxhash']}; load average "
            f"{info['load_average_1m_at_start']} at start, {info['load_average_1m']} at end"
        )
        print(
            f"{'thread CPU' if args.clock == 'cpu' else 'wall'} µs (socket row: wall): medians of {sizes.repeat} reps; "
            f"ratio: median over {-(-sizes.repeat // ROUND)} rounds of the in-round ratio, spread its IQR"
            + (" -- QUICK MODE: tiny sizes, figures not meaningful" if args.quick else "")
        )
        print()
        print(format_table(rows))
        print()
        for r in rows:
            if r.get("value") is not None and r["scenario"] != "sharing":
                v, b = r["value"], r["baseline_value"]
                print(
                    f"  {r['scenario']:>19}: min {v['min']:8.1f} p90 {v['p90']:8.1f} | baseline min {b['min']:8.1f} "
                    f"p90 {b['p90']:8.1f} | round ratios {r['min']:.2f}..{r['max']:.2f}"
                )
        print(
            f"cache: {sizes.cache_pages:,} pages in {m['chains']} chains of {CHAIN_PAGES[0]}-{CHAIN_PAGES[1]} pages; "
            f"the match is the server's path from the deserialised StepRequest (wire.step_batch + KVCore.step); the "
            "slot's release and re-open are untimed."
        )
        print(
            f"decode: pool {results['decode']['num_pages']:,} pages; the evicting core evicted "
            f"{results['decode']['evictions_total']:,} pages in all (16 per Step)."
        )
        s = results["sharing"]
        print(
            f"sharing: {s['requests']} requests of {s['pages_per_request']} pages ({s['prompt_pages']} of system "
            f"prompt): {s['shared']['pages_used']:,} pages in use with sharing, {s['alone']['pages_used']:,} without; "
            f"references {s['shared']['references']:,} in both."
        )
        for key, text in checked.items():
            print(f"checked {key}: {text}")
        print(f"total {elapsed:.1f} s")
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
            print(f"JSON written to {args.json}")
    if args.strict and report["missed"]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
