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

SIM_SRC=${PDPOOL_SIM_SRC:-/work/.mirror/llm-d+llm-d-inference-sim/repo}
ROUTER_SRC=${PDPOOL_LLMD_ROUTER_SRC:-/work/.mirror/llm-d+llm-d-router/repo}
SIM_REF=${PDPOOL_SIM_REF:-HEAD}
BIN=${PDPOOL_SIM_BIN_DIR:-$HOME/.cache/pdpool/sim-bin}
WORK=$HOME/.cache/pdpool/sim-build
mkdir -p "$BIN" "$WORK"
exec 9>"$BIN/.lock"
flock 9
export GOFLAGS="-mod=mod -buildvcs=false" GOTOOLCHAIN=local CGO_ENABLED=0

command -v go >/dev/null || { echo "build-sim: go is not installed" >&2; exit 3; }
commit=$(git --git-dir="$SIM_SRC" rev-parse "$SIM_REF")
if [[ -x $BIN/llm-d-inference-sim && "$(cat "$BIN/.version" 2>/dev/null)" == "$commit" ]]; then
  echo "$BIN/llm-d-inference-sim"
  exit 0
fi
src=$WORK/sim-$commit
if [[ ! -f $src/go.mod ]]; then
  mkdir -p "$src"
  git --git-dir="$SIM_SRC" archive "$commit" | tar -x -C "$src"
fi
router_version=$(awk '$1 == "github.com/llm-d/llm-d-router" {print $2; exit}' "$src/go.mod")
router=$WORK/llm-d-router-$router_version
if [[ ! -f $router/go.mod ]]; then
  mkdir -p "$router"
  git --git-dir="$ROUTER_SRC" archive "$router_version" | tar -x -C "$router"
fi
(cd "$src" && go mod edit -replace "github.com/llm-d/llm-d-router=$router" \
  && go build -o "$BIN/llm-d-inference-sim.new" ./cmd/llm-d-inference-sim >&2)
mv "$BIN/llm-d-inference-sim.new" "$BIN/llm-d-inference-sim"
echo "$commit" > "$BIN/.version"
echo "$BIN/llm-d-inference-sim"
