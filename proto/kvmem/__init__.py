"""kvmem: a KV-cache memory manager for LLM inference.

``kvmem.server`` owns the page pool (the core, the memory backends, the gRPC service);
``kvmem.client`` is what scheduler workers import; ``kvmem.v1`` is the generated wire
contract they share. The client and the server share no Python code but that.
"""

__version__ = "0.1.0"
