"""Hand-offs over a real socket, between real processes: a request moves from one
scheduler process to another with its K/V in place (nothing copied), and every wrong
adoption is refused with its reason, changing nothing.

Server geometry: page size 4, pages 1..64, 8 request slots, 64 tokens a request; K/V
float32, 2 layers of 2 heads of 8.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from conftest import ServerProcess, start_server

from kvmem.client import KVMemClient, NotFound, ticket_slot
from kvmem.client.errors import FailedPrecondition, InvalidArgument, KVMemError

FLAGS = ("--num-pages", "65", "--page-size", "4", "--max-requests", "8", "--max-context", "64", "--layers", "2",
         "--kv-heads", "2", "--head-dim", "8", "--dtype", "float32", "--lease-ms", "1500")  # fmt: skip

# A's and B's program: the K/V of a position is a function of it, so B checks what A wrote
# without being told. A: attach, alloc and write 11 tokens, hand off, print the ticket, wait
# for a line, check the fence, detach. B: adopt with a decode in the same Step, read the 11
# tokens through its own row, write the 12th, check it reads back, release.
PROGRAM = r"""
import json, sys
import torch
from kvmem.client import KVMemClient, NotFound, ticket_slot

def value(pos, layer, part):
    return torch.full((2, 8), float(pos * 100 + layer * 10 + part))

