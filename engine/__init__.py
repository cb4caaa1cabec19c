"""kvmem's engines: scheduler workers that drive a model over kvmem's KV memory.

Two products share one continuous-batching scheduler (:mod:`.scheduler`):

* :mod:`.simulate` -- ``kvmem simulate``: worker processes with the synthetic model on a
  seeded workload, every page read back and checked before release, and the baseline
  on the reference allocator;
* :mod:`.generate` -- the real-model engine: :class:`~kvmem.engine.generate.Engine`, a
  transformers model whose attention reads and writes kvmem's pages, and
  ``kvmem generate`` (several engine processes, requests handed between them).

What both use, beside them: :mod:`.scheduler` (the loop: plan, send, apply, forward,
take; the :class:`~.scheduler.Policy` that differs between the products),
:mod:`.request` (the request and its hand-off state), :mod:`.backend` (the allocator
seam and kvmem's client behind it; :mod:`.compat_backend`, the drop-in), :mod:`.forward`
(the model seam), :mod:`.handoff` (the hand-off policy), :mod:`.process` and
:mod:`.server_process` (worker processes, a server started as a process).

The engine uses kvmem through the client library (:mod:`kvmem.client`) only; it starts a
server as a process (``kvmem serve``), never imports one.
"""
