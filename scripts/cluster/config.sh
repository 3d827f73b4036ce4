# Shared settings of scripts/cluster/{up,down,node}.sh; every one can be overridden from
# the environment, so that clusters never collide (with each other or with anything else):
#   PDPOOL_CLUSTER_NAME     the cluster's name (node name, cgroup, folders)      [pdpool]
#   PDPOOL_CLUSTER_DIR      its run folder: certificates, kubeconfigs, logs, etcd, kubelet
#                                                            [/tmp/pdpool-cluster-$NAME]
#   PDPOOL_CLUSTER_API_PORT the host port the API server is reached on; 0: a free one  [0]
#   PDPOOL_CLUSTER_STORE    containerd's content (imported images survive down.sh)
#                                               [~/.cache/pdpool/cluster/$NAME/containerd]
#   PDPOOL_CLUSTER_POD_CIDR, PDPOOL_CLUSTER_SERVICE_CIDR, PDPOOL_CLUSTER_NODE_IP
#                           addresses inside the cluster's own network namespace (they
#                           never reach the host's)  [10.244.0.0/24, 10.96.0.0/24, 10.244.255.1]
#   PDPOOL_K8S_BIN          where scripts/k8s/build-binaries.sh puts the binaries
NAME=${PDPOOL_CLUSTER_NAME:-pdpool}
[[ $NAME =~ ^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$ ]] \
  || { echo "cluster: PDPOOL_CLUSTER_NAME must be a DNS label of at most 32 characters" >&2; exit 2; }
DIR=${PDPOOL_CLUSTER_DIR:-/tmp/pdpool-cluster-$NAME}
API_PORT=${PDPOOL_CLUSTER_API_PORT:-0}
STORE=${PDPOOL_CLUSTER_STORE:-$HOME/.cache/pdpool/cluster/$NAME/containerd}
POD_CIDR=${PDPOOL_CLUSTER_POD_CIDR:-10.244.0.0/24}
SERVICE_CIDR=${PDPOOL_CLUSTER_SERVICE_CIDR:-10.96.0.0/24}
NODE_IP=${PDPOOL_CLUSTER_NODE_IP:-10.244.255.1}
BIN=${PDPOOL_K8S_BIN:-$HOME/.cache/pdpool/k8s-bin}
# The cgroup every process of the cluster runs under (and its pods, via the kubelet's
# cgroupRoot): down.sh ends exactly those processes and removes exactly these cgroups.
CGROUP=pdpool-$NAME
CGROUP_FS=${PDPOOL_CGROUP_FS:-/sys/fs/cgroup}
# The host's kernel settings the kubelet and kube-proxy would otherwise rewrite: inside
# the node's private mount namespace, a file with the current value covers each of them.
COVERED_SYSCTLS=(vm/overcommit_memory vm/panic_on_oom kernel/panic kernel/panic_on_oops
  kernel/keys/root_maxkeys kernel/keys/root_maxbytes net/netfilter/nf_conntrack_max
  net/bridge/bridge-nf-call-iptables net/bridge/bridge-nf-call-ip6tables)
# Service IP 1 of the service range: the API server's ClusterIP (kubernetes.default).
api_service_ip() { python3 -c 'import ipaddress,sys; print(ipaddress.ip_network(sys.argv[1])[1])' "$SERVICE_CIDR"; }
