"""The gRPC edge of the server: the service's handlers (:mod:`.service`), the guard
every call passes and the registration of every service (:mod:`.handlers`), the proto <->
core translation (:mod:`.wire`) and the rate-limited refusal log (:mod:`.refusals`)."""
