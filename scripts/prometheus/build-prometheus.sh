#!/usr/bin/env bash
# Builds a pinned Prometheus server with the Go toolchain, from the Go module proxy, into a
# cache folder outside the repository (as scripts/k8s/build-binaries.sh does for the
# Kubernetes binaries), so the dashboard test needs no root and no Debian package.
# Idempotent: a binary already built at the pinned version is skipped.
#
#   scripts/prometheus/build-prometheus.sh
#   PDPOOL_PROMETHEUS_BIN=/somewhere scripts/prometheus/build-prometheus.sh
#
# Prints the binary's path on its last line. A cold build downloads a few hundred MB of
# modules and takes several minutes on 2 cores; later runs take a second.
set -euo pipefail

# The prometheus/prometheus module tags v0.X.Y for Prometheus 3.X.Y.
VERSION=${PDPOOL_PROMETHEUS_VERSION:-v0.316.0}
BUILD_TAGS=remove_all_sd
BIN=${PDPOOL_PROMETHEUS_BIN:-$HOME/.cache/pdpool/prometheus-bin}
mkdir -p "$BIN"
exec 9>"$BIN/.lock"
flock 9
export GOFLAGS=-mod=mod GOTOOLCHAIN=local CGO_ENABLED=0

command -v go >/dev/null || { echo "build-prometheus: go is not installed" >&2; exit 3; }

if [[ -x $BIN/prometheus && "$(cat "$BIN/.prometheus.version" 2>/dev/null)" == "$VERSION $BUILD_TAGS" ]]; then
  echo "$BIN/prometheus"
  exit 0
fi
echo "[build-prometheus] building prometheus $VERSION" >&2
# remove_all_sd: only the file and HTTP service discoveries (plugins/minimum.go) are compiled in;
# the tests scrape static targets, and the cloud SDKs of the others are most of a cold build.
# builtinassets: the web UI's assets are embedded only with this tag; without it the
# server still serves its HTTP API, which is all the tests use, so it is left out.
GOBIN=$BIN go install -trimpath -tags "$BUILD_TAGS" -ldflags "-s -w" \
  "github.com/prometheus/prometheus/cmd/prometheus@$VERSION"
echo "$VERSION $BUILD_TAGS" > "$BIN/.prometheus.version"
echo "$BIN/prometheus"
