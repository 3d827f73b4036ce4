#!/usr/bin/env bash
# Fetches the third-party CRDs a pool can render, pinned, as published in their Go modules,
# from the Go module proxy, into a cache folder outside the repository: the Gateway API
# Inference Extension's (InferencePool, ...), the Gateway API standard ones (Gateway,
# HTTPRoute, ...) and KEDA's ScaledObject. GIE v1.6.0 moved its x-k8s.io APIs
# (InferenceObjective, InferenceModelRewrite) out to llm-d's router, which publishes no Go
# module: those two come from GIE's last release that ships them. Idempotent.
#
#   scripts/gie/fetch-crds.sh          # prints the folder holding the CRD YAML files
set -euo pipefail

GIE_VERSION=${PDPOOL_GIE_VERSION:-v1.6.0}
GIE_X_VERSION=${PDPOOL_GIE_X_VERSION:-v1.5.0}
GATEWAY_API_VERSION=${PDPOOL_GATEWAY_API_VERSION:-v1.4.1}
KEDA_VERSION=${PDPOOL_KEDA_VERSION:-v2.18.0}
OUT=${PDPOOL_GIE_CRDS:-$HOME/.cache/pdpool/gie-crds}/$GIE_VERSION-x-$GIE_X_VERSION-$GATEWAY_API_VERSION-keda-$KEDA_VERSION

if [[ -f $OUT/.done ]]; then
  echo "$OUT"
  exit 0
fi
command -v go >/dev/null || { echo "fetch-crds: go is not installed" >&2; exit 3; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
go mod init pdpool.local/gie-crds >/dev/null 2>&1
module_dir() {  # module_dir MODULE VERSION: where the Go module cache holds it
  GOFLAGS=-mod=mod go mod download -json "$1@$2" \
    | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d.get("Dir") or sys.exit(d.get("Error")))'
}
gie=$(module_dir sigs.k8s.io/gateway-api-inference-extension "$GIE_VERSION")
gie_x=$(module_dir sigs.k8s.io/gateway-api-inference-extension "$GIE_X_VERSION")
gwapi=$(module_dir sigs.k8s.io/gateway-api "$GATEWAY_API_VERSION")
keda=$(module_dir github.com/kedacore/keda/v2 "$KEDA_VERSION")
mkdir -p "$OUT.tmp"
cp "$gie"/config/crd/bases/*.yaml "$gwapi"/config/crd/standard/*.yaml "$OUT.tmp/"
cp "$keda"/config/crd/bases/keda.sh_scaledobjects.yaml "$OUT.tmp/"
for kind in inferenceobjectives inferencemodelrewrites; do
  cp "$gie_x/config/crd/bases/inference.networking.x-k8s.io_$kind.yaml" "$OUT.tmp/"
done
chmod -R u+w "$OUT.tmp"
rm -rf "$OUT"
mv "$OUT.tmp" "$OUT"
touch "$OUT/.done"
echo "$OUT"
