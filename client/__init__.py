"""The kvmem client library, used by scheduler workers."""
