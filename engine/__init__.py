"""kvmem's engine: scheduler workers that drive a model over kvmem's KV memory, and
``kvmem simulate``, which runs them.

* :mod:`.scheduler` -- the continuous-batching loop: admission with a prefix match,
  chunked prefill, decode, speculative drafts, preemption, release into the cache;
* :mod:`.model` -- the model seam: what the loop calls for each iteration's forward pass
  (:class:`~.model.SyntheticModel`, which writes the pattern K/V, or a transformers
  model, :mod:`.hf_model`, whose attention reads and writes kvmem's pages,
  :mod:`.attention`);
* :mod:`.generate` -- :class:`~.generate.Engine`, a transformers model completing and
  streaming prompts on a kvmem server, through the client or the drop-in (its loop,
  :mod:`.loop`; its models, :mod:`.models`; ``kvmem generate``; the ``model`` extra);
* :mod:`.backend` -- the allocator seam: the Step the loop plans and the answer it reads
  (kvmem's client, the drop-in, or the reference allocator);
* :mod:`.kv_check` -- the pattern K/V and the check that reads it back;
* :mod:`.workload` -- the seeded synthetic requests;
* :mod:`.worker` -- one worker process (on the batched client or on the drop-in,
  :mod:`.compat_driver`);
* :mod:`.run`, :mod:`.report`, :mod:`.server_process`, :mod:`.reference`,
  :mod:`.command` -- ``kvmem simulate``: the run, its live view and report, the server it
  starts, the reference-allocator baseline and the options.

The engine uses kvmem through the client library (:mod:`kvmem.client`) only; it starts a
server as a process (``kvmem serve``), never imports one.
"""
