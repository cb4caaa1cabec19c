"""One scheduler process of ``bench/fault_run.py`` (not meant to be run by hand).

It attaches to the server, opens requests and steps them (prefill, then decode, with a
speculative truncate now and then), and for every token a Step hands it writes a pattern
into K and V of every layer at the token's ``kv_loc``: the pattern names this worker,
this process, the request and the token's position, so any byte found different later
was written by someone else (and says by whom). Every ``--verify-every`` steps, and
before a request is released, it reads back all its written tokens and compares.

The two disciplines it follows, as a scheduler must (docs/DESIGN.md, Leases and fencing; docs/OPERATIONS.md, Fencing):

- write only right after checking that ``kv.lease_remaining()`` is comfortably
  positive (``--margin-ms``); a failed check skips the write and drops the requests
  it was for (they are released on the next step);
- count a read-back only if the lease still held after it: a mismatch seen while the
  session is known to be alive is a *foreign write* (someone wrote into a page this
  session holds), reported with the page, the position and what was found there.

On SessionLost, Unavailable or a missed deadline it follows the recovery recipe: drop its
views, close the client, attach again (a new session, retried while the server is away),
map the memory again and open new requests.

Protocol with the driver: commands on stdin, one per line (``drain``: verify, release
everything and idle attached; ``exit``: detach and exit; end of input: exit); events on
stdout, one per line, ``EV <json>`` with at least ``ev`` and ``t`` (``time.monotonic()``,
the same clock in every process of the machine). Diagnostics go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import random
import signal
import sys
import threading
import time
import traceback
from typing import Any

import torch

from kvmem.client import AllocStatus, KVMemClient
from kvmem.client.errors import KVMemError, SessionLost, Unavailable
from kvmem.client.memory import MemoryMapError

OK = int(AllocStatus.OK)
OUT_OF_PAGES = int(AllocStatus.OUT_OF_PAGES)
PATTERN_WIDTH = 8  # the pattern's columns; the pool's head_dim must be at least this

# Pattern columns (float32, exact integers below 2**24).
C_WID, C_NONCE, C_SERIAL, C_POS, C_LAYER, C_KIND, C_CHECK, C_MAGIC = range(PATTERN_WIDTH)
MAGIC = 7.0


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when the driver dies (Linux), so no worker
    outlives a driver killed without cleaning up."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Fatal(Exception):
    """The worker cannot go on (no server to attach to for too long)."""


class Req:
    """One request as this process knows it: its slot, tokens allocated (``length``), the
    first ``written`` of them holding its pattern, and the ``kv_loc`` of every token."""

    __slots__ = ("abort", "length", "locs", "oop", "rid", "serial", "slot", "target", "written")

    def __init__(self, rid: str, serial: int, slot: int, target: int) -> None:
        self.rid = rid
        self.serial = serial
        self.slot = slot
        self.target = target
        self.length = 0
        self.written = 0
        self.locs = torch.empty(0, dtype=torch.int64)
        self.oop = 0  # OUT_OF_PAGES answers in a row
        self.abort = False  # release at the next step (a skipped write, a foreign write)


class Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.wid = args.wid
        self.pid = os.getpid()
        self.rng = random.Random(args.seed)
        self.nonce = self.rng.randrange(1, 1 << 20)  # tells this process's writes from an earlier one's
        self.command: str | None = None
        self.wake = threading.Event()
        self.out_lock = threading.Lock()
        self.kv: KVMemClient | None = None
        self.views: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.reqs: list[Req] = []
        self.serial = 0
        self.gen = 0
        self.name = ""
        self.epoch = ""
        self.drained = False
        self.steps_in_session = 0
        self.offsets: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.page_size = 0
        self.counts: dict[str, int] = dict.fromkeys(
            (
                "calls", "steps", "attaches", "attach_retries", "opens", "requests_done", "tokens_written",
                "tokens_verified", "verifies", "out_of_pages", "preempted", "truncates", "write_skipped",
                "tokens_skipped", "late_writes", "verify_discarded", "foreign_writes", "foreign_tokens",
                "lost_withheld", "lost_server", "lost_epoch", "lost_keepalive", "lost_unavailable",
                "lost_deadline", "errors", "rogue_writes", "table_mismatches", "resumes", "tokens_lost",
            ),
            0,
        )  # fmt: skip
        self.last_stat = 0.0
        self.next_rogue = time.monotonic() + args.rogue_every

    # ------------------------------------------------------------------ I/O

    def emit(self, ev: str, **fields: Any) -> None:
        line = json.dumps({"ev": ev, "t": time.monotonic(), "wid": self.wid, "pid": self.pid, **fields})
        with self.out_lock:
            sys.stdout.write("EV " + line + "\n")
            sys.stdout.flush()

    def stat(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last_stat >= self.args.stat_every:
            self.last_stat = now
            self.emit("stat", counts=self.counts)

    def read_commands(self) -> None:
        for line in sys.stdin:
            cmd = line.strip()
            if cmd in ("drain", "exit"):
                self.command = cmd
                self.wake.set()
        self.command = "exit"  # the driver is gone
        self.wake.set()

    # -------------------------------------------------------------- pattern

    def pattern(self, serial: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """[n, PATTERN_WIDTH] float32 rows for the tokens ``pos`` of requests ``serial``
        (layer and kind columns zero: added per layer, K or V, head)."""
        n = pos.numel()
        rows = torch.zeros(n, PATTERN_WIDTH, dtype=torch.float32)
        rows[:, C_WID] = self.wid + 1
        rows[:, C_NONCE] = self.nonce
        rows[:, C_SERIAL] = serial.to(torch.float32)
        rows[:, C_POS] = pos.to(torch.float32)
        rows[:, C_CHECK] = ((serial * 31 + pos * 17 + self.wid * 7 + self.nonce) % (1 << 22)).to(torch.float32)
        rows[:, C_MAGIC] = MAGIC
        return rows

    def make_offsets(self, heads: int, head_dim: int, layers: int) -> None:
        """Per layer, (K, V) additions [heads, head_dim] that make the base rows the
        layer's, K's or V's, and the head's pattern (zero past the pattern's width)."""
        self.offsets = []
        for layer in range(layers):
            pair = []
            for kind in (1, 2):
                off = torch.zeros(heads, head_dim, dtype=torch.float32)
                off[:, C_LAYER] = layer
                off[:, C_KIND] = torch.arange(heads, dtype=torch.float32) * 2 + kind
                pair.append(off)
            self.offsets.append((pair[0], pair[1]))

    def expected(self, base: torch.Tensor, layer: int, kind: int) -> torch.Tensor:
        heads, head_dim = self.offsets[layer][kind].shape
        full = torch.zeros(base.shape[0], heads, head_dim, dtype=torch.float32)
        full[:, :, :PATTERN_WIDTH] = base.unsqueeze(1)
        return full + self.offsets[layer][kind]

    # ------------------------------------------------------------- session

    def attach(self) -> None:
        deadline = time.monotonic() + self.args.attach_timeout
        delay = 0.05
        while True:
            if self.command == "exit":
                raise Fatal("exit asked while attaching")
            self.gen += 1
            name = f"w{self.wid:02d}-p{self.pid}-g{self.gen}"
            t0 = time.monotonic()
            kv = None
            try:
                kv = KVMemClient(self.args.target, name=name, timeout=self.args.call_timeout,
                                 on_resumed=self.resumed)  # fmt: skip
                self.counts["calls"] += 1
                g = kv.geometry
                layout = g.layout
                if layout.head_dim < PATTERN_WIDTH or layout.dtype != "float32":
                    raise Fatal(f"the pool must be float32 with head_dim >= {PATTERN_WIDTH}, got {layout}")
                views = kv.kv_cache()
            except (KVMemError, MemoryMapError) as err:
                if kv is not None:
                    kv.close()
                self.counts["attach_retries"] += 1
                if time.monotonic() > deadline:
                    raise Fatal(f"could not attach for {self.args.attach_timeout:g} s: {err}") from None
                # The server is away (killed, restarting): back off; nothing to race with here.
                self.wake.wait(delay)
                delay = min(delay * 2, 0.5)
                continue
            self.kv, self.views, self.name, self.epoch = kv, list(views), name, kv.epoch  # type: ignore[arg-type]
            self.page_size = g.page_size
            self.make_offsets(layout.num_kv_heads, layout.head_dim, layout.num_layers)
            self.counts["attaches"] += 1
            self.steps_in_session = 0
            self.emit("attached", name=name, epoch=kv.epoch, took_s=round(time.monotonic() - t0, 4),
                      nonce=self.nonce)  # fmt: skip
            return

    def resumed(self, info: Any) -> None:
        """The client resumed the session after a server restart (--keep-state): the
        requests go on as they were; told to the driver as an attach to the new run."""
        self.counts["resumes"] += 1
        self.epoch = info.epoch
        self.emit("attached", name=self.name, epoch=info.epoch, took_s=round(info.outage_s, 4), nonce=self.nonce,
                  resumed=True)  # fmt: skip

    def drop(self) -> None:
        """The recovery recipe's first half: drop every view and all request state, close
        the client (it detaches if the session still lives, closes its keep-alive). The
        tokens of the requests dropped are lost: a real scheduler computes them again."""
        self.counts["tokens_lost"] += sum(r.length for r in self.reqs)
        self.views = None
        self.reqs = []
        kv, self.kv = self.kv, None
        if kv is not None:
            kv.close()

    def open_new(self, n: int) -> None:
        if n <= 0 or self.drained:
            return
        assert self.kv is not None
        ids, serials = [], []
        for _ in range(n):
            self.serial += 1
            serials.append(self.serial)
            ids.append(f"w{self.wid}-{self.nonce}-{self.serial}")
        slots = self.kv.open(ids).tolist()
        self.counts["calls"] += 1
        self.counts["opens"] += n
        a = self.args
        for rid, serial, slot in zip(ids, serials, slots, strict=True):
            self.reqs.append(Req(rid, serial, slot, self.rng.randint(a.min_len, a.max_len)))

    # ----------------------------------------------------------------- step

    def iteration(self) -> None:
        assert self.kv is not None
        a, rng = self.args, self.rng
        self.steps_in_session += 1
        due = self.steps_in_session % a.verify_every == 0
        if due:
            self.verify(self.reqs)  # may abort requests: computed before the releases
        releases = [r for r in self.reqs if r.abort or r.length >= r.target or r.oop >= a.max_oop]
        if releases and not due:
            self.verify(releases)  # every request is read back whole before it ends
        releasing = {id(r) for r in releases}
        rest = [r for r in self.reqs if id(r) not in releasing]
        truncs = [
            (r, r.length - rng.randint(1, min(8, r.length - 1)))
            for r in rest
            if r.length > 8 and rng.random() < a.truncate_p
        ]
        new_len = {id(r): n for r, n in truncs}
        allocs = []
        for r in rest:
            need = rng.randint(a.prefill_min, a.prefill_max) if r.length == 0 else rng.randint(1, a.decode_max)
            base = new_len.get(id(r), r.length)
            allocs.append((r, min(need, max(r.target - base, 1))))
        res = self.kv.step(
            release_slots=[r.slot for r in releases],
            truncate_slots=[r.slot for r, _ in truncs],
            truncate_lens=[n for _, n in truncs],
            alloc_slots=[r.slot for r, _ in allocs],
            alloc_needs=[n for _, n in allocs],
            alloc_expected_lens=[new_len.get(id(r), r.length) for r, _ in allocs],
        )
        self.counts["calls"] += 1
        self.counts["steps"] += 1
        # The answer is ours (the client withheld it otherwise): apply it.
        for r in releases:
            if r.oop >= a.max_oop:
                self.counts["preempted"] += 1
            elif not r.abort:
                self.counts["requests_done"] += 1
        self.reqs = rest
        for r, n in truncs:
            r.length, r.written, r.locs = n, min(r.written, n), r.locs[:n]
            self.counts["truncates"] += 1
        status = res.status.tolist()
        if len(status) != len(allocs):
            raise AssertionError(f"{len(allocs)} alloc items, {len(status)} statuses")
        done: list[Req] = []
        locs, serials, positions = [], [], []
        for i, (r, need) in enumerate(allocs):
            st = status[i]
            if st == OK:
                loc = res.kv_loc_of(i).to(torch.int64)
                if loc.numel() != need:
                    raise AssertionError(f"alloc of {need} tokens returned {loc.numel()} kv_loc")
                locs.append(loc)
                serials.append(torch.full((need,), r.serial, dtype=torch.int64))
                positions.append(torch.arange(r.length, r.length + need, dtype=torch.int64))
                r.locs = torch.cat([r.locs, loc])
                r.length += need
                r.oop = 0
                done.append(r)
            elif st == OUT_OF_PAGES:
                r.oop += 1
                self.counts["out_of_pages"] += 1
            else:
                raise AssertionError(f"alloc status {st} for {need} tokens on a request of {r.length}")
        if locs:
            self.write(done, torch.cat(locs), torch.cat(serials), torch.cat(positions))
        if a.rogue_every > 0 and time.monotonic() >= self.next_rogue:
            self.next_rogue = time.monotonic() + a.rogue_every
            self.rogue_write()
        self.open_new(a.requests - len(self.reqs))

    def rogue_write(self) -> None:
        """The self-check (``--rogue-every``): write into the first token of a page that
        another session's request holds (read from the block table), as a broken
        fence would. Its owner must report a foreign write with this worker's pattern
        (serial 0)."""
        assert self.kv is not None and self.views is not None
        rows = self.kv.block_table.clone()
        rows[0] = 0
        for r in self.reqs:
            rows[r.slot] = 0
        pages = rows[rows > 0]
        if pages.numel() == 0:
            return
        page = int(pages[self.rng.randrange(pages.numel())])
        loc = page * self.page_size
        base = self.pattern(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
        k, _ = self.views[0]
        k[loc] = self.expected(base, 0, 0)[0]
        self.counts["rogue_writes"] += 1
        self.emit("rogue", page=page, kv_loc=loc, name=self.name)

    def write(self, done: list[Req], locs: torch.Tensor, serials: torch.Tensor, positions: torch.Tensor) -> None:
        """Write the pattern of every token the step handed over, all in one go (as one
        kernel launch would), right after the lease check."""
        assert self.kv is not None and self.views is not None
        base = self.pattern(serials, positions)
        pats = [(self.expected(base, layer, 0), self.expected(base, layer, 1)) for layer in range(len(self.views))]
        remaining = self.kv.lease_remaining()
        if remaining < self.args.margin_ms / 1000:
            self.counts["write_skipped"] += 1
            self.counts["tokens_skipped"] += locs.numel()
            for r in done:
                r.abort = True  # never written: dropped at the next step
            self.emit("skip", remaining_ms=round(remaining * 1000, 1), tokens=locs.numel(), name=self.name)
            return
        for (k, v), (pk, pv) in zip(self.views, pats, strict=True):
            k[locs] = pk
            v[locs] = pv
        after = self.kv.lease_remaining()
        if after <= 0:  # the documented window: stopped between the check and the write
            self.counts["late_writes"] += 1
            self.emit("late_write", remaining_ms=round(after * 1000, 1), tokens=locs.numel(), name=self.name)
        for r in done:
            r.written = r.length
        self.counts["tokens_written"] += locs.numel()

    def verify(self, reqs: list[Req]) -> None:
        """Read back every written token of ``reqs`` in K and V of every layer, and
        their block-table rows (which must list the pages their ``kv_loc`` lie in)."""
        assert self.kv is not None and self.views is not None
        held = [r for r in reqs if r.length > 0]
        table = self.kv.block_table
        rows = [(r, table[r.slot].clone()) for r in held]
        live = [r for r in reqs if r.written > 0]
        if not live:
            if rows and self.kv.lease_remaining() > 0:
                self.check_rows(rows)
            return
        locs = torch.cat([r.locs[: r.written] for r in live])
        serials = torch.cat([torch.full((r.written,), r.serial, dtype=torch.int64) for r in live])
        positions = torch.cat([torch.arange(r.written, dtype=torch.int64) for r in live])
        base = self.pattern(serials, positions)
        bad = torch.zeros(locs.numel(), dtype=torch.bool)
        found: list[tuple[int, int, torch.Tensor]] = []
        for layer, (k, v) in enumerate(self.views):
            for kind, t in enumerate((k, v)):
                got = t[locs]
                wrong = (got != self.expected(base, layer, kind)).flatten(1).any(dim=1)
                if bool(wrong.any()):
                    bad |= wrong
                    found.append((layer, kind, got[wrong]))
        remaining = self.kv.lease_remaining()
        if remaining <= 0:  # the session may have ended during the read: the pages may be another's
            self.counts["verify_discarded"] += 1
            self.emit("verify_discarded", remaining_ms=round(remaining * 1000, 1), name=self.name)
            return
        self.counts["verifies"] += 1
        self.counts["tokens_verified"] += locs.numel()
        self.check_rows(rows)
        if not bool(bad.any()):
            return
        idx = bad.nonzero().flatten()
        n_bad = idx.numel()
        owner = torch.cat([torch.full((r.written,), i, dtype=torch.int64) for i, r in enumerate(live)])
        examples = []
        for j in idx[:5].tolist():
            r = live[int(owner[j])]
            loc = int(locs[j])
            examples.append(
                {
                    "kv_loc": loc,
                    "page": loc // self.page_size,
                    "request": r.rid,
                    "slot": r.slot,
                    "position": int(positions[j]),
                    "expected_row": base[j].tolist(),
                }
            )
        layer, kind, rows = found[0]
        first = rows[0].reshape(-1, rows.shape[-1])[0, :PATTERN_WIDTH].tolist()
        writer = None
        if first[C_MAGIC] == MAGIC:
            writer = {"wid": int(first[C_WID]) - 1, "nonce": int(first[C_NONCE]), "serial": int(first[C_SERIAL]),
                      "position": int(first[C_POS])}  # fmt: skip
        self.counts["foreign_writes"] += 1
        self.counts["foreign_tokens"] += n_bad
        for j in idx.tolist():  # released at the next step, not read back (nor reported) again
            r = live[int(owner[j])]
            r.abort, r.written = True, 0
        self.emit(
            "foreign",
            name=self.name,
            epoch=self.epoch,
            tokens=n_bad,
            of=locs.numel(),
            lease_remaining_ms=round(remaining * 1000, 1),
            layer=layer,
            kind="KV"[kind],
            found_row=first,
            writer=writer,
            examples=examples,
        )

    def check_rows(self, rows: list[tuple[Req, torch.Tensor]]) -> None:
        """Each request's block-table row, read while the lease held, against the pages
        its ``kv_loc`` lie in: the first ``ceil(length / page_size)`` entries, zeros after."""
        ps = self.page_size
        for r, row in rows:
            pages = r.locs[0::ps] // ps
            n = pages.numel()
            if torch.equal(row[:n].to(torch.int64), pages) and not bool(row[n:].any()):
                continue
            self.counts["table_mismatches"] += 1
            self.emit(
                "table_mismatch",
                name=self.name,
                epoch=self.epoch,
                request=r.rid,
                slot=r.slot,
                length=r.length,
                pages_expected=pages.tolist(),
                row=row[: n + 4].tolist(),
            )

    def drain(self) -> None:
        assert self.kv is not None
        self.verify(self.reqs)
        if self.reqs:
            self.kv.step(release_slots=[r.slot for r in self.reqs])
            self.counts["calls"] += 1
            self.counts["steps"] += 1
        self.reqs = []
        self.drained = True
        self.emit("drained", name=self.name)

    # ------------------------------------------------------------------ run

    def lost(self, err: KVMemError, where: str) -> None:
        text = str(err)
        if isinstance(err, SessionLost):
            if "withheld" in text:
                kind = "withheld"
            elif "restarted (epoch" in text:
                kind = "epoch"
            elif "keep-alive stream" in text:
                kind = "keepalive"
            else:
                kind = "server"
        elif isinstance(err, Unavailable):
            kind = "unavailable"
        else:
            kind = "deadline"
        self.counts[f"lost_{kind}"] += 1
        tokens = sum(r.length for r in self.reqs)  # dropped with the session: computed again
        self.emit("lost", kind=kind, where=where, name=self.name, message=text[:300], tokens=tokens)

    def run(self) -> int:
        threading.Thread(target=self.read_commands, name="commands", daemon=True).start()
        self.emit("hello", nonce=self.nonce)
        stop_at = time.monotonic() + self.args.max_seconds
        code = 0
        try:
            while self.command != "exit" and time.monotonic() < stop_at:
                where = "attach"
                try:
                    self.attach()
                    where = "open"
                    self.open_new(self.args.requests)
                    while self.command != "exit" and time.monotonic() < stop_at:
                        self.stat()
                        if self.command == "drain" and not self.drained:
                            where = "drain"
                            self.drain()
                        if self.drained:
                            self.wake.wait(0.5)
                            self.wake.clear()
                            continue
                        where = "step"
                        self.iteration()
                except SessionLost as err:
                    self.lost(err, where)
                    self.drop()
                except Unavailable as err:
                    self.lost(err, where)
                    self.drop()
                except KVMemError as err:
                    if err.code.name != "DEADLINE_EXCEEDED":
                        raise
                    self.lost(err, where)
                    self.drop()
        except Fatal as err:
            if self.command != "exit":
                self.emit("fatal", message=str(err))
                code = 3
        except Exception as err:  # a kvmem error that no fault explains, or this worker's own bug
            self.counts["errors"] += 1
            self.emit("error", name=self.name, epoch=self.epoch, type=type(err).__name__, message=str(err)[:2000],
                      traceback=traceback.format_exc()[-4000:])  # fmt: skip
            code = 2
        self.stat(force=True)
        with contextlib.suppress(Exception):
            self.drop()
        self.emit("final", counts=self.counts, code=code)
        return code


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--wid", type=int, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--prefill-min", type=int, default=16)
    p.add_argument("--prefill-max", type=int, default=96)
    p.add_argument("--decode-max", type=int, default=4)
    p.add_argument("--min-len", type=int, default=48)
    p.add_argument("--max-len", type=int, default=320)
    p.add_argument("--truncate-p", type=float, default=0.05)
    p.add_argument("--max-oop", type=int, default=3)
    p.add_argument("--verify-every", type=int, default=4)
    p.add_argument("--margin-ms", type=float, default=250.0)
    p.add_argument("--call-timeout", type=float, default=10.0)
    p.add_argument("--attach-timeout", type=float, default=60.0)
    p.add_argument("--stat-every", type=float, default=1.0)
    p.add_argument("--max-seconds", type=float, default=3600.0)
    p.add_argument("--rogue-every", type=float, default=0.0)
    args = p.parse_args()
    _die_with_parent()
    code = Worker(args).run()
    sys.stdout.flush()
    os._exit(code)  # skip torch's slow interpreter teardown


if __name__ == "__main__":
    main()
