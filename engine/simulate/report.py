"""What ``kvmem simulate`` shows: the workers' messages gathered (:class:`RunState`), the
live view while they run (:class:`LiveView`), the final report as a table or JSON, and
the plot of the pool and the hit rate over time."""

from __future__ import annotations

import importlib
import time
from collections.abc import Sequence
from typing import IO, Any

import numpy as np

from .policy import COUNTERS  # what each worker reports, cumulative


class RunState:
    """One run's workers, as their messages tell it. ``samples``: the pool over time
    (seconds since the start, pages used, cached, free, the hit rate so far)."""

    def __init__(self, label: str, num_workers: int) -> None:
        self.label = label
        self.num_workers = num_workers
        self.latest: dict[int, dict[str, Any]] = {}
        self.final: dict[int, dict[str, Any]] = {}
        self.latencies: dict[int, list[float]] = {w: [] for w in range(num_workers)}
        self.failures: list[str] = []
        self.errors: list[str] = []
        self.samples: list[tuple[float, int, int, int, float]] = []
        self.started = time.monotonic()
        self.elapsed_s = 0.0

    def update(self, msg: dict[str, Any]) -> None:
        w = int(msg["worker"])
        kind = msg["kind"]
        if kind == "error":
            self.errors.append(f"worker {w}: {msg['message']}")
            self.final[w] = self.latest.get(w, {"worker": w})
            return
        self.latencies[w].extend(msg.get("latencies", ()))
        self.latest[w] = msg
        if kind == "failure":
            self.failures.append(msg["message"])
        if kind in ("done", "failure"):
            self.final[w] = msg

    @property
    def finished(self) -> bool:
        return len(self.final) == self.num_workers

    def total(self, key: str, workers: Sequence[int] | None = None) -> float:
        return sum(self.latest[w].get(key, 0) for w in (self.latest if workers is None else workers))

    def hit_rate(self) -> float:
        query = self.total("prefix_query_tokens")
        return self.total("prefix_hit_tokens") / query if query else 0.0

    def sample(self, used: int, cached: int, free: int) -> None:
        self.samples.append((time.monotonic() - self.started, used, cached, free, self.hit_rate()))

    def percentiles_us(self, worker: int | None = None) -> tuple[float, float]:
        values = self.latencies[worker] if worker is not None else [x for v in self.latencies.values() for x in v]
        if not values:
            return 0.0, 0.0
        p50, p99 = np.percentile(np.asarray(values), [50, 99])
        return float(p50) * 1e6, float(p99) * 1e6

    def steps_per_s(self, worker: int) -> float:
        m = self.latest.get(worker, {})
        return m.get("steps", 0) / m["elapsed_s"] if m.get("elapsed_s") else 0.0

    def total_steps_per_s(self) -> float:
        """Steps of all workers per second of the run so far (its longest worker's time)."""
        elapsed = max((m.get("elapsed_s", 0.0) for m in self.latest.values()), default=0.0)
        return self.total("steps") / elapsed if elapsed else 0.0

    def overhead_us(self) -> float:
        """The allocator's time per scheduler iteration (its Step, its top-up Steps and
        Opens), in µs: what an iteration of the reference's per-request calls compares with."""
        iterations = self.total("iterations")
        return 1e6 * (self.total("step_seconds") + self.total("open_seconds")) / iterations if iterations else 0.0


def us(value: float) -> str:
    return f"{value:,.0f} µs" if value < 1000 else f"{value / 1000:,.1f} ms"


def pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def worker_table(run: RunState) -> list[str]:
    """Per worker and in all: requests done of those arrived, running and waiting now,
    Steps, Steps per second, Step latency p50/p99, prefix hit rate, preemptions."""
    head = (
        f"{'worker':<7} {'done':>11} {'running':>7} {'waiting':>7} {'steps':>8} {'steps/s':>8} {'step p50':>9} "
        f"{'step p99':>9} {'prefix hit':>10} {'preempted':>9}"
    )
    lines = [head, "-" * len(head)]
    rows = [(f"w{w}", [w]) for w in range(run.num_workers)] + [("all", list(range(run.num_workers)))]
    for name, ws in rows:
        have = [w for w in ws if w in run.latest]
        if not have:
            lines.append(f"{name:<7} {'starting':>11}")
            continue
        done = f"{run.total('done', have):,.0f}/{run.total('generated', have):,.0f}"
        p50, p99 = run.percentiles_us(ws[0] if len(ws) == 1 else None)
        rate = run.steps_per_s(ws[0]) if len(ws) == 1 else run.total_steps_per_s()
        hit = pct(run.total("prefix_hit_tokens", have), run.total("prefix_query_tokens", have))
        lines.append(
            f"{name:<7} {done:>11} {run.total('running', have):>7,.0f} {run.total('waiting', have):>7,.0f} "
            f"{run.total('steps', have):>8,.0f} {rate:>8,.0f} {us(p50):>9} {us(p99):>9} {hit:>10} "
            f"{run.total('preemptions', have):>9,.0f}"
        )
    if run.num_workers == 1:
        del lines[-1]
    return lines


def pool_line(run: RunState, total_pages: int) -> str:
    if not run.samples:
        return "pool: -"
    _, used, cached, free, _ = run.samples[-1]
    return (
        f"pool of {total_pages:,} pages: used {used:,} ({pct(used, total_pages)})  cached {cached:,}  free {free:,}"
        f"   prefix hit rate {pct(run.total('prefix_hit_tokens'), run.total('prefix_query_tokens'))}"
    )


class LiveView:
    """While a run goes: a table redrawn in place on a terminal, else one plain line per
    ``interval`` seconds."""

    def __init__(self, stream: IO[str], interval: float | None) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.interval = interval if interval is not None else (0.5 if self.tty else 2.0)
        self._drawn = 0
        self._last = 0.0

    def due(self) -> bool:
        return time.monotonic() - self._last >= self.interval

    def show(self, run: RunState, pool: str) -> None:
        if not run.latest:  # nothing to show before the first report
            return
        self._last = time.monotonic()
        elapsed = self._last - run.started
        if self.tty:
            lines = [f"{run.label}: {elapsed:.1f} s", *worker_table(run), pool]
            up = f"\x1b[{self._drawn}F\x1b[J" if self._drawn else ""
            self.stream.write(up + "\n".join(lines) + "\n")
            self._drawn = len(lines)
        else:
            p50, p99 = run.percentiles_us()
            rate = run.total_steps_per_s()
            self.stream.write(
                f"[{elapsed:6.1f}s] {run.label}: done {run.total('done'):,.0f}/{run.total('generated'):,.0f}  "
                f"steps/s {rate:,.0f}  step p50 {us(p50)} p99 {us(p99)}  preempted "
                f"{run.total('preemptions'):,.0f}  {pool}\n"
            )
        self.stream.flush()

    def clear(self) -> None:
        """Remove the live table (the final report replaces it)."""
        if self.tty and self._drawn:
            self.stream.write(f"\x1b[{self._drawn}F\x1b[J")
            self.stream.flush()
        self._drawn = 0


def pool_summary(run: RunState) -> dict[str, Any]:
    if not run.samples:
        return {"samples": 0}
    used = np.array([s[1] for s in run.samples])
    cached = np.array([s[2] for s in run.samples])
    return {
        "samples": len(run.samples),
        "peak_used_pages": int(used.max()),
        "mean_used_pages": round(float(used.mean()), 1),
        "peak_cached_pages": int(cached.max()),
        "last": dict(zip(("t_s", "used", "cached", "free", "hit_rate"), run.samples[-1], strict=True)),
    }


def totals(run: RunState) -> dict[str, Any]:
    """The run's totals, as the report and ``--json`` give them."""
    out: dict[str, Any] = {key: run.total(key) for key in COUNTERS}  # ints, and the seconds as floats
    for key in ("step_seconds", "open_seconds"):
        out[key] = round(out[key], 6)
    p50, p99 = run.percentiles_us()
    out["elapsed_s"] = round(run.elapsed_s, 3)
    out["steps_per_s"] = round(out["steps"] / run.elapsed_s, 1) if run.elapsed_s else 0.0
    out["step_latency_us"] = {"p50": round(p50, 1), "p99": round(p99, 1)}
    out["allocator_us_per_iteration"] = round(run.overhead_us(), 1)
    out["round_trips"] = int(run.total("round_trips"))  # Steps and Opens (0: in-process, the baseline)
    its = out["iterations"]
    out["round_trips_per_iteration"] = round(out["round_trips"] / its, 2) if its else 0.0  # Steps, top-ups, Opens
    out["prefix_hit_rate"] = round(run.hit_rate(), 4)
    return out


