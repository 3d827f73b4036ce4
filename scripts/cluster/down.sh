#!/usr/bin/env bash
# Ends the cluster scripts/cluster/up.sh started and leaves the host as it found it: every
# process in the cluster's cgroup (control plane, containerd and its shims, the kubelet,
# kube-proxy, CoreDNS, every container, the port forwarder) is ended by its id, the
# cgroups are removed, the node's namespaces (bridge, veths, iptables rules, mounts) go
# with its last process, folders the node made on the host are removed, and the run folder
# is deleted (PDPOOL_CLUSTER_KEEP_LOGS=1 keeps its logs). containerd's image store
# ($PDPOOL_CLUSTER_STORE) is kept, so that the next up.sh needs no import. Safe to run
# twice, or on a cluster that never came up.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=config.sh
source "$HERE/config.sh"
log() { echo "[cluster] $*" >&2; }

# procs [SUBTREE]: every process id in the cluster's cgroup subtree (the pids hierarchy,
# and cgroup v2's where runc also places containers).
procs() {
  local h
  for h in pids unified; do
    [[ -d $CGROUP_FS/$h/$CGROUP/${1:-} ]] || continue
    find "$CGROUP_FS/$h/$CGROUP/${1:-}" -name cgroup.procs -exec cat {} + 2>/dev/null
  done | sort -u
}
# end SIGNALS SUBTREE: signals each process left in the subtree, waiting 5 s after each.
end() {
  local sig list i
  for sig in $1; do
    list=$(procs "$2")
    [[ -z $list ]] && return 0
    # shellcheck disable=SC2086
    kill -"$sig" $list 2>/dev/null
    for ((i = 0; i < 20; i++)); do [[ -z $(procs "$2") ]] && return 0; sleep 0.25; done
  done
}

# The node's supervisor first: it stops its components in order (kubelet before containerd).
if [[ -f $DIR/node.pid ]]; then
  pid=$(cat "$DIR/node.pid")
  kill -TERM "$pid" 2>/dev/null
  for ((i = 0; i < 40; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
fi
# Then the containers, while their shims still live to reap them (no zombies left for the
# host's init), then the shims and the port forwarder.
end "KILL KILL KILL" kubepods
end "TERM TERM KILL KILL KILL" ""
[[ -z $(procs) ]] || { log "processes still running in $CGROUP: $(procs | tr '\n' ' ')"; exit 1; }

# The cgroups, deepest first, in every hierarchy.
for h in "$CGROUP_FS"/*/; do
  [[ -d $h$CGROUP ]] || continue
  for ((i = 0; i < 20; i++)); do
    find "$h$CGROUP" -depth -type d -exec rmdir {} + 2>/dev/null
    [[ -d $h$CGROUP ]] || break
    sleep 0.25
  done
  [[ -d $h$CGROUP ]] && log "could not remove cgroup $h$CGROUP"
done

if [[ -f $DIR/created-paths ]]; then
  sort -r -u "$DIR/created-paths" | while read -r p; do
    # Empty on the host (the node wrote into its covers): remove only empty folders.
    find "$p" -depth -type d -empty -delete 2>/dev/null
  done
fi
if [[ -d $DIR ]]; then
  if [[ ${PDPOOL_CLUSTER_KEEP_LOGS:-0} == 1 ]]; then
    find "$DIR" -mindepth 1 -maxdepth 1 ! -name logs -exec rm -rf {} +
  else
    rm -rf "$DIR"
  fi
fi
log "cluster $NAME is down"
