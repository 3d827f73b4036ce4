#!/usr/bin/env bash
# Builds llm-d's P/D sidecar (cmd/pd-sidecar of llm-d/llm-d-router) with the Go toolchain,
# CGO off, into a cache folder outside the repository, for
# `benchmarks/sidecar_overhead.py --llmd` (ours and llm-d's side by side).
#
#   PDPOOL_LLMD_ROUTER_SRC=<git dir of llm-d/llm-d-router> scripts/llm-d/build-pd-sidecar.sh
#
# The router's tree comes from a git dir (default: where the fetch tool puts it), at
# PDPOOL_LLMD_ROUTER_REF (default HEAD); its dependencies from the Go module proxy. A cold
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

llmd_require build-pd-sidecar "$ROUTER_SRC"
mkdir -p "$BIN" "$WORK"
exec 9>"$BIN/.lock"
flock 9
commit=$(llmd_commit "$ROUTER_SRC" "$REF")
llmd_cached "$BIN" pd-sidecar "$commit" && exit 0
src=$WORK/llm-d-router-$commit
llmd_tree "$ROUTER_SRC" "$commit" "$src"
echo "[build-pd-sidecar] building pd-sidecar at $commit" >&2
(cd "$src" && go build -trimpath -ldflags "-s -w" -o "$BIN/pd-sidecar.new" ./cmd/pd-sidecar >&2)
llmd_install "$BIN" pd-sidecar "$commit"
