#!/usr/bin/env bash
# Builds the project's two images (images/engine.Dockerfile, images/slim.Dockerfile) from the
# repository with podman, without a registry:
#   - the base (the Dockerfiles' FROM python:3.11-slim) is made locally when no image of that
#     name is in podman's storage: mmdebstrap makes a Debian bookworm root filesystem with
#     python3 (3.11, as the python:3.11-slim image has), `podman import` tags it;
#   - builds run with --pull=never --network=host (a podman bridge network would change the
#     host's ip_forward and firewall), runc as the runtime, pip trusting the host's CA bundle
#     (mounted for the build only);
#   - an image whose inputs (its Dockerfile, the files of its build context, the base image)
#     are unchanged is not rebuilt: a second run takes seconds.
#
#   scripts/images/build.sh [engine|slim ...]       # default: both
#   PDPOOL_IMAGE_TAG=dev scripts/images/build.sh     # tag (default: dev)
#
# Prints one line per image, `NAME IMAGE-ID`, the last lines of stdout. Debian packages it
# needs (podman, runc, mmdebstrap) are installed when missing. Runs the builds under nice.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
TAG=${PDPOOL_IMAGE_TAG:-dev}
BASE=${PDPOOL_BASE_IMAGE:-docker.io/library/python:3.11-slim}
CACHE=${PDPOOL_IMAGE_CACHE:-$HOME/.cache/pdpool/images}
CA_BUNDLE=${PDPOOL_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
mkdir -p "$CACHE"
log() { echo "[images] $*" >&2; }

# One build at a time per machine (podman's storage is shared).
exec 9>"$CACHE/.lock"
flock 9

need_pkgs=()
for p in podman:podman runc:runc mmdebstrap:mmdebstrap; do
  command -v "${p%%:*}" >/dev/null || need_pkgs+=("${p#*:}")
done
if ((${#need_pkgs[@]})); then
  log "installing ${need_pkgs[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${need_pkgs[@]}" >&2 \
    || { apt-get update >&2 && DEBIAN_FRONTEND=noninteractive \
         apt-get install -y --no-install-recommends "${need_pkgs[@]}" >&2; }
fi

# podman's defaults do not fit every host: crun refuses some cgroup v1 layouts (runc works),
# and containers inherit default ulimits above what an unprivileged-ish root may raise to.
# (nproc: above 32768 runc's init is refused here even below the caller's hard limit.)
nofile=$(ulimit -Hn) nproc=$(ulimit -Hu)
[[ $nproc == unlimited || $nproc -gt 32768 ]] && nproc=32768
cat > "$CACHE/containers.conf" <<CONF
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
export CONTAINERS_CONF=$CACHE/containers.conf
PODMAN=(nice -n 10 podman)
# A build's containers start cgroups of their own, which a nice value does not reach: a caller
# that runs the builds at idle priority (.ci/builds) names its cgroup, and they go under it.
BUILD_CGROUP=()
[[ -n ${PDPOOL_BUILD_CGROUP:-} ]] && BUILD_CGROUP=(--cgroup-parent "$PDPOOL_BUILD_CGROUP")

image_id() { podman image inspect --format '{{.Id}}' "$1" 2>/dev/null || true; }
image_label() { podman image inspect --format "{{index .Labels \"$2\"}}" "$1" 2>/dev/null || true; }

make_base() {
  [[ -n $(image_id "$BASE") ]] && return
  log "making the base $BASE locally (mmdebstrap bookworm + python3)"
  local tar=$CACHE/base-rootfs.tar
  # python3-venv: the Dockerfiles make a venv; libnuma1: NIXL/UCX load it.
  nice -n 10 mmdebstrap --variant=minbase --format=tar \
    --include=python3,python3-venv,python-is-python3,ca-certificates,libnuma1 \
    --aptopt='Acquire::Retries "3"' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
    bookworm "$tar" >&2
  podman import \
    --change 'ENV=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV=LANG=C.UTF-8' --change 'CMD=["python3"]' \
    "$tar" "$BASE" >&2
  rm -f "$tar"
}

# context_hash NAME: what goes into the image: its Dockerfile and .dockerignore, the files
# its context lets in (the same list the .dockerignore allows), and the base image's id.
context_hash() {
  local name=$1
  {
    cat "$REPO/images/$name.Dockerfile" "$REPO/images/$name.Dockerfile.dockerignore"
    image_id "$BASE"
    (cd "$REPO" && find pyproject.toml setup.py pdpool engine kernels sidecar operator \
      -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 2>/dev/null \
      | LC_ALL=C sort -z | xargs -0 sha256sum)
  } | sha256sum | cut -c1-16
}

build_one() {
  local name=$1 ref=localhost/pdpool-$1:$TAG hash
  hash=$(context_hash "$name")
  if [[ $(image_label "$ref" io.pdpool.context-hash) == "$hash" ]]; then
    log "$ref is up to date ($hash)"
  else
    log "building $ref ($hash)"
    local previous avail need
    previous=$(image_id "$ref")
    # The engine's runtime stage is ~7 GB, and committing its torch layer briefly needs as
    # much again in temporary space: a cold build refuses (with the reason) rather than fill
    # a shared disk. Once built, a code change adds megabytes (one code layer) and a
    # pyproject.toml change about a gigabyte (the dependencies' layer). Nothing cached is
    # removed to make room: the runtime stage is the build cache.
    need=3
    if [[ $name == engine ]]; then need=$([[ -n $previous ]] && echo 4 || echo 14); fi
    avail=$(df --output=avail -BG /var/lib/containers /var/tmp | tail -n +2 | tr -d G | sort -n | head -1)
    ((avail >= need)) || { echo "build.sh: building $ref needs about $need GB free under /var/lib/containers and /var/tmp; $avail GB are" >&2; exit 4; }
    "${PODMAN[@]}" build --pull=never --network=host --runtime=runc "${BUILD_CGROUP[@]}" \
      -f "$REPO/images/$name.Dockerfile" \
      --ignorefile "$REPO/images/$name.Dockerfile.dockerignore" \
      --volume "$CA_BUNDLE:/etc/pdpool-build-ca.crt:ro" \
      --build-arg PIP_CERT=/etc/pdpool-build-ca.crt \
      --label "io.pdpool.context-hash=$hash" \
      -t "$ref" "$REPO" >&2
    # The engine image is GBs: drop the version this one replaces (its build stages stay,
    # as the layer cache).
    if [[ -n $previous && $previous != "$(image_id "$ref")" ]]; then
      podman rmi "$previous" >/dev/null 2>&1 || true
    fi
  fi
  echo "$ref $(image_id "$ref")"
}

images=("$@")
((${#images[@]})) || images=(slim engine)
make_base
for i in "${images[@]}"; do
  case $i in
    engine|slim) build_one "$i" ;;
    *) echo "build.sh: unknown image $i (engine, slim)" >&2; exit 2 ;;
  esac
done
