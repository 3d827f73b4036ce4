#!/usr/bin/env bash
# Builds the pinned Kubernetes test binaries (etcd, kube-apiserver, kube-controller-manager,
# helm, kwok; and for scripts/cluster: kubelet, kube-proxy, coredns) with the Go toolchain, from the Go module proxy, into a cache folder outside the
# repository. Idempotent: a binary already built at the pinned version is skipped.
#
#   scripts/k8s/build-binaries.sh [TOOL...]      # default: all of them
#   PDPOOL_K8S_BIN=/somewhere scripts/k8s/build-binaries.sh
#
# Prints the bin folder on its last line. A cold build on 2 cores takes a long time
# (about 19 minutes for all four on a busy 2-core machine; kube-apiserver and
# kube-controller-manager dominate); later runs take a second.
set -euo pipefail

K8S_VERSION=${PDPOOL_K8S_VERSION:-v1.34.4}
ETCD_VERSION=${PDPOOL_ETCD_VERSION:-v3.6.7}
HELM_VERSION=${PDPOOL_HELM_VERSION:-v3.19.0}
COREDNS_VERSION=${PDPOOL_COREDNS_VERSION:-v1.12.4}
KWOK_VERSION=${PDPOOL_KWOK_VERSION:-v0.8.0}

BIN=${PDPOOL_K8S_BIN:-$HOME/.cache/pdpool/k8s-bin}
WORK=$BIN/.build
mkdir -p "$BIN" "$WORK"
# One build at a time per cache folder (parallel test sessions share it).
exec 9>"$BIN/.lock"
flock 9
export GOFLAGS=-mod=mod GOTOOLCHAIN=local CGO_ENABLED=0

command -v go >/dev/null || { echo "build-binaries: go is not installed" >&2; exit 3; }

log() { echo "[build-binaries] $*" >&2; }

# up_to_date NAME VERSION: the binary exists and was built from that version.
up_to_date() { [[ -x $BIN/$1 && "$(cat "$BIN/.$1.version" 2>/dev/null)" == "$2" ]]; }
mark() { echo "$2" > "$BIN/.$1.version"; }

# Kubernetes' own go.mod points its staging modules (k8s.io/api, ...) at ./staging with
# replace directives, which `go install pkg@version` refuses. A small wrapper module that
# replaces each of them with its published v0.X.Y release builds the same code.
k8s_wrapper() {
  local dir=$WORK/kubernetes-$K8S_VERSION staging=v0${K8S_VERSION#v1}
  if [[ ! -f $dir/go.sum ]]; then
    mkdir -p "$dir"
    local gomod
    gomod=$(cd "$dir" && go mod download -json "k8s.io/kubernetes@$K8S_VERSION" \
      | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
    {
      echo "module pdpool.local/k8s-build"
      echo "go 1.24.0"
      echo "require k8s.io/kubernetes $K8S_VERSION"
      grep -oE '^\s*k8s\.io/[a-z0-9-]+ => \./staging' "$gomod" | awk -v v="$staging" \
        '{print "replace " $1 " => " $1 " " v}'
    } > "$dir/go.mod"
    (cd "$dir" && go get "k8s.io/kubernetes/cmd/kube-apiserver@$K8S_VERSION" \
      "k8s.io/kubernetes/cmd/kube-controller-manager@$K8S_VERSION" \
      "k8s.io/kubernetes/cmd/kube-scheduler@$K8S_VERSION" \
      "k8s.io/kubernetes/cmd/kubelet@$K8S_VERSION" "k8s.io/kubernetes/cmd/kube-proxy@$K8S_VERSION" >&2)
  fi
  echo "$dir"
}

build_k8s() {  # build_k8s NAME
  up_to_date "$1" "$K8S_VERSION" && return
  log "building $1 $K8S_VERSION"
  local dir minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
  dir=$(k8s_wrapper)
  local pkg=k8s.io/component-base/version
  (cd "$dir" && go build -trimpath -o "$BIN/$1" \
    -ldflags "-s -w -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor" \
    "k8s.io/kubernetes/cmd/$1")
  mark "$1" "$K8S_VERSION"
}

build_etcd() {
  up_to_date etcd "$ETCD_VERSION" && return
  log "building etcd $ETCD_VERSION"
  # etcd's server module also uses replace directives (to ../api, ...): same wrapper trick,
  # the sibling modules are published at the same version.
  local dir=$WORK/etcd-$ETCD_VERSION
  mkdir -p "$dir"
  printf 'module pdpool.local/etcd-build\ngo 1.24.0\n' > "$dir/go.mod"
  (cd "$dir" && go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION" >&2 \
    && go build -trimpath -ldflags "-s -w" -o "$BIN/etcd" go.etcd.io/etcd/server/v3)
  mark etcd "$ETCD_VERSION"
}

build_install() {  # build_install NAME PKG VERSION: modules without replace directives
  up_to_date "$1" "$3" && return
  log "building $1 $3"
  GOBIN=$BIN go install -trimpath -ldflags "-s -w" "$2@$3"
  mark "$1" "$3"
}

# kwok runs nothing by itself: Stages say how fake nodes and pods evolve. Its own "fast"
# stages (node ready at once, pod Running+Ready at once, deleted pods removed) are copied
# from the module next to the binary, as one config file for `kwok --config`.
kwok_stages() {
  local out=$BIN/kwok-stages.yaml src
  [[ -f $out && "$(cat "$BIN/.kwok-stages.version" 2>/dev/null)" == "$KWOK_VERSION" ]] && return
  src=$(GOFLAGS= go env GOMODCACHE)/sigs.k8s.io/kwok@$KWOK_VERSION/kustomize/stage
  [[ -d $src ]] || (cd "$WORK" && GOFLAGS= go mod download "sigs.k8s.io/kwok@$KWOK_VERSION")
  {
    for f in node/fast/node-initialize.yaml pod/fast/pod-ready.yaml pod/fast/pod-delete.yaml; do
      echo "---"; cat "$src/$f"
    done
  } > "$out.tmp" && mv "$out.tmp" "$out"
  mark kwok-stages "$KWOK_VERSION"
}

tools=("$@")
[[ ${#tools[@]} -gt 0 ]] || tools=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok helm)
for t in "${tools[@]}"; do
  case $t in
    etcd) build_etcd ;;
    kube-apiserver|kube-controller-manager|kube-scheduler) build_k8s "$t" ;;
    # The node (scripts/cluster/up.sh): a real kubelet, kube-proxy and CoreDNS.
    kubelet|kube-proxy) build_k8s "$t" ;;
    coredns) build_install coredns github.com/coredns/coredns "$COREDNS_VERSION" ;;
    # kwok: fake nodes and a fake kubelet (pods go Running/Ready without containers).
    kwok) build_install kwok sigs.k8s.io/kwok/cmd/kwok "$KWOK_VERSION"; kwok_stages ;;
    helm) build_install helm helm.sh/helm/v3/cmd/helm "$HELM_VERSION" ;;
    *) echo "build-binaries: unknown tool $t" >&2; exit 2 ;;
  esac
done
echo "$BIN"
