"""The kvmem server (the sidecar), in five parts:

* :mod:`.core` -- the allocation core: page pool, request slots, block table, prefix
  cache, batched steps (pure numpy);
* :mod:`.memory` -- the KV memory backends (POSIX shared memory, CUDA IPC) and geometry;
* :mod:`.sessions` -- who is attached: leases, quotas, fencing, over one core;
* :mod:`.edge` -- the gRPC service: the handlers, the one guard every call passes, the
  proto <-> core translation (``wire``) and the refusal log;
* :mod:`.process` -- the process: ``kvmem serve``'s options, start-up checks, TLS, the
  event loop and the shutdown;
* :mod:`.observe` -- Prometheus metrics and KV events (gRPC WatchEvents, vLLM's ZMQ).

:mod:`.errors` is the one error taxonomy every part raises. The server imports neither
the client (:mod:`kvmem.client`) nor the engine (:mod:`kvmem.engine`).
"""
