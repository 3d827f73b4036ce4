#!/usr/bin/env bash
# A real single-node Kubernetes cluster on this machine: etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, containerd (runc, CNI bridge), a kubelet,
# kube-proxy and CoreDNS, with the project's images (scripts/images/build.sh) imported, so
# that pods can use them with `imagePullPolicy: Never`. No registry is needed: the pod
# sandbox image is built here FROM scratch.
#
#   scripts/cluster/up.sh [IMAGE...]     # default: localhost/pdpool-{slim,engine}:dev
#   export KUBECONFIG=$(scripts/cluster/up.sh | tail -n 1)
#   scripts/cluster/down.sh              # ends every process, leaves the host as it was
#
# The node runs in network and mount namespaces of its own (node.sh): its bridge, veths,
# iptables rules and net sysctls never touch the host's; the API server is reached on the
# host through a forwarded port (127.0.0.1:PORT in the printed kubeconfig). Every process
# runs under one cgroup (pdpool-$NAME), which down.sh empties and removes. Settings:
# config.sh. Needs root. Prints the kubeconfig's path on its last line.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
# shellcheck source=config.sh
source "$HERE/config.sh"
log() { echo "[cluster] $*" >&2; }
die() { echo "cluster: $*" >&2; exit 1; }
t0=$SECONDS

[[ $(id -u) == 0 ]] || die "needs root (it runs a kubelet and containerd)"
[[ -e $DIR/node.pid ]] && kill -0 "$(cat "$DIR/node.pid")" 2>/dev/null \
  && die "cluster $NAME is already up ($DIR); scripts/cluster/down.sh first"
[[ -d $CGROUP_FS/pids ]] || die "no cgroup v1 pids hierarchy at $CGROUP_FS/pids (cgroup v2-only hosts are not supported yet)"

need=()
for p in containerd:containerd runc:runc ip:iproute2 iptables:iptables openssl:openssl unshare:util-linux; do
  command -v "${p%%:*}" >/dev/null || need+=("${p#*:}")
