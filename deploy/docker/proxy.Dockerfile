# The proxy sidecar: the base install only (no extras: no torch) and no worker code
# (the exl3-sidecar command's launcher comes along; it never imports the worker).
#
# Build from the repository root, with the base image pinned by digest (required: an
# empty PYTHON_IMAGE stops the build; docs/kubernetes.md, "Images", says how to find one):
#   docker build -f deploy/docker/proxy.Dockerfile \
#     --build-arg PYTHON_IMAGE=python:3.11-slim@sha256:<digest> -t exl3-sidecar-proxy:0.1.0 .
ARG PYTHON_IMAGE
FROM ${PYTHON_IMAGE}
WORKDIR /app
# Dependencies first, from the lock alone (deploy/docker/locks/compile.sh): a change to
# the source, pyproject.toml's metadata or the README reuses this layer.
COPY deploy/docker/locks/proxy.txt /tmp/locks/
RUN pip install --no-cache-dir --require-hashes -r /tmp/locks/proxy.txt \
    && useradd --uid 10001 sidecar
COPY pyproject.toml README.md ./
COPY protocol ./protocol
COPY proxy ./proxy
COPY launcher ./launcher
# Our package alone: its dependencies are the lock's, the build backend too.
RUN pip install --no-cache-dir --no-deps --no-build-isolation .
# The pod's user (deploy/k8s/base: runAsUser 10001, shared with the worker).
USER 10001
# The proxy defaults to 127.0.0.1; a container must listen on every interface to be reachable.
ENV EXL3_SIDECAR_HOST=0.0.0.0
EXPOSE 5000
ENTRYPOINT ["exl3-sidecar", "proxy"]
