"""Walk one decode Step from the client's call to its answer: every kvmem function it
passes, in order, on both sides, and which files.

The server runs in this process's main thread (``kvmem.server.process.app.serve``), the
client in a second thread; both threads carry a profile hook that records nothing until
the one Step under study starts (after an Attach, an Open, a prefill and a few decodes,
so the stream and the caches are warm). Only functions of kvmem's own files are recorded
(``server/``, ``client/``, ``cli/``, ``proto/``); gRPC, numpy and asyncio are the hops
between them.

    .venv/bin/python bench/step_walk.py [--requests 256] [--calls]

Prints the files in the order first reached, each with the functions called in it, the
number of distinct files and of file-to-file hops, and the total of kvmem calls. The
counts of "how often is the session looked up, the prefix check made, the columns
checked" are read from the list (the function names say it).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
OURS = tuple(str(ROOT / d) + os.sep for d in ("server", "client", "cli", "proto"))
recording = threading.Event()
calls: list[tuple[str, str, str]] = []  # (side, file, function)


def _hook(side: str) -> Callable[..., Any]:
    def hook(frame: Any, event: str, _arg: Any) -> None:
        if event != "call" or not recording.is_set():
            return
        path = frame.f_code.co_filename
        if path.startswith(OURS):
            calls.append((side, os.path.relpath(path, ROOT), frame.f_code.co_qualname))

    return hook


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256, help="requests decoding in the Step (default 256)")
    parser.add_argument("--calls", action="store_true", help="also print every call in order")
    args = parser.parse_args()

    try:
        from kvmem.server.process.app import serve
        from kvmem.server.process.startup import ServerConfig
    except ImportError:  # a checkout from before the house (bench/interleave.sh's A side)
        from kvmem.server.app import serve  # type: ignore[no-redef]
        from kvmem.server.startup import ServerConfig  # type: ignore[no-redef]

    folder = tempfile.mkdtemp(prefix="kvmem-walk-")
    sock = os.path.join(folder, "kvmem.sock")
    config = ServerConfig(socket_path=sock, shm_dir=folder, num_pages=4096, max_requests=max(256, args.requests))
    failure: list[BaseException] = []

    def client() -> None:
        sys.setprofile(_hook("client"))
        try:
            from kvmem.client import KVMemClient

            deadline = time.monotonic() + 60
            while not os.path.exists(sock) and time.monotonic() < deadline:
                time.sleep(0.05)
            with KVMemClient(sock, name="walk") as kv:
                slots = kv.open([f"r{i}" for i in range(args.requests)])
                assert kv.alloc(slots, [40] * args.requests).ok
                for _ in range(5):
                    assert kv.alloc(slots, [1] * args.requests).ok
                recording.set()
                result = kv.alloc(slots, [1] * args.requests)
                recording.clear()
                assert result.ok
        except BaseException as exc:  # reported by the main thread
            failure.append(exc)
        finally:
            sys.setprofile(None)
            os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=client, name="client")
    sys.setprofile(_hook("server"))
    thread.start()
    serve(config)
    sys.setprofile(None)
    thread.join()
    if failure:
        raise failure[0]

    order: dict[str, list[str]] = {}
    hops, last = 0, None
    for side, path, name in calls:
        order.setdefault(path, [])
        if name not in order[path]:
            order[path].append(name)
        if last is not None and path != last:
            hops += 1
        last = path
    print(f"one decode Step of {args.requests} requests, client call to answer: {len(calls)} kvmem calls, "
          f"{len(order)} files, {hops} hops between files")  # fmt: skip
    sides = {path: side for side, path, _ in calls}
    for path, names in order.items():
        print(f"  [{sides[path]}] {path}: {', '.join(names)}")
    if args.calls:
        for side, path, name in calls:
            print(f"    {side:6} {path}:{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
