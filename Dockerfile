# duplexrt serve in a container: the GPU image by default, a CPU one for trying it out.
#
#   docker build -t duplexrt:cuda .
#   docker run --gpus all --stop-timeout 330 -p 8000:8000 -e DUPLEXRT_CONFIG=moshiko \
#       -v duplexrt-hf:/home/duplexrt/.cache/huggingface \
#       -v duplexrt-compile:/home/duplexrt/.cache/compile duplexrt:cuda
#
#   docker build -t duplexrt:cpu --build-arg BASE_IMAGE=ubuntu:24.04 \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
#   docker run --stop-timeout 330 -p 8000:8000 -e DUPLEXRT_CONFIG=moshi-tiny -e NO_TORCH_COMPILE=1 duplexrt:cpu
#
# --stop-timeout 330: `docker stop` sends SIGTERM, which drains (the calls under way go on for up to
# server.shutdown_grace_s, 300 s, then two close timeouts of 3 s); Docker's own 10 s would cut them.
#
# Arguments after the image name go to `duplexrt serve` (--slots 64, --set key=value ...).
# Settings (each also a `duplexrt serve` option; see the README's configuration table):
#   DUPLEXRT_HOST      0.0.0.0 here (all interfaces), 127.0.0.1 outside a container
#   DUPLEXRT_PORT      8000, the port EXPOSEd below and the one the health check asks
#   DUPLEXRT_CONFIG    a preset's name (moshiko, hibiki, hibiki-zero, moshi-tiny ...; they are
#                      listed by `docker run --entrypoint duplexrt IMAGE configs`) or the path
#                      of a TOML file mounted into the container; unset: the echo model
#   DUPLEXRT_API_KEY   clients must send it as 'Authorization: Bearer KEY' (empty: no key)
#   DUPLEXRT_SLOTS, DUPLEXRT_BACKEND, DUPLEXRT_LOG_LEVEL
#   HF_HOME            where the weights are cached: mount a volume there to download them once
#   TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR
#                      torch.compile's caches, under /home/duplexrt/.cache/compile: mount a volume
#                      there and a restart finds its kernels compiled (0.5-1.5 min saved a start)
#
# The image has a C compiler and Python's headers (gcc, libc6-dev, python3-dev): the moshi package
# torch.compiles a few kernels on CUDA, and Triton builds a C launcher for them at run time (a CUDA
# runtime base has no compiler: without one the backend would serve eagerly, with a warning).
# The cache folders exist in the image and belong to its user (uid 10001), so a fresh named volume
# mounted on one of them starts out writable by it (Kubernetes: fsGroup does the same).
#
# This image is not built by the project's CI (its machines cannot build images).  It runs only
# what tests/test_packaging.py proves on every CI run: the wheel `python -m build` makes from this
# tree, installed into a fresh virtual environment by packaging/install.sh (torch pinned first,
# then the wheel, then the moshi package), serving `duplexrt serve` by preset name.  The CUDA base
# is what the NVIDIA container runtime expects to mount the host's driver into; torch's wheel
# brings its own CUDA libraries, so the base's CUDA version need only be one the driver supports.
# The host needs an NVIDIA driver 580 or later: torch 2.13's CUDA wheel requires it, and an older
# driver fails at the first CUDA call, not at `docker run` (check `nvidia-smi` on the host).

ARG BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# -- the wheel, built from this tree as CI builds it -------------------------------------------
FROM ${BASE_IMAGE} AS wheel
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
COPY . /src
RUN python3 -m venv /tmp/build && /tmp/build/bin/python -m pip install --no-cache-dir 'build>=1.2' \
    && /tmp/build/bin/python -m build --outdir /dist /src

# -- the image ----------------------------------------------------------------------------------
FROM ${BASE_IMAGE}
# TORCH_INDEX_URL empty: PyPI's torch (a CUDA build on Linux); the CPU variant sets it.
ARG TORCH=torch==2.13.0
ARG TORCH_INDEX_URL=
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
        gcc libc6-dev python3-dev \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 duplexrt \
    && mkdir -p /home/duplexrt/.cache/huggingface /home/duplexrt/.cache/compile/inductor \
        /home/duplexrt/.cache/compile/triton \
    && chown -R duplexrt:duplexrt /home/duplexrt/.cache \
    && python3 -m venv /opt/duplexrt
COPY --from=wheel /dist/*.whl /tmp/dist/
COPY packaging/install.sh /tmp/install.sh
RUN PIP="/opt/duplexrt/bin/python -m pip" PIP_NO_CACHE_DIR=1 sh /tmp/install.sh /tmp/dist/*.whl \
    && rm -rf /tmp/dist /tmp/install.sh

ENV PATH=/opt/duplexrt/bin:$PATH \
    DUPLEXRT_HOST=0.0.0.0 \
    DUPLEXRT_PORT=8000 \
    HF_HOME=/home/duplexrt/.cache/huggingface \
    TORCHINDUCTOR_CACHE_DIR=/home/duplexrt/.cache/compile/inductor \
    TRITON_CACHE_DIR=/home/duplexrt/.cache/compile/triton
USER duplexrt
WORKDIR /home/duplexrt
EXPOSE 8000
# Liveness (the process answers, and its model has not failed every step for 30 s); readiness to
# take calls is GET /readyz, for the balancer.  The port opens once the model has loaded: a first
# start downloads the weights (~15 GB for Moshi 7B) and compiles, so the start period is 30 min
# (Kubernetes' startup probe allows the same); a failing check before then does not count.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30m --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('DUPLEXRT_PORT', '8000'), timeout=4)"]
# SIGTERM (docker stop, Kubernetes) drains the sessions within server.shutdown_grace_s; give the
# container at least that long plus 2 x server.close_timeout_s: `docker run --stop-timeout 330`
# for the default 300 s (Kubernetes: terminationGracePeriodSeconds).
STOPSIGNAL SIGTERM
ENTRYPOINT ["duplexrt", "serve"]
