# syntax=docker/dockerfile:1.7
# The slim image: sidecar, gateway and operator. No torch, no CUDA (about 200 MB).
#
#   docker build -f images/slim.Dockerfile -t pdpool-slim:dev .
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim AS build
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
ENV PATH=/opt/pdpool/bin:$PATH PYTHONUNBUFFERED=1
USER 65532:65532
EXPOSE 8080
ENTRYPOINT []
CMD ["pdpool", "--help"]
