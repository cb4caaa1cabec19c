# syntax=docker/dockerfile:1
# The kvmem sidecar: one per GPU node, sharing a socket volume (and /dev/shm, or the GPU
# and the IPC namespace for CUDA IPC) with the engine's scheduler workers.
#
#   CPU (shm backend, no torch in the image):
#     docker build -t kvmem:cpu .
#   CUDA (the cuda backend exports CUDA IPC handles through torch, pinned to the tested
#   version; TORCH_INDEX_URL is the wheel index of the CUDA build you want, empty: pip's
#   default index, which for Linux x86_64 serves a CUDA build):
#     docker build -t kvmem:cuda --build-arg VARIANT=cuda --build-arg TORCH_INDEX_URL=<index> .
#
#   docker run --shm-size 1g -v kvmem-sock:/run/kvmem kvmem:cpu serve
#   (a named volume; a bind-mounted host directory must be writable by uid 10001 or gid 0)
#
# docs/DEPLOY.md: sizing /dev/shm and the pool, Kubernetes, GPU notes, security.
ARG PYTHON=3.11

FROM python:${PYTHON}-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/kvmem
# Dependencies first, in their own layers: an edit of the source rebuilds only the last one.
COPY deploy/requirements-server.txt /tmp/requirements-server.txt
RUN /opt/kvmem/bin/pip install -r /tmp/requirements-server.txt
ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=
RUN if [ "$VARIANT" = "cuda" ]; then \
        /opt/kvmem/bin/pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}"; \
    elif [ "$VARIANT" != "cpu" ]; then echo "VARIANT must be cpu or cuda, got $VARIANT" >&2; exit 2; fi
COPY pyproject.toml README.md LICENSE /src/
COPY proto /src/proto
COPY server /src/server
COPY client /src/client
COPY engine /src/engine
COPY cli /src/cli
RUN /opt/kvmem/bin/pip install --no-deps /src

FROM python:${PYTHON}-slim AS runtime
COPY --from=build /opt/kvmem /opt/kvmem
ENV PATH=/opt/kvmem/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    KVMEM_SOCKET=/run/kvmem/kvmem.sock
# A fixed non-root user (uid 10001, group 0 as OpenShift-style platforms expect); the
# socket directory is its own. The socket and the shm files are 0600: an engine in
# another container reaches them through the shared volumes when it runs as this uid.
RUN useradd --system --uid 10001 --gid 0 --home-dir /run/kvmem --no-create-home kvmem \
    && mkdir -p /run/kvmem && chown 10001:0 /run/kvmem && chmod 0770 /run/kvmem
USER 10001
VOLUME ["/run/kvmem"]
EXPOSE 9400
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=4s --start-period=30s --retries=3 \
    CMD ["kvmem", "health", "--timeout", "3"]
ENTRYPOINT ["kvmem"]
CMD ["serve"]
