# The GPU engine worker. exllamav3 1.6.5 ships no prebuilt extension: it compiles its
# CUDA code on first import, so the image needs the CUDA toolkit (devel), and the
# build cache is kept in the image by importing once at build time on a GPU builder,
# or on first start otherwise (minutes).
FROM nvidia/cuda:12.8.1-devel-ubuntu24.04
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential ninja-build \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
COPY pyproject.toml README.md ./
# The worker's own package and the contract only: no proxy code in a worker image.
COPY protocol ./protocol
COPY engine_worker ./engine_worker
RUN pip install --no-cache-dir torch ".[exllamav3]"
ENTRYPOINT ["python", "-m", "engine_worker", "--backend", "exllamav3"]
