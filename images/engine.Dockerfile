# syntax=docker/dockerfile:1.7
# The engine image: `pdpool serve` with torch (PyPI's default linux wheel: the CUDA build)
# and NIXL. Also carries the sidecar, gateway, EPP and operator, so one image can run any
# role of a pool.
#
#   scripts/images/build.sh engine          # podman, no registry needed (docs/kubernetes.md)
#   docker build -f images/engine.Dockerfile -t pdpool-engine:dev .
#
# Layers: the runtime (venv, torch, the dependencies, gcc) changes only with pyproject.toml;
# the code is one small layer on top, so a code change rebuilds, stores and ships megabytes,
# not the venv's gigabytes (the final image is the runtime stage plus that layer).
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim AS runtime
# Empty: PyPI (torch's CUDA build for linux x86_64). A wheel index URL to pick another build,
# e.g. https://download.pytorch.org/whl/cpu for a CPU-only image.
ARG TORCH_INDEX=""
# A CA bundle for pip when the registries are reached through a re-signing proxy (the
# bundle is mounted for the build only: scripts/images/build.sh).
ARG PIP_CERT
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/pdpool
ENV PATH=/opt/pdpool/bin:$PATH
# torch first: the biggest layer.
RUN pip install ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "torch>=2.4"
# Then the package's dependencies alone (an empty package of the same name, installed and
# removed).
COPY pyproject.toml setup.py /src/
RUN touch /src/README.md \
    && pip install "/src[engine,nixl,operator]" huggingface_hub \
    && pip uninstall -y pdpool && rm -rf /src
# Triton compiles its launcher with a C compiler at first use (gcc, libc headers; Python.h
# is in the python image); NIXL's UCX loads libnuma.
RUN if ! command -v gcc >/dev/null || ! ldconfig -p | grep -q libnuma.so.1; then \
      apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev libnuma1 \
      && rm -rf /var/lib/apt/lists/*; fi
# A name for uid 65532 (kopf, getpass and others look the user up).
RUN groupadd -g 65532 pdpool && useradd -u 65532 -g 65532 -d /tmp -M -s /usr/sbin/nologin pdpool

FROM runtime AS build
# Build arguments are per stage: pip needs the CA bundle here too.
ARG PIP_CERT
# The README is the package's long description only: an empty one, so that editing the
# docs never rebuilds the images.
COPY pyproject.toml setup.py /src/
RUN touch /src/README.md
COPY pdpool /src/pdpool
COPY engine /src/engine
COPY kernels /src/kernels
COPY sidecar /src/sidecar
COPY operator /src/operator
# Non-editable (/src is not in the image), under /code as it will lie in the final image:
# the package, its metadata and the `pdpool` script (whose #! names /opt/pdpool/bin/python).
RUN pip install --no-deps --root /code /src \
    && PYTHONPATH=$(echo /code/opt/pdpool/lib/python*/site-packages) python -c \
       "import pdpool.engine.server.api, pdpool.sidecar, pdpool.operator.handlers"

FROM runtime
COPY --from=build /code/ /
# Read-only root filesystem: every place a library writes is under /tmp by default (an
# emptyDir in the pool's pods; the operator points the caches at its /cache volume).
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
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
