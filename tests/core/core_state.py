"""A full snapshot of a KVCore's state, for tests that check a call changed nothing."""

from __future__ import annotations

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
