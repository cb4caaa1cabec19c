"""A full snapshot of a KVCore's state, for tests that check a call changed nothing."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from kvmem.server.core import KVCore


def snapshot(core: KVCore) -> dict:
    """Everything a call could change: block table, reference counts, the free stack
    (contents and order), per-slot lengths and owners, the free request slots, per-owner
    accounting (by owner index), and the public stats."""
    pool, slots = core.pool, core.slots
    return {
        "block_table": core.block_table.copy(),
        "ref_cnt": pool.ref_cnt.copy(),
        "num_free": pool.num_free,
        "free_stack": pool.free_pages().copy(),
        "alloced": slots.alloced.copy(),
        "owner_of": slots.owner_of.copy(),
        "free_slots": slots.free_slots().tolist(),
        "owners": {
            index: (o.num_pages_held, o.num_requests, dict(o.request_slots)) for index, o in slots.owners.items()
        },
        "stats": core.stats(),
    }


@contextlib.contextmanager
def cut_everywhere(methods: dict[type, tuple[str, ...]], cut: Callable[[str], None]) -> Iterator[None]:
    """Call ``cut(where)`` before and after each of ``methods`` (by class) and at each of
    the core's named crash points (:mod:`kvmem.server.core.crash`), until the block ends:
    where a test takes the state a crash there would leave."""
    from kvmem.server.core import crash

    originals: list[tuple[type, str, object]] = []
    for cls, names in methods.items():
        for name in names:
            method = getattr(cls, name)

            def wrapper(self, *args, _m=method, _n=f"{cls.__name__}.{name}", **kwargs):  # type: ignore[no-untyped-def]
                cut(f"before {_n}")
                out = _m(self, *args, **kwargs)
                cut(f"after {_n}")
                return out

            setattr(cls, name, wrapper)
            originals.append((cls, name, method))
    crash.hook, crash.armed = cut, True
    try:
        yield
    finally:
        crash.hook, crash.armed = None, False
        for cls, name, method in originals:
            setattr(cls, name, method)
