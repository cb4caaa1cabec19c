"""``kvmem simulate``: scheduler worker processes against a kvmem server, each the
engine's scheduler (:mod:`kvmem.engine.scheduler`) with the simulator's policy
(:mod:`.policy`) and its synthetic model (:mod:`.synthetic`), on a seeded workload
(:mod:`.workload`), every page read back and checked before release (:mod:`.kv_check`).

* :mod:`.command` -- the options (``kvmem simulate --help``); :mod:`.run` -- the run:
  the server it starts or finds, the worker processes (:mod:`.worker`), the live view and
  report (:mod:`.report`), and the ``--baseline`` on the reference allocator
  (:mod:`.reference`).

It imports no transformers and nothing of :mod:`kvmem.engine.generate`.
"""
