#!/usr/bin/env bash
# The node: runs inside its own network and mount namespaces (up.sh starts it under
# `unshare --net --mount --propagation private`), so that everything the kubelet, kube-proxy,
# containerd and the CNI plugins change (bridge, veths, iptables rules, ip_forward, mounts)
# lives and dies with those namespaces. Starts etcd, the control plane, containerd, the
# kubelet, kube-proxy and CoreDNS from the configs up.sh wrote into $DIR, and stops them
# all when it is told to (or when one of them exits).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=config.sh
source "$HERE/config.sh"
LOGS=$DIR/logs
mkdir -p "$LOGS"

# Network: loopback, with the node's address on it too (the API server's advertised
# address and CoreDNS's; pods reach it through the bridge's gateway: a local address
# answers on every link). Nothing here is the host's.
ip link set lo up
ip addr add "$NODE_IP/32" dev lo
echo 1 > /proc/sys/net/ipv4/ip_forward

# Host kernel settings the kubelet and kube-proxy write (they are not per network
# namespace): a file with the current value covers each one, in this mount namespace only.
mkdir -p "$DIR/sysctl"
for s in "${COVERED_SYSCTLS[@]}"; do
  [[ -e /proc/sys/$s ]] || continue
  cover=$DIR/sysctl/${s//\//.}
  cat "/proc/sys/$s" > "$cover"
  mount --bind "$cover" "/proc/sys/$s"
done

# Host folders the components write to whatever their configuration says (libcni's cache,
# the kubelet's log links): a private folder covers each one. Folders this makes on the
# host are listed in created-paths (empty ones: what is written goes to the cover).
for d in /var/lib/cni /var/log/pods /var/log/containers /etc/cni /opt/cni /var/lib/kubelet \
  /run/containerd /var/run/netns /etc/kubernetes; do
  d=$(readlink -m "$d")
  if [[ ! -d $d ]]; then
    p=$d
    while [[ ! -e $(dirname "$p") ]]; do p=$(dirname "$p"); done
    mkdir -p "$d"
    echo "$p" >> "$DIR/created-paths"
  fi
  mkdir -p "$DIR/covers$d"
  mount --bind "$DIR/covers$d" "$d"
done

pids=()
stopping=0
stop_all() {
  stopping=1
  local i
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do kill -TERM "${pids[i]}" 2>/dev/null || true; done
  wait || true
}
trap 'stop_all; exit 0' TERM INT
trap 'stop_all' EXIT

start() {  # start NAME CMD...: in the background, logs in $LOGS/NAME.log
  local name=$1
  shift
  "$@" >"$LOGS/$name.log" 2>&1 &
  pids+=($!)
  echo "$!" > "$DIR/$name.pid"
}

wait_for() {  # wait_for WHAT CMD...: up to 60 s
  local i
  for ((i = 0; i < 120; i++)); do
    "${@:2}" >/dev/null 2>&1 && return 0
    sleep 0.5
  done
  echo "node: $1 did not come up; see $LOGS" >&2
  return 1
}

PKI=$DIR/pki
start etcd "$BIN/etcd" --data-dir "$DIR/etcd" --listen-client-urls http://127.0.0.1:2379 \
  --advertise-client-urls http://127.0.0.1:2379 --listen-peer-urls http://127.0.0.1:2380 \
  --log-level warn
wait_for etcd curl -sf http://127.0.0.1:2379/health

start kube-apiserver "$BIN/kube-apiserver" --etcd-servers http://127.0.0.1:2379 \
  --bind-address 0.0.0.0 --secure-port 6443 --advertise-address "$NODE_IP" \
  --service-cluster-ip-range "$SERVICE_CIDR" \
  --tls-cert-file "$PKI/apiserver.crt" --tls-private-key-file "$PKI/apiserver.key" \
  --client-ca-file "$PKI/ca.crt" --authorization-mode Node,RBAC \
  --service-account-key-file "$PKI/sa.pub" --service-account-signing-key-file "$PKI/sa.key" \
  --service-account-issuer https://kubernetes.default.svc.cluster.local \
  --kubelet-client-certificate "$PKI/admin.crt" --kubelet-client-key "$PKI/admin.key" \
  --kubelet-preferred-address-types InternalIP \
  --allow-privileged=false --enable-priority-and-fairness=false --v 1
wait_for kube-apiserver curl -sf --cacert "$PKI/ca.crt" --cert "$PKI/admin.crt" \
  --key "$PKI/admin.key" "https://$NODE_IP:6443/readyz"

KC=$DIR/node.kubeconfig
start kube-controller-manager "$BIN/kube-controller-manager" --kubeconfig "$KC" \
  --authentication-kubeconfig "$KC" --authorization-kubeconfig "$KC" \
  --service-account-private-key-file "$PKI/sa.key" --root-ca-file "$PKI/ca.crt" \
  --use-service-account-credentials --cluster-signing-cert-file "$PKI/ca.crt" \
  --cluster-signing-key-file "$PKI/ca.key" --leader-elect=false --bind-address 127.0.0.1 \
  --secure-port 10257 --v 1
start kube-scheduler "$BIN/kube-scheduler" --kubeconfig "$KC" --authentication-kubeconfig "$KC" \
  --authorization-kubeconfig "$KC" --leader-elect=false --bind-address 127.0.0.1 \
  --secure-port 10259 --v 1

start containerd containerd --config "$DIR/containerd.toml"
wait_for containerd ctr --address "$DIR/containerd.sock" version

start kubelet "$BIN/kubelet" --config "$DIR/kubelet.yaml" --kubeconfig "$KC" \
  --root-dir "$DIR/kubelet" --node-ip "$NODE_IP" --hostname-override "$NAME" --v 1
start kube-proxy "$BIN/kube-proxy" --config "$DIR/kube-proxy.yaml" --hostname-override "$NAME" --v 1
start coredns "$BIN/coredns" -conf "$DIR/Corefile"

echo ready > "$DIR/node.ready"
# Any component's exit ends the node (down.sh, or up.sh's checks, say which one).
set +e
wait -n
rc=$?
((stopping)) || echo "node: a component exited ($rc); stopping the node" >&2
exit "$rc"
