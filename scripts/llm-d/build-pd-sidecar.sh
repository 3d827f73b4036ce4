#!/usr/bin/env bash
# Builds llm-d's P/D sidecar (cmd/pd-sidecar of llm-d/llm-d-router) with the Go toolchain,
# CGO off, into a cache folder outside the repository, for
# `benchmarks/sidecar_overhead.py --llmd` (ours and llm-d's side by side).
#
#   PDPOOL_LLMD_ROUTER_SRC=<git dir of llm-d/llm-d-router> scripts/llm-d/build-pd-sidecar.sh
#
# The router's tree comes from a git dir (default: where the fetch tool puts it), at
# PDPOOL_LLMD_ROUTER_REF (default HEAD); where there is none, from the Go module proxy as
# github.com/llm-d/llm-d-inference-scheduler@$PDPOOL_LLMD_MODULE_VERSION (default v0.7.1, the
# router's name before it was renamed; its pd-sidecar takes --vllm-port where the router's
# takes --model-server-port). Its dependencies come from the Go module proxy. A cold
# build takes about 5 minutes on 2 cores. Idempotent: a binary built from the same commit is
# kept. Prints the binary's path on its last line.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
source "$here/lib.sh"

ROUTER_SRC=${PDPOOL_LLMD_ROUTER_SRC:-/work/.mirror/llm-d+llm-d-router/repo}
REF=${PDPOOL_LLMD_ROUTER_REF:-HEAD}
BIN=${PDPOOL_LLMD_BIN_DIR:-$HOME/.cache/pdpool/llm-d-bin}
WORK=$HOME/.cache/pdpool/llm-d-build
MODULE=github.com/llm-d/llm-d-inference-scheduler
MODULE_VERSION=${PDPOOL_LLMD_MODULE_VERSION:-v0.7.1}

mkdir -p "$BIN" "$WORK"
exec 9>"$BIN/.lock"
flock 9
if git --git-dir="$ROUTER_SRC" rev-parse --verify -q HEAD >/dev/null 2>&1; then
  commit=$(llmd_commit "$ROUTER_SRC" "$REF")
  src=$WORK/llm-d-router-$commit
  llmd_tree "$ROUTER_SRC" "$commit" "$src"
else
  # No fetched tree on this machine (a fresh one): the router's earlier module,
  # llm-d-inference-scheduler, whose cmd/pd-sidecar the Go module proxy serves.
  commit="$MODULE@$MODULE_VERSION"
  src=$WORK/llm-d-inference-scheduler-$MODULE_VERSION
  if ! llmd_cached "$BIN" pd-sidecar "$commit" >/dev/null; then
    llmd_module_tree "$MODULE" "$MODULE_VERSION" "$src"
  fi
fi
llmd_cached "$BIN" pd-sidecar "$commit" && exit 0
command -v go >/dev/null || { echo "build-pd-sidecar: go is not installed" >&2; exit 3; }
echo "[build-pd-sidecar] building pd-sidecar at $commit" >&2
(cd "$src" && go build -trimpath -ldflags "-s -w" -o "$BIN/pd-sidecar.new" ./cmd/pd-sidecar >&2)
llmd_install "$BIN" pd-sidecar "$commit"
