"""What the server shows of itself: Prometheus metrics (:mod:`.metrics`), the KV-event
log that WatchEvents streams (:mod:`.events`) and its publisher in vLLM's ZMQ format
(:mod:`.events_zmq`)."""
