"""The kvmem server: the allocation core, the memory backends and the gRPC service."""
