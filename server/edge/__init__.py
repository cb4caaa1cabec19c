"""The gRPC edge of the server: the service's handlers (:mod:`.service`), the one guard
every call passes (:mod:`.guard`: admission, malformed bodies, refusal logging, metrics,
abort), the registration of every service behind it (:mod:`.handlers`), the proto <->
core translation (:mod:`.wire`) and the rate-limited refusal log (:mod:`.refusals`)."""
