# syntax=docker/dockerfile:1.7
# The engine image: `pdpool serve` with torch (PyPI's default linux wheel: the CUDA build)
# and NIXL. Also carries the sidecar, gateway, EPP and operator, so one image can run any
# role of a pool.
#
#   scripts/images/build.sh engine          # podman, no registry needed (docs/kubernetes.md)
#   docker build -f images/engine.Dockerfile -t pdpool-engine:dev .
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim AS build
# Empty: PyPI (torch's CUDA build for linux x86_64). A wheel index URL to pick another build,
# e.g. https://download.pytorch.org/whl/cpu for a CPU-only image.
ARG TORCH_INDEX=""
# A CA bundle for pip when the registries are reached through a re-signing proxy (the
# bundle is mounted for the build only: scripts/images/build.sh).
ARG PIP_CERT
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/pdpool
ENV PATH=/opt/pdpool/bin:$PATH
# torch first: the biggest layer, cached across code changes.
RUN pip install ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "torch>=2.4"
COPY pyproject.toml setup.py README.md* /src/
COPY pdpool /src/pdpool
COPY engine /src/engine
COPY kernels /src/kernels
COPY sidecar /src/sidecar
COPY operator /src/operator
# nixl wheels bundle UCX; triton ships with torch. Non-editable: /src is not in the image.
RUN pip install "/src[engine,nixl,operator]" huggingface_hub \
    && python -c "import pdpool.engine.server.api, pdpool.sidecar, pdpool.operator.handlers"

FROM python:${PYTHON_VERSION}-slim
# Triton compiles its launcher with a C compiler at first use (gcc, libc headers; Python.h
# is in the python image); NIXL's UCX loads libnuma.
RUN if ! command -v gcc >/dev/null || ! ldconfig -p | grep -q libnuma.so.1; then \
      apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev libnuma1 \
      && rm -rf /var/lib/apt/lists/*; fi
COPY --from=build /opt/pdpool /opt/pdpool
# Read-only root filesystem: every place a library writes is under /tmp by default (an
# emptyDir in the pool's pods; the operator points the caches at its /cache volume).
ENV PATH=/opt/pdpool/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp XDG_CACHE_HOME=/tmp/.cache XDG_CONFIG_HOME=/tmp/.config \
    HF_HOME=/tmp/.cache/huggingface TORCH_HOME=/tmp/.cache/torch \
    TORCHINDUCTOR_CACHE_DIR=/tmp/.cache/torchinductor TRITON_CACHE_DIR=/tmp/.cache/triton \
    TRITON_HOME=/tmp/.cache CUDA_CACHE_PATH=/tmp/.cache/nv NUMBA_CACHE_DIR=/tmp/.cache/numba \
    MPLCONFIGDIR=/tmp/.config/matplotlib PDPOOL_KERNEL_CACHE=/tmp/.cache/pdpool-kernels \
    UCX_HOME=/tmp TOKENIZERS_PARALLELISM=false
# Non-root; model volumes must be readable by uid 65532 (or set fsGroup).
USER 65532:65532
WORKDIR /tmp
EXPOSE 8000 5600
# One entrypoint for every role: `pdpool serve|sidecar|gateway|epp|operator ...`.
ENTRYPOINT ["pdpool"]
CMD ["serve", "--help"]
