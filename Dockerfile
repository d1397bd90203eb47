# duplexrt serve in a container: the GPU image by default, a CPU one for trying it out.
#
#   docker build -t duplexrt:cuda .
#   docker run --gpus all -p 8000:8000 -e DUPLEXRT_CONFIG=moshiko \
#       -v duplexrt-hf:/home/duplexrt/.cache/huggingface duplexrt:cuda
#
#   docker build -t duplexrt:cpu --build-arg BASE_IMAGE=ubuntu:24.04 \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
#   docker run -p 8000:8000 -e DUPLEXRT_CONFIG=moshi-tiny -e NO_TORCH_COMPILE=1 duplexrt:cpu
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
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 duplexrt \
    && python3 -m venv /opt/duplexrt
COPY --from=wheel /dist/*.whl /tmp/dist/
COPY packaging/install.sh /tmp/install.sh
RUN PIP="/opt/duplexrt/bin/python -m pip" PIP_NO_CACHE_DIR=1 sh /tmp/install.sh /tmp/dist/*.whl \
    && rm -rf /tmp/dist /tmp/install.sh

ENV PATH=/opt/duplexrt/bin:$PATH \
    DUPLEXRT_HOST=0.0.0.0 \
    DUPLEXRT_PORT=8000 \
    HF_HOME=/home/duplexrt/.cache/huggingface
USER duplexrt
WORKDIR /home/duplexrt
EXPOSE 8000
# Liveness only (the process answers); readiness to take calls is GET /readyz, for the balancer.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('DUPLEXRT_PORT', '8000'), timeout=4)"]
# SIGTERM (docker stop, Kubernetes) drains the sessions within server.shutdown_grace_s; give the
# container at least that long (Kubernetes: terminationGracePeriodSeconds).
ENTRYPOINT ["duplexrt", "serve"]
