"""The cluster tier (``kvmem serve --store URL``): kvmem's pages in an existing
distributed store (Mooncake Store, Redis, Redis Cluster, Valkey) under content keys, so
a prefix one node computed is read on every other.

:mod:`.base` is the store interface and the URL; one adapter module per store
(:mod:`.redis_store`, :mod:`.mooncake_store`); :mod:`.value` the keys and the
self-checking values; :mod:`.link` the server's store thread between the host tier and
the store.
"""
