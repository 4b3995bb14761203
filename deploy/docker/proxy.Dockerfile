# The proxy sidecar: the base install only (no extras: no torch) and no worker code
# (the exl3-sidecar command's launcher comes along; it never imports the worker).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY protocol ./protocol
COPY proxy ./proxy
COPY launcher ./launcher
RUN pip install --no-cache-dir . && useradd --uid 10001 sidecar
# The pod's user (deploy/k8s/base: runAsUser 10001, shared with the worker).
USER 10001
# The proxy defaults to 127.0.0.1; a container must listen on every interface to be reachable.
ENV EXL3_SIDECAR_HOST=0.0.0.0
EXPOSE 5000
ENTRYPOINT ["exl3-sidecar", "proxy"]
