"""``kvmem generate``: a real model generating on kvmem, several engine processes on one
pool. Its options and help, and the run: the parent finds (or starts) the server, checks
its geometry against the model's, starts the workers (:mod:`.worker`), shows a
live line per worker, prints the completions and a summary, and checks each greedy
completion against the model's own ``generate()``. The parent loads no torch,
transformers or weights: the model's geometry comes from its config.json or its GGUF
metadata (:mod:`.geometry`); the workers load the model."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing
import os
import queue
import secrets
import sys
import tempfile
import time
from typing import IO, Any

from ..process import join
from ..server_process import UsageError  # a missing model, a bad prompts file, an unusable server: exit 2

DESCRIPTION = """\
Generate text with a real model on kvmem: N engine worker processes (transformers models
whose attention reads and writes kvmem's pages) share one server's pool and its prefix
cache, each completing its share of the prompts with continuous batching.

When no server answers at --socket (or --tcp), generate starts one sized for the model
(its geometry, --dtype float32, pages for the prompts), says so, and stops it at the end.
A running server of another geometry is refused with the `kvmem serve` flags the model
needs (--print-serve-flags prints them).

Every greedy completion is then checked against the same model's own
generate(do_sample=False) (transformers' attention and cache): a mismatch exits 1, naming
the prompt and the first differing token.
"""

EPILOG = """\
prompts file (--prompts FILE.jsonl), one JSON object a line:
  {"prompt": "text"}   {"messages": [{"role": "user", "content": "..."}]}   {"token_ids": [1, 2, 3]}

exit status: 0 when every completion matched; 1 on a mismatch or a worker error; 2 on bad
options, a missing model or an unusable server.

examples:
  kvmem generate                               # the bundled SmolLM2-135M-Instruct, 2 workers
  kvmem generate --print-serve-flags           # the kvmem serve flags of its pool
  kvmem generate --model ./my-llama --workers 4 --prompts chats.jsonl --json
  kvmem generate --socket /tmp/none.sock --workload multi-turn --num-pages 48 --max-running 2 --host-memory 256MiB
                                               # later turns load their history from the host-memory tier
"""

PAGE_SIZE = 16


def add_parser(sub: Any, name: str = "generate") -> None:
    """Register ``generate`` on the ``kvmem`` command's subparsers."""
    from kvmem.cli.options import DEFAULT_SOCKET, address, integer, option, positive_float

    p = sub.add_parser(
        name,
        help="generate text with a real model on kvmem from several engine processes, checked against transformers",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        metavar="PATH",
        default=None,
        help="a transformers model directory or a .gguf file (default: the bundled SmolLM2-135M-Instruct)",
    )
    p.add_argument("--workers", metavar="N", type=integer(1), default=None, help="engine processes (default: 2)")
    p.add_argument(
        "--disaggregate",
        metavar="P:D",
        type=_split,
        default=None,
        help="P prefill workers compute the prompts and hand each request off after its first token, with its "
        "K/V in place (kvmem's hand-offs: nothing copied); D decode workers adopt and decode them. The report "
        "gives each worker's time to first token and time per output token (instead of --workers)",
    )
    p.add_argument(
        "--prompts",
        metavar="FILE.jsonl",
        default=None,
        help="one prompt a line (see below; default: 8 short chat prompts with 2 shared system prompts)",
    )
    p.add_argument(
        "--max-new-tokens", metavar="N", type=integer(1), default=32, help="tokens per completion (default: 32)"
    )
    p.add_argument(
        "--token-budget",
        metavar="TOKENS",
        type=integer(1),
        default=128,
        help="tokens a worker computes per forward pass: decodes first, then prefill chunks and admissions; "
        "requests admitted later match the pages earlier ones cached (default: 128)",
    )
    p.add_argument(
        "--max-running",
        metavar="N",
        type=integer(1),
        default=64,
        help="requests a worker runs at once; the others wait, and match what the finished ones cached (default: 64)",
    )
    p.add_argument(
        "--speculate",
        metavar="K",
        type=integer(0),
        default=0,
        help="draft tokens per decode by prompt lookup, verified in the same forward; the completions stay the "
        "same (default: 0, none)",
    )
    p.add_argument(
        "--api",
        choices=["client", "compat"],
        default="client",
        help="drive kvmem through the batched client or through the drop-in, kvmem.client.compat (default: client)",
    )
    p.add_argument(
        "--workload",
        choices=["prompts", "multi-turn"],
        default="prompts",
        help="prompts: each prompt once (--prompts or the built-in set); multi-turn: --users conversations of "
        "--turns turns on two shared system prompts, a round per turn, each turn's prompt the whole conversation "
        "so far (the last answer and a follow-up question appended), so a turn matches its history in the prefix "
        "cache, on the host tier (--host-memory) once the pool needed those pages; the report gives the time to "
        "first token per turn (default: prompts)",
    )
    p.add_argument("--users", metavar="N", type=integer(1), default=16, help="multi-turn: conversations (default: 16)")
    p.add_argument("--turns", metavar="N", type=integer(1), default=3, help="multi-turn: turns each (default: 3)")
    p.add_argument(
        "--document-words",
        metavar="N",
        type=integer(0),
        default=0,
        help="multi-turn: each user's first turn brings a document of its own of N words (220 words: about 250 "
        "SmolLM2 tokens), a long input that every later turn of the conversation carries again, as in LMCache's "
        "long-input benchmark (default: 0, none)",
    )
    p.add_argument(
        "--host-memory",
        metavar="SIZE",
        default=None,
        help="when generate starts its own server: give it a host-memory tier of this size (kvmem serve "
        "--host-memory); with multi-turn its pool is sized to hold --max-running requests, not every "
        "conversation, so histories leave it between turns (default: none)",
    )
    p.add_argument(
        "--load-wait",
        choices=["layer", "iteration"],
        default="layer",
        help="with a host-memory tier: how a request whose prefix is still being copied in waits. layer: it "
        "computes at once, each layer's attention waiting for that layer's copy; iteration: it is held out of "
        "the forwards until its whole load is in, the others computing meanwhile (bench/tier_bench.py measures "
        "both; default: layer)",
    )
    p.add_argument(
        "--nodes",
        metavar="N",
        type=integer(1, "nodes"),
        default=1,
        help="2: two nodes on this machine sharing one store (--store): generate starts two servers, runs the "
        "prompts on node A, then the same prompts on node B, whose matches read node A's pages from the store "
        "instead of prefilling them; the report compares the nodes (default: 1)",
    )
    p.add_argument(
        "--store",
        metavar="URL",
        default=None,
        help="with --nodes 2 (or for the one server generate starts): the store the servers share (kvmem serve "
        "--store, e.g. redis://127.0.0.1:6379 or mooncake://127.0.0.1:50051?protocol=tcp); their host tiers are "
        "--host-memory, default 256MiB",
    )
    p.add_argument(
        "--store-wait-ms",
        metavar="MS",
        type=positive_float,
        default=500.0,
        help="with a store: how long at most a request whose prefix its server is fetching from the store is "
        "held for it before its tokens are computed (default: 500)",
    )
    p.add_argument(
        "--num-pages",
        metavar="N",
        type=integer(2),
        default=None,
        help="when generate starts its own server: its pool, page 0 included (default: sized for the prompts)",
    )
    p.add_argument("--no-check", action="store_true", help="skip the check against the model's own generate()")
    p.add_argument(
        "--print-serve-flags", action="store_true", help="print the kvmem serve flags this model needs, and exit"
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout (the rest goes to stderr)")
    p.add_argument(
        "--interval",
        metavar="SECONDS",
        type=positive_float,
        default=1.0,
        help="seconds between live lines (default: 1)",
    )
    p.add_argument("--corrupt-one-token", action="store_true", help=argparse.SUPPRESS)  # test hook: must fail
    # test hook, W:N: worker W sends itself SIGTERM (a drain) once it has generated N tokens
    p.add_argument("--drain-worker-after", type=_worker_after, default=None, help=argparse.SUPPRESS)
    server = p.add_argument_group("the server")
    option(server, "--socket", DEFAULT_SOCKET, "unix socket of the server")
    option(server, "--tcp", None, "HOST:PORT of the server instead of the socket", address)
    option(server, "--auth-token", None, "bearer token for TCP")


def _split(text: str) -> tuple[int, int]:
    """``A:B``, two whole numbers (A >= 1 for --disaggregate's P)."""
    a, colon, b = text.partition(":")
    if not colon or not a.isdigit() or not b.isdigit() or int(a) < 1 or int(b) < 1:
        raise argparse.ArgumentTypeError(f"expected P:D, two whole numbers of at least 1 (e.g. 1:1), got {text!r}")
    return int(a), int(b)


def _worker_after(text: str) -> tuple[int, int]:
    """``W:N``: a worker (from 0) and a token count (from 1)."""
    w, colon, n = text.partition(":")
    if not colon or not w.isdigit() or not n.isdigit() or int(n) < 1:
        raise argparse.ArgumentTypeError(f"expected W:N (worker, tokens), got {text!r}")
    return int(w), int(n)


def run(args: argparse.Namespace) -> int:
    """Run ``kvmem generate`` with the parsed options."""
    from .worker import PromptError

    try:
        return _generate(args)
    except (UsageError, PromptError) as err:
        print(f"kvmem generate: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvmem generate: interrupted", file=sys.stderr)
        return 130


def _config(model: str | None) -> Any:
    from .geometry import model_config

    if model is not None and not os.path.exists(model):
        raise UsageError(f"--model {model}: no such file or directory")
    try:
        return model_config(model)
    except (ImportError, OSError, ValueError, RuntimeError) as err:
        raise UsageError(str(err).strip().splitlines()[0]) from None


def _generate(args: argparse.Namespace) -> int:
    from .worker import builtin_prompts, multi_turn_prompts, read_prompts

    info: IO[str] = sys.stderr if args.json else sys.stdout
    if args.workload == "multi-turn":
        if args.prompts or args.disaggregate or args.drain_worker_after:
            raise UsageError(
                "--workload multi-turn makes its own prompts and runs them in rounds: no --prompts, "
                "--disaggregate or drains"
            )
        prompts = multi_turn_prompts(args.users, args.turns, args.document_words)
    else:
        if args.document_words:
            raise UsageError(f"--document-words {args.document_words}: only with --workload multi-turn")
        prompts = read_prompts(args.prompts) if args.prompts else builtin_prompts()
    from ..server_process import server_for
    from .geometry import GeometryMismatch, check_geometry, serve_flags

    config = _config(args.model)
    flags = serve_flags(config, "float32")
    if args.print_serve_flags:
        print(flags)
        return 0

    def own_argv() -> list[str]:
        host = args.host_memory or ("256MiB" if args.store else None)
        tier = ["--host-memory", host] if host else []
        tier += ["--store", args.store] if args.store else []
        return ["serve", "--device", "cpu", *flags.split(), *_sizes(prompts, args), *tier, "--log-level", "warning"]

    if args.nodes > 1:
        return _nodes(args, prompts, own_argv(), config, info)
    with server_for(args.tcp or f"unix:{args.socket}", "generate", own_argv, info) as (target, _):
        from kvmem.client.admin import stats

        try:
            check_geometry(config, stats(target, auth_token=args.auth_token, timeout=5).geometry, "float32")
        except GeometryMismatch as err:
            raise UsageError(f"the server at {target}: {err}") from None
        return _with_server(args, target, prompts, info)


def _nodes(args: argparse.Namespace, prompts: list[Any], argv: list[str], config: Any, info: IO[str]) -> int:
    """``--nodes 2``: two servers sharing the store, the prompts run on node A, then on
    node B; each node's report, then the comparison (JSON: ``{"ok", "nodes": [...]}``)."""
    from kvmem.client.admin import stats

    from ..server_process import OwnServer
    from .geometry import check_geometry

    if args.nodes != 2:
        raise UsageError(f"--nodes {args.nodes}: two nodes are what this shows (node A prefills, node B reads)")
    if not args.store:
        raise UsageError("--nodes 2 shares pages through a store: give --store URL (e.g. redis://127.0.0.1:6379)")
    if args.tcp or args.disaggregate or args.drain_worker_after:
        raise UsageError("--nodes 2 starts its own two servers: no --tcp, --disaggregate or drains")
    results: list[dict[str, Any]] = []
    codes = []
    for name in ("A", "B"):
        own = OwnServer(argv, tempfile.mkdtemp(prefix=f"kvmem-generate-node-{name.lower()}-", dir="/tmp"))
        print(f"node {name}: kvmem {' '.join(argv)}", file=info, flush=True)
        try:
            own.wait_ready()
            check_geometry(config, stats(own.target, timeout=5).geometry, "float32")
            codes.append(_with_server(args, own.target, prompts, info, node=name, collect=results))
        finally:
            print(f"node {name}: stopped its server (exit {own.stop()})", file=info)
    a, b = results
    if args.json:
        json.dump({"ok": all(r["ok"] for r in results), "nodes": results}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        store_b = b.get("store", {})
        print(
            f"nodes: node A prefilled {a['prefill_tokens']} prompt tokens ({a['matched_tokens']} matched), node B "
            f"{b['prefill_tokens']} ({b['matched_tokens']} matched; {store_b.get('pages_read', 0)} pages read "
            f"from the store, {store_b.get('rejected', 0)} refused); TTFT p50 node A "
            f"{a['ttft_p50_ms']:.0f} ms, node B {b['ttft_p50_ms']:.0f} ms"
        )
    return max(codes)


def _sizes(prompts: list[Any], args: argparse.Namespace) -> list[str]:
    """Pool options for the prompts: the longest fits the context; every request fits at
    once (multi-turn: the requests that run at once, --max-running a worker, at their
    last turn's length: not every conversation, so histories leave the pool)."""
    turn = [p.estimated_tokens() + args.max_new_tokens for p in prompts]
    lens = [n * (p.turn + 1) + 64 * p.turn for n, p in zip(turn, prompts, strict=True)]  # + the follow-ups
    max_context = PAGE_SIZE * math.ceil(max(512, max(lens)) / PAGE_SIZE)
    workers = sum(args.disaggregate) if args.disaggregate else args.workers or 2
    pages = sum(math.ceil(n / PAGE_SIZE) for n in lens) + 2 * workers
    if args.workload == "multi-turn":
        running = min(args.max_running, math.ceil(args.users / workers)) * workers
        pages = running * math.ceil(max(lens) / PAGE_SIZE) + 2 * workers
    num_pages = args.num_pages or max(pages, 2 * max_context // PAGE_SIZE) + 1
    max_context = min(max_context, (num_pages - 1) * PAGE_SIZE)  # a small --num-pages: the context it holds
    sizes = {"--page-size": PAGE_SIZE, "--num-pages": num_pages, "--max-requests": len(prompts) + 16}
    sizes["--max-context"] = max_context
    return [word for flag, value in sizes.items() for word in (flag, str(value))]


def _with_server(
    args: argparse.Namespace,
    target: str,
    prompts: list[Any],
    info: IO[str],
    node: str = "",
    collect: list[dict[str, Any]] | None = None,
) -> int:
    from kvmem.client.admin import stats

    from .moves import Router
    from .worker import GenerateConfig, worker_main

    if args.disaggregate is not None and args.workers is not None:
        raise UsageError("give --workers or --disaggregate P:D, not both")
    if args.disaggregate is not None and args.api != "client":
        raise UsageError("--disaggregate hands requests off through kvmem's client: leave --api at client")
    if args.disaggregate is not None:
        p, d = args.disaggregate
        p = min(p, len(prompts))
        roles = ["prefill"] * p + ["decode"] * d
        shares = [prompts[w::p] for w in range(p)] + [[] for _ in range(d)]
    else:
        wanted = args.workers or 2
        turns = args.turns if args.workload == "multi-turn" else 1
        n = min(wanted, len(prompts) // turns)
        if n < wanted:
            print(f"{len(prompts) // turns} {'conversations' if turns > 1 else 'prompts'}: {n} workers", file=info)
        roles = ["mixed"] * n
        shares = [[p for p in prompts if p.user % n == w] if turns > 1 else prompts[w::n] for w in range(n)]
    workers = len(roles)
    drain_w, drain_n = args.drain_worker_after or (-1, 0)
    run_id = secrets.token_hex(3)
    # a server with a store keys its pages by the model and its weights' revision
    pool_store = stats(target, auth_token=args.auth_token, timeout=5).HasField("store")
    model_id = ""
    if pool_store:
        from .models import model_id as weights_id

        model_id = weights_id(args.model)
    # the prefix cache's namespace: requests share cached K/V only with the same model's
    ident = f"{os.path.abspath(args.model)}:{os.stat(args.model).st_mtime_ns}" if args.model else "bundled-smollm2"
    ident += ":float32"
    namespace = "kvmem-generate:" + hashlib.sha256(ident.encode()).hexdigest()[:16]
    configs = [
        GenerateConfig(
            worker=w,
            target=target,
            auth_token=args.auth_token,
            model=args.model,
            prompts=shares[w],
            max_new_tokens=args.max_new_tokens,
            token_budget=args.token_budget,
            max_running=args.max_running,
            check=not args.no_check,
            session=f"kvmem-generate-{run_id}-w{w}",
            namespace=namespace,
            api=args.api,
            speculate=args.speculate,
            corrupt=args.corrupt_one_token and w == 0,
            role=roles[w],
            drain_after=drain_n if w == drain_w else 0,
            turns=args.turns if args.workload == "multi-turn" else 1,
            load_wait=args.load_wait,
            model_id=model_id,
            fetch_wait_ms=args.store_wait_ms if pool_store else 0.0,
        )
        for w in range(workers)
    ]
    split = f" ({roles.count('prefill')} prefill, {roles.count('decode')} decode)" if args.disaggregate else ""
    print(
        f"kvmem generate: {len(prompts)} prompts on {workers} workers{split}, {args.max_new_tokens} new tokens each, "
        f"against {target}; loading {args.model or 'the bundled SmolLM2-135M-Instruct'}...",
        file=info,
        flush=True,
    )
    ctx = multiprocessing.get_context("spawn")
    messages: Any = ctx.Queue()
    go, check = ctx.Event(), ctx.Event()  # check: every worker generated (see worker_main)
    # requests move between workers (drains, --disaggregate): through kvmem's client (the drop-in's
    # engine backend sends no hand-off items)
    router = Router(ctx, roles) if workers > 1 and args.api == "client" else None
    procs = [
        ctx.Process(target=worker_main, args=(c, messages, go, check, *_queues(router, c.worker)), daemon=True)
        for c in configs
    ]
    for proc in procs:
        proc.start()
    latest: dict[int, dict[str, Any]] = {}
    final: dict[int, dict[str, Any]] = {}
    ready: set[int] = set()
    checking: set[int] = set()
    errors: list[str] = []
    started = last_line = time.monotonic()
    shown: dict[int, str] = {}  # the last line shown per worker: an unchanged one is not repeated
    try:
        while len(final) < workers:
            try:
                msg = messages.get(timeout=0.1)
            except queue.Empty:
                msg = {"kind": None}
            kind, w = msg["kind"], msg.get("worker", -1)
            moved = router.handle(msg) if router is not None and kind is not None else None
            if moved is not None:
                errors.append(moved)
            if kind == "ready":
                ready.add(w)
                if len(ready) == workers:
                    started = time.monotonic()
                    go.set()
            elif kind in ("progress", "checking"):
                latest[w] = msg
                if kind == "checking":
                    checking.add(w)
            elif kind in ("done", "error"):
                final[w] = latest[w] = msg
                if kind == "error":
                    errors.append(f"worker {w}: {msg['message']}")
                    go.set()
            if len(checking | set(final)) == workers:
                check.set()
            for i, proc in enumerate(procs):
                if i not in final and not proc.is_alive() and proc.exitcode is not None:
                    final[i] = {"kind": "error"}
                    errors.append(f"worker {i}: exited ({proc.exitcode}) without a report")
                    if router is not None:
                        router.gone(i)
            now = time.monotonic()
            if go.is_set() and now - last_line >= args.interval and len(final) < workers:
                last_line = now
                _live(info, stats, target, args.auth_token, configs, latest, shown)
    finally:
        go.set()
        check.set()
        join(procs, timeout=30)
    pool = stats(target, auth_token=args.auth_token, timeout=5)
    from .report import report

    return report(args, prompts, final, errors, pool, time.monotonic() - started, info, configs, node, collect)


def _queues(router: Any, w: int) -> tuple[Any, Any]:
    """Worker ``w``'s inbox and ack queue (None, None: nothing moves)."""
    return (None, None) if router is None else (router.inbox_of(w), router.acks[w])


def _live(
    info: IO[str],
    stats: Any,
    target: str,
    token: str | None,
    configs: list[Any],
    latest: dict[int, Any],
    shown: dict[int, str],
) -> None:
    """A line per worker whose figures changed: tokens/s, requests running (the
    server's count for its session), waiting (neither finished nor running), its prefix
    hit rate (the server's count), and the pool."""
    try:
        s = stats(target, auth_token=token, timeout=2)
    except Exception:  # a sample is only a sample: the workers say what went wrong
        return
    sessions = {u.name: u for u in s.sessions}
    for c in configs:
        m = latest.get(c.worker, {})
        u = sessions.get(c.session)
        rate = m.get("generated", 0) / m["elapsed_s"] if m.get("elapsed_s") else 0.0
        running = u.num_requests if u is not None else 0
        hit = f"{u.prefix_hit_tokens / u.prefix_query_tokens:.0%}" if u is not None and u.prefix_query_tokens else "-"
        state = {"done": "done", "error": "failed", "checking": "checking"}.get(m.get("kind", ""), "running")
        waiting = max(len(c.prompts) - m.get("finished", 0) - running, 0)
        line = f"  w{c.worker} {state:<8} {rate:7.1f} tokens/s  running {running:>3}  waiting {waiting:>3}  "
        line += f"prefix hit {hit:>4}"
        if shown.get(c.worker) == line:
            continue
        shown[c.worker] = line
        pool = f"pool used {s.num_used_pages} cached {s.num_cached_pages} free {s.num_free_pages}"
        print(f"{line}  | {pool}", file=info, flush=True)
