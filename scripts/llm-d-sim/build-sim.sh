#!/usr/bin/env bash
# Builds llm-d's inference simulator (llm-d-inference-sim: vLLM's API and metrics with
# latencies and capacity set by flags) with the Go toolchain, CGO off, into a cache folder
# outside the repository. benchmarks/autoscale.py --backend sim runs it as the engines of
# `pdpool up --engine vllm` (benchmarks/sim_engine.py).
#
#   PDPOOL_SIM_SRC=<git dir of llm-d/llm-d-inference-sim> \
#   PDPOOL_LLMD_ROUTER_SRC=<git dir of llm-d/llm-d-router> scripts/llm-d-sim/build-sim.sh
#
# Neither module is served by the Go module proxy this machine reaches (403), so both come
# from git trees: the simulator at PDPOOL_SIM_REF (default HEAD), and llm-d-router at the
# version the simulator's go.mod requires, put in place with `go mod edit -replace`.
# Idempotent: a binary built from the same simulator commit is kept. Prints its path.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=../llm-d/lib.sh
source "$here/../llm-d/lib.sh"

SIM_SRC=${PDPOOL_SIM_SRC:-/work/.mirror/llm-d+llm-d-inference-sim/repo}
ROUTER_SRC=${PDPOOL_LLMD_ROUTER_SRC:-/work/.mirror/llm-d+llm-d-router/repo}
SIM_REF=${PDPOOL_SIM_REF:-HEAD}
BIN=${PDPOOL_SIM_BIN_DIR:-$HOME/.cache/pdpool/sim-bin}
WORK=$HOME/.cache/pdpool/sim-build

llmd_require build-sim "$SIM_SRC"
llmd_require build-sim "$ROUTER_SRC"
mkdir -p "$BIN" "$WORK"
exec 9>"$BIN/.lock"
flock 9
commit=$(llmd_commit "$SIM_SRC" "$SIM_REF")
llmd_cached "$BIN" llm-d-inference-sim "$commit" && exit 0
src=$WORK/sim-$commit
llmd_tree "$SIM_SRC" "$commit" "$src"
router_version=$(awk '$1 == "github.com/llm-d/llm-d-router" {print $2; exit}' "$src/go.mod")
router=$WORK/llm-d-router-$router_version
llmd_tree "$ROUTER_SRC" "$router_version" "$router"
(cd "$src" && go mod edit -replace "github.com/llm-d/llm-d-router=$router" \
  && go build -o "$BIN/llm-d-inference-sim.new" ./cmd/llm-d-inference-sim >&2)
llmd_install "$BIN" llm-d-inference-sim "$commit"
