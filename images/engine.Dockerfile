# syntax=docker/dockerfile:1.7
# The engine image: `pdpool serve` with torch (CUDA) and NIXL. Also carries the sidecar,
# so one image can run a whole pod if you prefer that.
#
#   docker build -f images/engine.Dockerfile -t pdpool-engine:dev .
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/pdpool
ENV PATH=/opt/pdpool/bin:$PATH
# torch first, from the CUDA wheel index: the biggest layer, cached across code changes.
RUN pip install --index-url ${TORCH_INDEX} "torch>=2.4"
COPY pyproject.toml setup.py README.md* /src/
COPY pdpool /src/pdpool
COPY engine /src/engine
COPY kernels /src/kernels
COPY sidecar /src/sidecar
COPY operator /src/operator
# nixl wheels bundle UCX; triton ships with torch.
RUN pip install "/src[engine,nixl]" huggingface_hub

FROM python:${PYTHON_VERSION}-slim
RUN apt-get update && apt-get install -y --no-install-recommends libnuma1 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/pdpool /opt/pdpool
ENV PATH=/opt/pdpool/bin:$PATH PYTHONUNBUFFERED=1 HF_HOME=/tmp/hf
# Non-root; model volumes must be readable by uid 65532 (or set fsGroup).
USER 65532:65532
EXPOSE 8000 5600
ENTRYPOINT []
CMD ["pdpool", "serve", "--help"]
