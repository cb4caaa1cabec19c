"""A full snapshot of a KVCore's state, for tests that check a call changed nothing."""

from __future__ import annotations

from kvmem.server.core import KVCore


def snapshot(core: KVCore) -> dict:
    """Everything a call could change: block table, reference counts, the free stack
    (contents and order), per-slot lengths and owners, the free request slots, per-owner
    accounting, and the public stats."""
    pool = core.pool
    return {
        "block_table": core.block_table.copy(),
        "ref_cnt": pool.ref_cnt.copy(),
        "num_free": pool.num_free,
        "free_stack": pool._free[: pool.num_free].copy(),
        "alloced": core._alloced.copy(),
        "owner_of": core._owner_of.copy(),
        "free_slots": core._free_slots[: core._num_free_slots].tolist(),
        "owners": {
            name: (o.quota_pages, o.num_pages_held, o.num_requests, dict(o.request_slots))
            for name, o in core._owners.items()
        },
        "stats": core.stats(),
    }
