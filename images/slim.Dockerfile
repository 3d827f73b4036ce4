# syntax=docker/dockerfile:1.7
# The slim image: sidecar, gateway, EPP and operator. No torch, no CUDA.
#
#   scripts/images/build.sh slim            # podman, no registry needed (docs/kubernetes.md)
#   docker build -f images/slim.Dockerfile -t pdpool-slim:dev .
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim AS runtime
# A CA bundle for pip behind a re-signing proxy (mounted for the build only).
ARG PIP_CERT
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/pdpool
ENV PATH=/opt/pdpool/bin:$PATH
# The package's dependencies alone (an empty package of the same name, installed and
# removed): base dependencies (fastapi, httpx, ...) + kopf/kubernetes, the engine extra left
# out. Rebuilt only when pyproject.toml changes.
COPY pyproject.toml setup.py /src/
RUN touch /src/README.md && pip install "/src[operator]" && pip uninstall -y pdpool \
    && rm -rf /src
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
# Under /code as it will lie in the final image (package, metadata, the `pdpool` script).
RUN pip install --no-deps --root /code /src \
    && export PYTHONPATH=$(echo /code/opt/pdpool/lib/python*/site-packages) \
    && python -c "import pdpool.operator.handlers, pdpool.sidecar" \
    && ! python -c "import torch" 2>/dev/null

# The runtime stage plus the code: the only layer a code change makes.
FROM runtime
COPY --from=build /code/ /
# Read-only root filesystem: whatever a library writes goes under /tmp (an emptyDir).
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp XDG_CACHE_HOME=/tmp/.cache XDG_CONFIG_HOME=/tmp/.config \
    HF_HOME=/tmp/.cache/huggingface TOKENIZERS_PARALLELISM=false
USER 65532:65532
WORKDIR /tmp
EXPOSE 8080
# `pdpool sidecar|gateway|epp|operator ...`
ENTRYPOINT ["pdpool"]
CMD ["--help"]
