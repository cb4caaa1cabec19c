"""``kvmem simulate``: its options and help (the run itself, which imports torch:
:mod:`kvmem.engine.simulate.run`). The ``kvmem`` dispatcher (:mod:`kvmem.cli`) imports this
module only for ``simulate``."""

from __future__ import annotations

import argparse
from typing import Any

DESCRIPTION = """\
Run many scheduler workers against one kvmem server and watch what it does for them.

Each worker is its own process, attached to the server like any scheduler, running a
continuous-batching loop on a synthetic workload (seeded): requests arrive, are admitted
with a prefix-cache match (a share of them start with one of a few system prompts that
every worker uses), prefill in chunks within a token budget per iteration, decode (some
with speculative drafts, the rejected ones truncated), are preempted when the pool runs
out of pages (the youngest is released and requeued), and are released with their
tokens when done, so their pages stay cached for the others. One Step per iteration.

Two ways to drive kvmem (--api): the batched client (KVMemClient.step: the iteration's
allocs, releases, truncates, caches and matches as columns of one call), or the drop-in
for schedulers written against the reference allocator (kvmem.client.compat.KVAllocator:
the reference's per-request alloc(req, need, alloced_len) inside one `with
allocator.iteration():` block, request indices instead of slots, req_to_page as the block
table, match_prefix, cache_request and finish for the prefix cache). The same seed gives
the same workload either way.

Every token's K and V (every layer) is written at its kv_loc through the mapped KV
memory, with values that depend on the token's whole prefix; before each release the
worker reads its pages back through the block table, as an attention kernel would, and
checks every value. A wrong page is a failure: the run stops and exits 1, naming the
request, the page and the position.

When no server answers at --socket (or --tcp), simulate starts one for the run (with
--device, and a pool sized for the workload), says so, and stops it at the end.
"""

EPILOG = """\
what the numbers mean:
  done          requests finished (read back, checked and released) of those arrived
  running       requests holding pages now; waiting: arrived, not admitted yet
  steps, steps/s
                Step calls (one per scheduler iteration) and their rate
  step p50/p99  the round trip of one Step, as the worker measured it
  prefix hit    prompt tokens found in the prefix cache of those looked up (a match
                asks for all but the last prompt token); shared across workers
  preempted     requests released on OUT_OF_PAGES and requeued (they prefill again,
                mostly from the cache)
  pool          the server's pages: used (held by requests), cached (held only by the
                prefix cache, evicted when an alloc needs them), free
  allocator time per iteration
                the allocator's time per scheduler iteration (its Step and Open
                calls; with --api compat, the drop-in's own work too) and its
                round trips to the server per iteration; with --baseline, beside
                the reference allocator's calls in-process
  pages to provision
                kvmem: the shared pool's peak; reference: the sum of each worker's
                own peak (without sharing, each worker's pool must hold its own)
  verified      requests read back through the block table before their release,
                with their tokens and pages: every layer's K and V, compared exactly
  workload digest
                a hash of every request generated (arrival, lengths, tokens): the
                same seed and options give the same digest

exit status: 0 when every request finished and every page read back as written; 1 on
a wrong page or a worker error; 2 on bad options or a missing prerequisite.

examples:
  kvmem serve &                     # a server at /tmp/kvmem.sock
  kvmem simulate                    # the simulation against it (or, with none, against its own)
  kvmem simulate --workers 8 --duration 30 --json > run.json
  kvmem simulate --api client       # the batched client instead of the drop-in
  kvmem simulate --baseline --plot pool.png   # beside the reference allocator; pip install 'kvmem[plot]'
  kvmem simulate --socket /tmp/none.sock --workload multi-turn --num-pages 700 --host-memory 64MiB
                                    # chat histories kept in the host-memory tier of the server it starts
"""


