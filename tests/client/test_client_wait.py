"""A client started before its server: the Attach waits for readiness up to its timeout
(``wait_for_ready``, on by default), as a scheduler started before its sidecar needs.
Real server processes, started late on purpose."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
from conftest import ServerProcess, short_tmpdir, start_server

from kvmem.client import AsyncKVMemClient, KVMemClient, Unavailable


def start_later(directory: str, delay: float, into: list[ServerProcess]) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)
        into.append(start_server(directory, wait=False))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.timeout(90)
def test_the_sync_client_waits_for_a_server_that_starts_later() -> None:
    directory = short_tmpdir()
    servers: list[ServerProcess] = []
    thread = start_later(directory, 1.0, servers)
    try:
        t0 = time.monotonic()
        with KVMemClient(os.path.join(directory, "kvmem.sock"), name="early", timeout=60) as kv:
            assert time.monotonic() - t0 >= 1.0 and kv.epoch
            [slot] = kv.open(["r"]).tolist()
            assert kv.alloc([slot], [3]).ok
    finally:
        thread.join()
        for srv in servers:
            assert srv.stop() == 0, srv.log()


@pytest.mark.timeout(90)
def test_the_asyncio_client_waits_too() -> None:
    directory = short_tmpdir()
    servers: list[ServerProcess] = []
    thread = start_later(directory, 1.0, servers)

    async def main() -> str:
        async with await AsyncKVMemClient.connect(os.path.join(directory, "kvmem.sock"), timeout=60) as kv:
            return kv.epoch

    try:
        assert asyncio.run(main())
    finally:
        thread.join()
        for srv in servers:
            assert srv.stop() == 0, srv.log()


def test_it_gives_up_at_its_timeout_or_at_once_without_waiting() -> None:
    missing = os.path.join(short_tmpdir(), "none.sock")
    t0 = time.monotonic()
    with pytest.raises(Unavailable):
        KVMemClient(missing, timeout=1.0)
    assert 0.9 <= time.monotonic() - t0 < 5
    t0 = time.monotonic()
    with pytest.raises(Unavailable):
        KVMemClient(missing, timeout=30, wait_for_ready=False)
    assert time.monotonic() - t0 < 5
