"""The server process: ``kvmem serve``'s options (:mod:`.command`), the start-up checks
and the configuration (:mod:`.startup`), TLS (:mod:`.tls`), allocator tuning
(:mod:`.tuning`) and the process itself, its event loop, signals and shutdown
(:mod:`.app`)."""