def _fraction(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number from 0 to 1, got {raw!r}")
    return value


def _non_negative_float(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {raw!r}")
    return value


def add_parser(sub: Any, name: str = "simulate") -> None:
    """Register ``simulate`` on the ``kvmem`` command's subparsers."""
    from kvmem.cli.options import DEFAULT_SOCKET, address, device, integer, option, positive_float

    p = sub.add_parser(
        "simulate",
        help="run scheduler workers against a server and show what kvmem does (a live view, a report)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    server = p.add_argument_group("the server")
    option(server, "--socket", DEFAULT_SOCKET, "unix socket of the server")
    option(server, "--tcp", None, "HOST:PORT of the server instead of the socket", address)
    option(server, "--auth-token", None, "bearer token for TCP")
    server.add_argument(
        "--device",
        metavar="DEVICE",
        type=device,
        default="cpu",
        help="when simulate starts its own server: where its KV memory lives, cpu (shared memory) "
        "or cuda:N; a running server's is what it is (default: cpu)",
    )
    server.add_argument(
        "--num-pages",
        metavar="N",
        type=integer(2),
        default=None,
        help="when simulate starts its own server: its pool, page 0 included (default: sized for "
        "the workload, so that it fits with the prefix cache's sharing but not without)",
    )

    server.add_argument(
        "--host-memory",
        metavar="SIZE",
        default=None,
        help="when simulate starts its own server: give it a host-memory tier of this size (kvmem serve "
        "--host-memory: evicted prefixes are kept in host memory and loaded back on a match; default: none)",
    )
    server.add_argument(
        "--host-write-policy",
        choices=["write-back", "write-through"],
        default="write-back",
        help="with --host-memory, for the server simulate starts: when cached pages are copied to the host tier "
        "(kvmem serve --host-write-policy; default: write-back)",
    )

    server.add_argument(
        "--nodes",
        metavar="N",
        type=integer(1),
        default=1,
        help="2: two nodes on this machine sharing one store (--store): simulate starts two servers and runs the "
        "workload on node A, then the same workload on node B, whose matches read node A's pages from the "
        "store (their K/V checked as always); the report compares the nodes (default: 1)",
    )
    server.add_argument(
        "--store",
        metavar="URL",
        default=None,
        help="with --nodes 2 (or for the one server simulate starts): the store the servers share (kvmem serve "
        "--store, e.g. redis://127.0.0.1:6379); their host tiers are --host-memory, default 64MiB",
    )
    server.add_argument(
        "--store-wait-ms",
        metavar="MS",
        type=positive_float,
        default=200.0,
        help="with a store: how long at most a request whose prefix its server is fetching from the store is "
        "held for it (default: 200)",
    )

    work = p.add_argument_group("the workload (per worker; the same seed and options give the same requests)")
    work.add_argument(
        "--workers", metavar="N", type=integer(1), default=4, help="scheduler worker processes (default: 4)"
    )
    work.add_argument(
        "--requests", metavar="N", type=integer(1), default=200, help="requests per worker (default: 200)"
    )
    work.add_argument(
        "--duration",
        metavar="SECONDS",
        type=positive_float,
        default=None,
        help="run for this many seconds instead: arrivals stop then, and the requests that "
        "arrived finish (default: off)",
    )
    work.add_argument(
        "--workload",
        choices=["default", "multi-turn"],
        default="default",
        help="default: independent requests (some on shared system prompts, some speculative); multi-turn: chat "
        "users whose conversations grow turn by turn (--turns) on the shared system prompts, each turn's prompt "
        "the whole conversation so far, the users interleaved so that a history waits for the others' turns "
        "(with a pool smaller than all histories, it leaves the device between turns: --host-memory keeps it); "
        "the report gives the time to first token per turn (default: default)",
    )
    work.add_argument(
        "--turns", metavar="N", type=integer(2), default=4, help="multi-turn: turns per conversation (default: 4)"
    )
    work.add_argument("--seed", metavar="N", type=int, default=0, help="seed of the workload (default: 0)")
    work.add_argument(
        "--arrival-rate",
        metavar="RATE",
        type=_non_negative_float,
        default=0.3,
        help="mean arrivals per scheduler iteration, a Poisson process (0: all at once; default: 0.3, about what "
        "a worker of 32 running requests finishes)",
    )
    work.add_argument(
        "--prompt-len",
        metavar="TOKENS",
        type=integer(1),
        default=192,
        help="mean prompt length after any system prompt, tokens (lognormal; default: 192)",
    )
    work.add_argument(
        "--output-len", metavar="TOKENS", type=integer(1), default=96, help="mean output length, tokens (default: 96)"
    )
    work.add_argument(
        "--system-prompts",
        metavar="N",
        type=integer(0),
        default=4,
        help="system prompts common to all workers (default: 4)",
    )
    work.add_argument(
        "--system-prompt-len",
        metavar="TOKENS",
        type=integer(1),
        default=512,
        help="mean system prompt length, tokens (0.5x to 1.5x; default: 512)",
    )
    work.add_argument(
        "--shared",
        metavar="FRACTION",
        type=_fraction,
        default=0.75,
        help="share of requests that start with a system prompt (default: 0.75)",
    )
    work.add_argument(
        "--spec",
        metavar="FRACTION",
        type=_fraction,
        default=0.25,
        help="share of requests that decode with speculative drafts (default: 0.25)",
    )
    work.add_argument("--spec-k", metavar="K", type=integer(1), default=4, help="drafts per decode step (default: 4)")
    work.add_argument(
        "--accept",
        metavar="P",
        type=_fraction,
        default=0.7,
        help="probability that each draft is accepted, until the first rejection (default: 0.7)",
    )

    sched = p.add_argument_group("the schedulers")
    sched.add_argument(
        "--api",
        choices=("compat", "client"),
        default="compat",
        help="how the workers drive kvmem: compat, the drop-in KVAllocator with the reference allocator's "
        "interface (one iteration block per scheduler iteration: one Step, plus an Open when it starts "
        "requests); client, the batched KVMemClient.step (default: compat)",
    )
    sched.add_argument(
        "--max-running", metavar="N", type=integer(1), default=32, help="requests a worker runs at once (default: 32)"
    )
    sched.add_argument(
        "--forward-ms",
        metavar="MS",
        type=_non_negative_float,
        default=10.0,
        help="the model's forward pass per iteration, slept after each Step: what the scheduler's "
        "allocator time compares with (0: none, as fast as the CPU goes; default: 10)",
    )
    sched.add_argument(
        "--chunk-tokens",
        metavar="TOKENS",
        type=integer(1),
        default=512,
        help="tokens a worker computes per iteration: decodes first, then prefill chunks (default: 512)",
    )

    out = p.add_argument_group("output")
    out.add_argument(
        "--json", action="store_true", help="print the final report as JSON on stdout (the live view goes to stderr)"
    )
    out.add_argument(
        "--plot",
        metavar="FILE.png",
        default=None,
        help="draw the pool's occupancy and the prefix hit rate over time into FILE.png "
        "(needs matplotlib: pip install 'kvmem[plot]')",
    )
    out.add_argument(
        "--interval",
        metavar="SECONDS",
        type=positive_float,
        default=None,
        help="seconds between live updates (default: 0.5 on a terminal, 2 otherwise)",
    )

    base = p.add_argument_group("baseline")
    base.add_argument(
        "--baseline",
        action="store_true",
        help="then run the same workload on the reference allocator in-process (one per worker, "
        "no sharing, no prefix cache) and print both side by side",
    )
    base.add_argument(
        "--reference",
        metavar="PATH",
        default=None,
        help="the reference allocator's seed_kv_allocator.py (default: "
        "../shared/reference/seed_kv_allocator.py beside the kvmem repository)",
    )
    p.add_argument("--corrupt-one-value", action="store_true", help=argparse.SUPPRESS)  # test hook: must fail


def run(args: argparse.Namespace) -> int:
    """Run ``kvmem simulate`` with the parsed options."""
    from kvmem.engine.simulate.run import simulate  # imports torch: only when run

    return simulate(args)
