"""``kvmem generate``'s report: each completion checked against its prompt's reference
(the model's own ``generate()``, computed by the worker that had the prompt), the
workers' figures (tokens, prefix hits, time to first token and time per output token,
requests handed off and adopted), the pool; as text or JSON."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import IO, Any

from ..server_process import store_summary

__all__ = ["report"]


def _summary(seconds: list[float]) -> dict[str, float]:
    """Median and mean in milliseconds, and how many."""
    if not seconds:
        return {"p50": 0.0, "mean": 0.0, "n": 0}
    ordered = sorted(seconds)
    return {
        "p50": round(ordered[len(ordered) // 2] * 1000, 3),
        "mean": round(sum(ordered) / len(ordered) * 1000, 3),
        "n": len(ordered),
    }


def _first_difference(got: list[int], want: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))


def report(
    args: argparse.Namespace,
    prompts: list[Any],
    final: dict[int, dict[str, Any]],
    errors: list[str],
    pool: Any,
    elapsed: float,
    info: IO[str],
    configs: list[Any],
    node: str = "",
    collect: list[dict[str, Any]] | None = None,
) -> int:
    """Check the completions, print the report (JSON with ``--json``), return the exit
    status. ``node`` (``--nodes 2``): the node's name, its lines headed by it;
    ``collect``: the result goes into it instead of stdout as JSON (the caller prints
    all nodes' at once)."""
    done = [m for _, m in sorted(final.items()) if m.get("kind") == "done"]
    completions = sorted((c for m in done for c in m["completions"]), key=lambda c: c["index"])
    refs: dict[int, list[int]] = {}  # each worker computed its own prompts' references
    for w, m in final.items():
        if m.get("kind") == "done" and m.get("references") is not None:
            refs.update(zip((p.index for p in configs[w].prompts), m["references"], strict=True))
    mismatches: list[str] = []
    missing = sorted(set(range(len(prompts))) - {c["index"] for c in completions})
    if missing and not errors:
        errors.append(f"prompts {missing} were not completed by any worker")
    for c in completions:
        c["prompt"] = c.get("prompt") or prompts[c["index"]].describe()
        want = refs.get(c["index"])
        if want is not None:
            c["reference_token_ids"] = want
            c["matches_generate"] = c["token_ids"] == want
            if c["token_ids"] != want:
                i = _first_difference(c["token_ids"], want)
                got_t = c["token_ids"][i] if i < len(c["token_ids"]) else "(end)"
                want_t = want[i] if i < len(want) else "(end)"
                mismatches.append(
                    f"prompt {c['index']} ({c['prompt']!r}): new token {i} is {got_t}, the model's generate() "
                    f"gives {want_t}"
                )
    workers = [
        {
            "worker": w,
            "generated_tokens": m.get("generated", 0),
            "computed_tokens": m.get("computed", 0),
            "seconds": round(m.get("elapsed_s", 0.0), 3),
            "tokens_per_s": round(m["generated"] / m["elapsed_s"], 2) if m.get("elapsed_s") else 0.0,
            "prompt_tokens": sum(c["prompt_tokens"] for c in m["completions"]),
            "matched_tokens": sum(c["matched_tokens"] for c in m["completions"]),
            "role": configs[w].role,
            "time_to_first_token_ms": _summary(m["figures"].get("first_token_s", [])),
            "time_per_output_token_ms": _summary([c["tpot_s"] for c in m["completions"] if c["tpot_s"] > 0]),
            "handed_off": m["figures"].get("handed_off", 0),
            "adopted": m["figures"].get("adopted", 0),
            "drained": bool(m["figures"].get("drained", False)),
            "figures": m["figures"],
        }
        for w, m in sorted(final.items())
        if m.get("kind") == "done"
    ]
    prompt_tokens = sum(w["prompt_tokens"] for w in workers)
    matched = sum(w["matched_tokens"] for w in workers)
    checked = not args.no_check and not errors
    result: dict[str, Any] = {
        "ok": not errors and not mismatches,
        "checked": checked,
        "completions": completions,
        "workers": workers,
        "prefix_hit_rate": round(matched / prompt_tokens, 4) if prompt_tokens else 0.0,
        "seconds": round(elapsed, 3),
        "pool": {
            "used": int(pool.num_used_pages),
            "cached": int(pool.num_cached_pages),
            "free": int(pool.num_free_pages),
            "total": int(pool.num_pages_total),
        },
        "mismatches": mismatches,
        "errors": errors,
    }
    turns = sorted({c.get("turn", 0) for c in completions})
    if len(turns) > 1:  # a multi-turn workload: each turn's time to first token, from its round's start
        result["turns"] = [
            {
                "turn": t + 1,
                "time_to_first_token_ms": _summary([c["ttft_s"] for c in completions if c.get("turn", 0) == t]),
                # from each request's admission: its prefill (and load waits) without its time queued
                "admitted_to_first_token_ms": _summary(
                    [c["ttft_s"] - c.get("admitted_s", 0.0) for c in completions if c.get("turn", 0) == t]
                ),
                "prompt_tokens": sum(c["prompt_tokens"] for c in completions if c.get("turn", 0) == t),
                "matched_tokens": sum(c["matched_tokens"] for c in completions if c.get("turn", 0) == t),
            }
            for t in turns
        ]
    if pool.HasField("host_tier"):
        h = pool.host_tier
        result["host_tier"] = {
            "pages": int(h.num_pages),
            "cached": int(h.num_cached_pages),
            "demoted": int(h.num_demoted),
            "loaded": int(h.num_loaded),
            "hit_tokens": int(h.hit_tokens),
            "evicted": int(h.num_evicted),
            # of the matched tokens, those still loading when their Step answered, and the
            # forwards' time waiting for them (per layer: the copy the compute did not hide)
            "loading_tokens": sum(int(w["figures"].get("loading_tokens", 0)) for w in workers),
            "load_wait_ms": round(1e3 * sum(float(w["figures"].get("load_wait_seconds", 0.0)) for w in workers), 3),
            "load_ms_p50": round(h.load_ms_p50, 3),
            "load_held": sum(int(w["figures"].get("load_held", 0)) for w in workers),
        }
    store = store_summary(pool)
    if store is not None:
        store["held"] = sum(int(w["figures"].get("fetch_held", 0)) for w in workers)
        result["store"] = store
    first = [c["ttft_s"] for c in completions if "ttft_s" in c]
    result["ttft_p50_ms"] = round(1e3 * statistics.median(first), 3) if first else 0.0
    result["matched_tokens"] = sum(c["matched_tokens"] for c in completions)
    result["prefill_tokens"] = sum(c["prompt_tokens"] - c["matched_tokens"] for c in completions)
    if node:
        result["node"] = node
        print(f"node {node}:", file=info)
    if collect is not None:
        collect.append(result)
    if args.json:
        if collect is None:
            json.dump(result, sys.stdout, indent=2)
            sys.stdout.write("\n")
    else:
        for c in completions:
            shown = repr(c["text"]) if c["text"] is not None else f"token ids {c['token_ids']}"
            print(f"[{c['index']}] {c['prompt']}\n    -> {shown}")
        for row in workers:
            ttft, tpot = row["time_to_first_token_ms"], row["time_per_output_token_ms"]
            timing = f"; TTFT p50 {ttft['p50']:.0f} ms" if ttft["n"] else ""
            timing += f"; TPOT p50 {tpot['p50']:.1f} ms" if tpot["n"] else ""
            moved = f"; handed off {row['handed_off']}" if row["handed_off"] else ""
            moved += f"; adopted {row['adopted']}" if row["adopted"] else ""
            moved += " (drained)" if row["drained"] else ""
            hit = (
                f"; prefix hit {row['matched_tokens']}/{row['prompt_tokens']} prompt tokens"
                if row["prompt_tokens"]
                else ""
            )
            print(
                f"w{row['worker']} {row['role']}: {row['generated_tokens']} tokens in {row['seconds']:.1f} s, "
                f"{row['tokens_per_s']:.1f} tokens/s{hit}{timing}{moved}"
            )
        for row in result.get("turns", []):
            ttft = row["time_to_first_token_ms"]
            print(
                f"turn {row['turn']}: TTFT p50 {ttft['p50']:.0f} ms, mean {ttft['mean']:.0f} ms over {ttft['n']} "
                f"requests (p50 {row['admitted_to_first_token_ms']['p50']:.0f} ms from admission); prefix hit "
                f"{row['matched_tokens']}/{row['prompt_tokens']} prompt tokens"
            )
        if "host_tier" in result:
            h = result["host_tier"]
            print(
                f"host tier: {h['cached']} of {h['pages']} pages cached; demoted {h['demoted']}, loaded {h['loaded']} "
                f"({h['hit_tokens']} prompt tokens matched from it, not prefilled again), evicted {h['evicted']}; "
                f"{h['loading_tokens']} of them still loading at their Step's answer, forwards waited "
                f"{h['load_wait_ms']:.1f} ms for them in all (a load's copy p50 {h['load_ms_p50']:.2f} ms)"
            )
        if "store" in result:
            st = result["store"]
            print(
                f"store ({st['kind']}): wrote {st['pages_written']} pages; {st['fetches']} fetches found "
                f"{st['pages_found']} pages, {st['pages_read']} read into the host tier ({st['rejected']} refused), "
                f"fetch p50 {st['fetch_ms_p50']:.1f} ms; requests held for them {st['held']} times"
            )
        p = result["pool"]
        print(
            f"prefix hit rate {result['prefix_hit_rate']:.0%}; pool {p['used']} used, {p['cached']} cached, "
            f"{p['free']} free of {p['total']} pages"
        )
        if checked and not mismatches:
            print(f"check: all {len(completions)} greedy completions equal the model's own generate()")
    for line in mismatches:
        print(f"MISMATCH: {line}", file=sys.stderr)
    for line in errors:
        print(f"ERROR: {line}", file=sys.stderr)
    return 0 if result["ok"] else 1
