# syntax=docker/dockerfile:1.7
# The slim image: sidecar, gateway, EPP and operator. No torch, no CUDA.
#
#   scripts/images/build.sh slim            # podman, no registry needed (docs/kubernetes.md)
#   docker build -f images/slim.Dockerfile -t pdpool-slim:dev .
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim AS build
# A CA bundle for pip behind a re-signing proxy (mounted for the build only).
ARG PIP_CERT
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/pdpool
ENV PATH=/opt/pdpool/bin:$PATH
COPY pyproject.toml setup.py README.md* /src/
COPY pdpool /src/pdpool
COPY engine /src/engine
COPY kernels /src/kernels
COPY sidecar /src/sidecar
COPY operator /src/operator
# Base dependencies (fastapi, httpx, ...) + kopf/kubernetes; the engine extra is left out.
RUN pip install "/src[operator]" && python -c "import pdpool.operator.handlers, pdpool.sidecar" \
    && ! python -c "import torch" 2>/dev/null

FROM python:${PYTHON_VERSION}-slim
COPY --from=build /opt/pdpool /opt/pdpool
# Read-only root filesystem: whatever a library writes goes under /tmp (an emptyDir).
ENV PATH=/opt/pdpool/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp XDG_CACHE_HOME=/tmp/.cache XDG_CONFIG_HOME=/tmp/.config \
    HF_HOME=/tmp/.cache/huggingface TOKENIZERS_PARALLELISM=false
USER 65532:65532
WORKDIR /tmp
EXPOSE 8080
# `pdpool sidecar|gateway|epp|operator ...`
ENTRYPOINT ["pdpool"]
CMD ["--help"]