def turn_rows(run: RunState) -> list[dict[str, Any]]:
    """A multi-turn run's time to first token per turn, over every worker's finished
    requests: p50, p99 and mean in ms, from each request's arrival."""
    by_turn: dict[int, list[float]] = {}
    for m in run.final.values():
        for turn, seconds in (m.get("ttft") or {}).items():
            by_turn.setdefault(int(turn), []).extend(seconds)
    rows = []
    for turn in sorted(by_turn):
        ms = sorted(1000 * s for s in by_turn[turn])
        rows.append(
            {
                "turn": turn + 1,
                "requests": len(ms),
                "ttft_ms": {
                    "p50": round(ms[len(ms) // 2], 2),
                    "p99": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 2),
                    "mean": round(sum(ms) / len(ms), 2),
                },
            }
        )
    return rows


def host_tier(stats: Any) -> dict[str, Any] | None:
    """The server's host-memory tier from its Stats (None: it has none)."""
    if not stats.HasField("host_tier"):
        return None
    h = stats.host_tier
    return {
        "pages": int(h.num_pages),
        "cached": int(h.num_cached_pages),
        "demoted": int(h.num_demoted),
        "loaded": int(h.num_loaded),
        "evicted": int(h.num_evicted),
        "dropped": int(h.num_dropped),
        "hit_tokens": int(h.hit_tokens),
    }


def worker_rows(run: RunState) -> list[dict[str, Any]]:
    rows = []
    for w in range(run.num_workers):
        m = run.final.get(w, run.latest.get(w, {}))
        p50, p99 = run.percentiles_us(w)
        row = {key: m.get(key, 0) for key in COUNTERS}
        row.update(
            worker=w,
            digest=m.get("digest"),
            elapsed_s=round(m.get("elapsed_s", 0.0), 3),
            step_latency_us={"p50": round(p50, 1), "p99": round(p99, 1)},
        )
        for key in ("peak_pages_held", "mean_pages_held", "api", "round_trips"):
            if key in m:
                row[key] = m[key]
        rows.append(row)
    return rows


def summary_lines(run: RunState, result: dict[str, Any]) -> list[str]:
    t = result["totals"]
    pool = result["pool"]
    g = result["server"]
    lines = [
        f"elapsed {t['elapsed_s']:.1f} s: {t['steps']:,} Steps ({t['steps_per_s']:,.0f}/s), step latency p50 "
        f"{us(t['step_latency_us']['p50'])}, p99 {us(t['step_latency_us']['p99'])}; allocator time "
        f"{us(t['allocator_us_per_iteration'])} per scheduler iteration ({t['round_trips_per_iteration']:.2f} "
        f"round trips: Steps, top-ups and Opens)"
    ]
    if pool.get("samples"):
        lines.append(
            f"pool: peak {pool['peak_used_pages']:,} of {g['num_pages_total']:,} pages used "
            f"({pct(pool['peak_used_pages'], g['num_pages_total'])}), mean {pool['mean_used_pages']:,.0f}; "
            f"peak {pool['peak_cached_pages']:,} cached; {t['preemptions']:,} preemption(s) on OUT_OF_PAGES"
        )
    lines.append(
        f"prefix cache: {t['prefix_hit_tokens']:,} of {t['prefix_query_tokens']:,} prompt tokens matched "
        f"({pct(t['prefix_hit_tokens'], t['prefix_query_tokens'])}); {t['prefill_tokens']:,} tokens prefilled, "
        f"{t['decode_tokens']:,} decoded; {t['draft_tokens']:,} draft tokens, {t['rejected_tokens']:,} rejected "
        "and truncated"
    )
    if t["verified_requests"]:
        lines.append(
            f"verified: {t['verified_requests']:,} requests read back through the block table before release, "
            f"{t['verified_tokens']:,} tokens in {t['verified_pages']:,} pages, every layer's K and V: all as written"
        )
    for row in result.get("turns") or ():
        ttft = row["ttft_ms"]
        lines.append(
            f"turn {row['turn']}: time to first token p50 {ttft['p50']:,.1f} ms, p99 {ttft['p99']:,.1f} ms "
            f"({row['requests']:,} requests, from arrival)"
        )
    h = result.get("host_tier")
    if h is not None:
        lines.append(
            f"host tier: {h['cached']:,} of {h['pages']:,} pages cached; {h['demoted']:,} demoted, {h['loaded']:,} "
            f"loaded ({h['hit_tokens']:,} prompt tokens matched from it, not prefilled again), {h['evicted']:,} "
            f"evicted, {h['dropped']:,} dropped"
        )
    lines.append(f"workload digest {result['workload']['digest']} (seed {result['workload']['seed']})")
    return lines


def comparison_lines(result: dict[str, Any]) -> list[str]:
    """kvmem beside the reference allocator run in-process, one per worker."""
    k, r = result["totals"], result["baseline"]["totals"]
    pool, base = result["pool"], result["baseline"]
    n, api = result["config"]["workers"], result["config"].get("api", "client")
    rows = [
        ("allocator time per iteration", us(k["allocator_us_per_iteration"]), us(r["allocator_us_per_iteration"])),
        ("  median", us(k["step_latency_us"]["p50"]), us(r["step_latency_us"]["p50"])),
        (
            f"  (kvmem, --api {api}: its Step round trips (top-ups too) and Opens; reference: its per-request calls)",
            "",
            "",
        ),
        (
            "pages to provision (peak held)",
            f"{pool.get('peak_used_pages', 0):,}",
            f"{base['peak_pages_held']:,} ({n} pools)",
        ),
        ("pages held, mean", f"{pool.get('mean_used_pages', 0):,.0f}", f"{base['mean_pages_held']:,.0f}"),
        ("prompt tokens prefilled", f"{k['prefill_tokens']:,}", f"{r['prefill_tokens']:,}"),
        ("prefix hit rate", pct(k["prefix_hit_tokens"], k["prefix_query_tokens"]), "- (no shared cache)"),
        ("preemptions", f"{k['preemptions']:,}", f"{r['preemptions']:,}"),
        ("Steps (iterations and top-ups)", f"{k['steps']:,}", f"{r['steps']:,}"),
    ]
    width = max(len(row[0]) for row in rows if row[1])
    lines = [f"{'':<{width}}  {'kvmem (one shared pool)':>24}  {'reference (in-process)':>24}"]
    lines += [f"{a:<{width}}  {b:>24}  {c:>24}" if b else a for a, b, c in rows]
    pages, tokens = result["comparison"]["pages_saved"], result["comparison"]["prefill_tokens_saved"]
    lines.append(
        f"sharing saved {pages:,} pages at the peak ({pct(pages, base['peak_pages_held'])} of what {n} unshared "
        f"pools need) and {tokens:,} prefilled tokens ({pct(tokens, r['prefill_tokens'])})"
    )
    return lines


def plot(path: str, run: RunState, total_pages: int) -> None:
    """Pool occupancy (used, cached, free) and the prefix hit rate over the run."""
    # The optional extra (pip install 'kvmem[plot]'), imported by name: no stubs needed.
    importlib.import_module("matplotlib").use("Agg")
    plt = importlib.import_module("matplotlib.pyplot")

    t = [s[0] for s in run.samples]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    top.stackplot(
        t,
        [s[1] for s in run.samples],
        [s[2] for s in run.samples],
        [s[3] for s in run.samples],
        labels=["used", "cached", "free"],
        colors=["#d1495b", "#edae49", "#dddddd"],
    )
    top.set_ylim(0, total_pages)
    top.set_ylabel("pages")
    top.set_title(f"kvmem simulate: the pool ({total_pages:,} pages) over time")
    top.legend(loc="upper right")
    bottom.plot(t, [100 * s[4] for s in run.samples], color="#00798c")
    bottom.set_ylim(0, 100)
    bottom.set_ylabel("prefix hit rate so far (%)")
    bottom.set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