def loc(kv, slot, pos):
    row = kv.block_table[slot]
    return int(row[pos // 4]) * 4 + pos % 4

role, target = sys.argv[1], sys.argv[2]
kv = KVMemClient(target, name=role)
layers = kv.kv_cache()
if role == "A":
    (slot,) = kv.open(["prompt"]).tolist()
    res = kv.alloc([slot], [11])
    for i, t in enumerate(res.kv_loc.tolist()):
        for layer, (k, v) in enumerate(layers):
            k[t], v[t] = value(i, layer, 0), value(i, layer, 1)
    (ticket,) = kv.handoff([slot], [json.dumps({"tokens": list(range(11))}).encode()])
    print(json.dumps({"ticket": ticket, "slot": slot}), flush=True)
    sys.stdin.readline()  # B has adopted
    try:
        kv.alloc([slot], [1])
    except NotFound as err:
        print(json.dumps({"fenced": "handed off by this session" in str(err)}), flush=True)
    kv.close()
else:
    ticket = sys.argv[3]
    slot = ticket_slot(ticket)
    res = kv.step(adopt=[(ticket, "decode-1")], alloc_slots=[slot], alloc_needs=[1], alloc_expected_lens=[11])
    assert res.adopt_slots.tolist() == [slot] and res.adopt_lens.tolist() == [11], res
    state = json.loads(res.adopt_states[0])
    bad = [(i, layer) for i in range(11) for layer, (k, v) in enumerate(layers)
           if not (torch.equal(k[loc(kv, slot, i)], value(i, layer, 0))
                   and torch.equal(v[loc(kv, slot, i)], value(i, layer, 1)))]
    (t,) = res.kv_loc.tolist()
    assert t == loc(kv, slot, 11), (t, loc(kv, slot, 11))
    for layer, (k, v) in enumerate(layers):
        k[t], v[t] = value(11, layer, 0), value(11, layer, 1)
    ok = all(torch.equal(layers[l][0][t], value(11, l, 0)) for l in range(2))
    kv.release([slot])
    print(json.dumps({"bad": bad, "tokens": state["tokens"], "written": ok}), flush=True)
    kv.close()
"""


@pytest.fixture
def server(tmpdir_short: str) -> Iterator[ServerProcess]:
    srv = start_server(tmpdir_short, *FLAGS)
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture
def short_window(tmpdir_short: str) -> Iterator[ServerProcess]:
    srv = start_server(tmpdir_short, *FLAGS, "--handoff-ms", "400")
    yield srv
    assert srv.stop() == 0, srv.log()


def run(role: str, target: str, *args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-c", PROGRAM, role, target, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **kw)  # fmt: skip


def test_a_request_moves_between_processes_with_its_kv_in_place(server: ServerProcess) -> None:
    """A writes a prompt's K/V and hands it off; B, another process, adopts it, reads the
    same values through its own row (nothing was copied: the same pages) and decodes on
    in the same Step; A's client refuses the slot afterwards, naming the hand-off."""
    a = run("A", server.target)
    line = a.stdout.readline()
    assert line, a.communicate()[1]
    handed = json.loads(line)
    with KVMemClient(server.target, name="observer") as obs:
        s = obs.stats(audit=True)
        assert (s.num_handoff_tickets, s.num_handoff_pages, s.num_handed_off) == (1, 3, 1) and s.audit.ok
        assert [u.num_pages_held for u in s.sessions if u.name == "A"] == [0]
        table = subprocess.run([sys.executable, "-m", "kvmem.cli", "stats", "--socket", server.socket_path],
                               capture_output=True, text=True, timeout=60).stdout  # fmt: skip
        assert "hand-offs open 1 (3 pages, counted in used)" in table, table
        b = run("B", server.target, handed["ticket"])
        out, err = b.communicate(timeout=60)
        assert b.returncode == 0, err
        got = json.loads(out)
        assert got == {"bad": [], "tokens": list(range(11)), "written": True}, got
        out, err = a.communicate("adopted\n", timeout=60)
        assert a.returncode == 0, err
        assert json.loads(out) == {"fenced": True}
        s = obs.stats(audit=True)
        assert (s.num_handoff_tickets, s.num_adopted, s.num_used_pages) == (0, 1, 0) and s.audit.ok


def test_wrong_adoptions_are_refused_and_change_nothing(server: ServerProcess, tmpdir_short: str) -> None:
    with KVMemClient(server.target, name="giver") as a, KVMemClient(server.target, name="taker") as b:
        (slot,) = a.open(["r"]).tolist()
        a.alloc([slot], [6])
        (ticket,) = a.handoff([slot])
        assert ticket_slot(ticket) == slot
        before = b.stats()
        forged = f"{slot}." + "f" * 32
        with pytest.raises(NotFound, match="TICKET_NOT_FOUND") as err:
            b.adopt([forged], ["x"])
        assert forged not in str(err.value)
        with pytest.raises(InvalidArgument, match="repeats adopt_tickets"):
            b.adopt([ticket, ticket], ["x", "y"])
        with pytest.raises(KVMemError, match="QUOTA_EXCEEDED"):
            with KVMemClient(server.target, name="small", quota_pages=1) as small:
                small.adopt([ticket], ["x"])
        with KVMemClient(server.target, name="other-model", cache_namespace="qwen") as c:
            with pytest.raises(FailedPrecondition, match="NAMESPACE_MISMATCH") as err:
                c.adopt([ticket], ["x"])
            assert "'qwen'" in str(err.value) and "''" in str(err.value)
        after = b.stats()
        assert (after.num_handoff_tickets, after.num_free_pages) == (before.num_handoff_tickets, before.num_free_pages)
        res = b.adopt([ticket], ["x"])
        assert res.adopt_lens.tolist() == [6]
        with pytest.raises(NotFound, match="TICKET_NOT_FOUND"):  # single-use
            b.adopt([ticket], ["y"])
        # The client fences a slot it handed off until the server gives it back (an Open)
        with pytest.raises(NotFound, match="handed off by this session"):
            a.alloc([slot], [1])
        b.release([slot])
        assert a.open(["again"]).tolist() == [slot]
        a.alloc([slot], [1])


def test_a_ticket_not_adopted_in_the_window_or_whose_giver_ended_is_released(short_window: ServerProcess) -> None:
    server = short_window
    with KVMemClient(server.target, name="taker") as b:
        free = b.stats().num_free_pages
        with KVMemClient(server.target, name="late") as a:
            (slot,) = a.open(["r"]).tolist()
            a.alloc([slot], [8])
            (late,) = a.handoff([slot])
            deadline = time.monotonic() + 30
            while b.stats().num_handoff_tickets and time.monotonic() < deadline:  # --handoff-ms 400
                time.sleep(0.05)
            s = b.stats(audit=True)
            assert (s.num_handoff_tickets, s.num_handoffs_expired, s.num_free_pages) == (0, 1, free) and s.audit.ok
            with pytest.raises(NotFound, match="TICKET_NOT_FOUND"):
                b.adopt([late], ["x"])
        a = KVMemClient(server.target, name="leaving")
        (slot,) = a.open(["r"]).tolist()
        a.alloc([slot], [8])
        (gone,) = a.handoff([slot])
        a.close()  # detached before anyone adopted: released with the session
        s = b.stats(audit=True)
        assert (s.num_handoff_tickets, s.num_handoffs_given_up, s.num_free_pages) == (0, 1, free) and s.audit.ok
        with pytest.raises(NotFound, match="TICKET_NOT_FOUND"):
            b.adopt([gone], ["x"])
    assert "hand-off tickets released count=1" in server.log()