done
[[ -x /usr/lib/cni/bridge ]] || need+=(containernetworking-plugins)
if ((${#need[@]})); then
  log "installing ${need[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${need[@]}" >&2
fi

# Binaries: built once from the Go module proxy into $BIN (scripts/k8s).
"$REPO/scripts/k8s/build-binaries.sh" etcd kube-apiserver kube-controller-manager \
  kube-scheduler kubelet kube-proxy coredns >/dev/null
if [[ ! -x $BIN/pause || $HERE/pause/main.go -nt $BIN/pause ]]; then
  log "building pause"
  (cd "$HERE/pause" && CGO_ENABLED=0 GOTOOLCHAIN=local go build -trimpath -ldflags "-s -w" -o "$BIN/pause" .)
fi

# From here on, a failure takes down whatever was started.
trap 'rc=$?; if ((rc)); then log "failed; cleaning up (logs kept in $DIR/logs)"; PDPOOL_CLUSTER_KEEP_LOGS=1 "$HERE/down.sh" >&2 || true; fi' EXIT
rm -rf "$DIR"
mkdir -p "$DIR"/{pki,logs} "$STORE"
chmod 700 "$DIR"

# Certificates: a CA, the API server's serving certificate, one admin client certificate
# (system:masters; the components use it too), the service-account key pair.
PKI=$DIR/pki
SVC_IP=$(api_service_ip)
(
  cd "$PKI"
  openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 30 \
    -subj "/CN=pdpool-$NAME-ca" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -keyout apiserver.key -out apiserver.csr \
    -subj "/CN=kube-apiserver" 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1,IP:%s,IP:%s,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,DNS:localhost\nextendedKeyUsage=serverAuth\n' \
    "$NODE_IP" "$SVC_IP" > apiserver.ext
  openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial \
    -out apiserver.crt -days 30 -extfile apiserver.ext 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -keyout admin.key -out admin.csr \
    -subj "/O=system:masters/CN=pdpool-admin" 2>/dev/null
  printf 'extendedKeyUsage=clientAuth\n' > admin.ext
  openssl x509 -req -in admin.csr -CA ca.crt -CAkey ca.key -CAcreateserial \
    -out admin.crt -days 30 -extfile admin.ext 2>/dev/null
  openssl genrsa -out sa.key 2048 2>/dev/null
  openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
)

# kubeconfig SERVER: the admin's credentials for a server address.
kubeconfig() {
  cat <<KC
apiVersion: v1
kind: Config
clusters:
- name: $NAME
  cluster: {server: "$1", certificate-authority: "$PKI/ca.crt"}
users:
- name: admin
  user: {client-certificate: "$PKI/admin.crt", client-key: "$PKI/admin.key"}
contexts:
- name: $NAME
  context: {cluster: $NAME, user: admin}
current-context: $NAME
KC
}
kubeconfig "https://$NODE_IP:6443" > "$DIR/node.kubeconfig"

POD_GW=$(python3 -c 'import ipaddress,sys; print(ipaddress.ip_network(sys.argv[1])[1])' "$POD_CIDR")
mkdir -p "$DIR/cni"
cat > "$DIR/cni/10-pdpool.conflist" <<CNI
{"cniVersion": "0.4.0", "name": "pdpool-$NAME", "plugins": [
  {"type": "bridge", "bridge": "pdpool-br0", "isGateway": true, "ipMasq": false,
   "hairpinMode": true,
   "ipam": {"type": "host-local", "dataDir": "$DIR/cni-ipam",
            "ranges": [[{"subnet": "$POD_CIDR", "gateway": "$POD_GW"}]],
            "routes": [{"dst": "0.0.0.0/0"}]}},
  {"type": "loopback"}]}
CNI

PAUSE_IMAGE=localhost/pdpool-pause:1
cat > "$DIR/containerd.toml" <<TOML
version = 2
root = "$STORE/root"
state = "$DIR/containerd-state"
[grpc]
  address = "$DIR/containerd.sock"
[ttrpc]
  address = "$DIR/containerd.sock.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "$STORE/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  # No CAP_SYS_RESOURCE here: never ask for an oom_score_adj below containerd's own.
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  disable_apparmor = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$DIR/cni"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "$(command -v runc)"
TOML

cat > "$DIR/kubelet.yaml" <<KL
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: "$PKI/ca.crt"}
authorization: {mode: AlwaysAllow}
cgroupDriver: cgroupfs
cgroupRoot: /$CGROUP
failCgroupV1: false
containerRuntimeEndpoint: unix://$DIR/containerd.sock
clusterDNS: ["$NODE_IP"]
clusterDomain: cluster.local
resolvConf: "$DIR/resolv.conf"
failSwapOn: false
# Leave the host alone: no iptables chains, no kernel settings (covered anyway), no
# image garbage collection of the imported images, no eviction on a busy shared disk.
makeIPTablesUtilChains: false
protectKernelDefaults: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
podLogsDir: "$DIR/pod-logs"
serializeImagePulls: false
maxPods: 60
KL
echo "nameserver $NODE_IP" > "$DIR/resolv.conf"

cat > "$DIR/kube-proxy.yaml" <<KP
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: "$DIR/node.kubeconfig"}
mode: iptables
clusterCIDR: "$POD_CIDR"
# pod -> Service -> pod on the same bridge: masquerade so that replies come back through
# the node (no reliance on the host's br_netfilter settings).
iptables: {masqueradeAll: true}
# Conntrack sizes and timeouts are kernel-wide: leave them as they are.
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 127.0.0.1:10256
KP

cat > "$DIR/Corefile" <<CF
.:53 {
  bind $NODE_IP
  errors
  kubernetes cluster.local in-addr.arpa ip6.arpa {
    kubeconfig $DIR/node.kubeconfig
    pods insecure
    fallthrough in-addr.arpa ip6.arpa
  }
  cache 5
}
CF

# The cgroup every process of the cluster runs in (pids hierarchy: down.sh's list of what
# to end), and the kubelet's cgroupRoot in every v1 hierarchy.
for h in "$CGROUP_FS"/*/; do
  h=${h%/}
  [[ -f $h/cgroup.procs && $h != "$CGROUP_FS/unified" ]] || continue
  mkdir -p "$h/$CGROUP"
  if [[ -f $h/cpuset.cpus ]]; then
    cat "$h/cpuset.cpus" > "$h/$CGROUP/cpuset.cpus"
    cat "$h/cpuset.mems" > "$h/$CGROUP/cpuset.mems"
  fi
done
mkdir -p "$CGROUP_FS/pids/$CGROUP/node"

# The node, in its own namespaces, in the cluster's cgroup.
log "starting the node"
setsid bash -c 'echo $$ > "$1/cgroup.procs"; exec unshare --net --mount --propagation private -- "$2" ' \
  _ "$CGROUP_FS/pids/$CGROUP/node" "$HERE/node.sh" >"$DIR/logs/node.log" 2>&1 < /dev/null &
echo $! > "$DIR/node.pid"
NODE_PID=$(cat "$DIR/node.pid")
for ((i = 0; i < 240; i++)); do
  [[ -e $DIR/node.ready ]] && break
  kill -0 "$NODE_PID" 2>/dev/null || die "the node exited: $(tail -n 5 "$DIR/logs/node.log" | tr '\n' ' ')"
  sleep 0.5
done
[[ -e $DIR/node.ready ]] || die "the node did not start in 120 s (logs in $DIR/logs)"

# The API server on the host's loopback, forwarded into the node's namespace.
if [[ $API_PORT == 0 ]]; then
  API_PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
fi
setsid bash -c 'echo $$ > "$1/cgroup.procs"; exec python3 "$2" "$3" "127.0.0.1:$4=$5:6443"' _ \
  "$CGROUP_FS/pids/$CGROUP/node" "$HERE/netns_forward.py" "/proc/$NODE_PID/ns/net" "$API_PORT" \
  "$NODE_IP" >"$DIR/logs/forward.log" 2>&1 < /dev/null &
echo $! > "$DIR/forward.pid"
kubeconfig "https://127.0.0.1:$API_PORT" > "$DIR/kubeconfig"
echo "$API_PORT" > "$DIR/api-port"
export KUBECONFIG=$DIR/kubeconfig
for ((i = 0; i < 120; i++)); do
  kubectl get --raw /readyz >/dev/null 2>&1 && break
  sleep 0.5
done
kubectl get --raw /readyz >/dev/null || die "the API server is not reachable on 127.0.0.1:$API_PORT"

CTR=(ctr --address "$DIR/containerd.sock" -n k8s.io)
# import REF: from podman's storage into containerd's, unless the same image id is there.
import_image() {
  local ref=$1 id mark
  id=$(podman image inspect --format '{{.Id}}' "$ref" 2>/dev/null) \
    || die "image $ref is not built (scripts/images/build.sh)"
  mark=$STORE/imported-$(echo "$ref" | tr '/:' '__')
  if [[ $(cat "$mark" 2>/dev/null) == "$id" ]] && "${CTR[@]}" images ls -q | grep -qx "$ref"; then
    return
  fi
  log "importing $ref"
  # The version it replaces goes (containerd collects its content and snapshots).
  "${CTR[@]}" images rm "$ref" >/dev/null 2>&1 || true
  podman save --format docker-archive "$ref" | nice -n 10 "${CTR[@]}" images import --no-unpack - >&2
  echo "$id" > "$mark"
}
if ! podman image exists "$PAUSE_IMAGE" || [[ $BIN/pause -nt $STORE/pause.built ]]; then
  ctx=$DIR/pause-image
  mkdir -p "$ctx" && cp "$BIN/pause" "$ctx/pause"
  printf 'FROM scratch\nCOPY pause /pause\nUSER 65535:65535\nENTRYPOINT ["/pause"]\n' > "$ctx/Containerfile"
  CONTAINERS_CONF=${CONTAINERS_CONF:-$HOME/.cache/pdpool/images/containers.conf} \
    podman build --pull=never --network=host -t "$PAUSE_IMAGE" "$ctx" >&2
  touch "$STORE/pause.built"
fi
images=("$@")
((${#images[@]})) || images=(localhost/pdpool-slim:dev localhost/pdpool-engine:dev)
for ref in "$PAUSE_IMAGE" "${images[@]}"; do import_image "$ref"; done

for ((i = 0; i < 120; i++)); do
  kubectl get node "$NAME" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null \
    | grep -qx True && break
  sleep 0.5
done
kubectl wait --for=condition=Ready "node/$NAME" --timeout=5s >/dev/null \
  || die "node $NAME is not Ready (logs: $DIR/logs/kubelet.log)"
# Usable: the controller-manager has made the default namespace's ServiceAccount.
for ((i = 0; i < 120; i++)); do
  kubectl get serviceaccount default >/dev/null 2>&1 && break
  sleep 0.5
done
kubectl get serviceaccount default >/dev/null || die "no default ServiceAccount after 60 s"
trap - EXIT
log "cluster $NAME up in $((SECONDS - t0)) s: API on 127.0.0.1:$API_PORT"
echo "$DIR/kubeconfig"
