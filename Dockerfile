# kvmem sidecar: one per GPU node, sharing a socket volume with the scheduler workers.
#   docker build -t kvmem .
#   docker run --ipc=host -v /run/kvmem:/run/kvmem kvmem serve --socket /run/kvmem/kvmem.sock
# Prometheus metrics: add --metrics 0.0.0.0:9400 (or KVMEM_METRICS) and publish the port.
# --ipc=host (or a shared /dev/shm) lets workers map the shm backend's files; for the
# cuda backend run with the GPU runtime (--gpus ...) and install a CUDA build of torch
# (TORCH_SPEC=torch, the default, resolves to one on x86_64).
FROM python:3.11-slim

ARG TORCH_SPEC="torch>=2.4"
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    KVMEM_SOCKET=/run/kvmem/kvmem.sock

WORKDIR /opt/kvmem
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY server ./server
COPY client ./client
RUN pip install --no-cache-dir "${TORCH_SPEC}" && pip install --no-cache-dir . \
    && mkdir -p /run/kvmem

VOLUME ["/run/kvmem"]
EXPOSE 9400
HEALTHCHECK --interval=10s --timeout=4s --start-period=30s --retries=3 \
    CMD ["kvmem", "health", "--timeout", "3"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["kvmem"]
CMD ["serve"]
