"""scripts/cluster/up.sh then down.sh leave the host exactly as they found it: kernel
settings, firewall, links/addresses/routes, mounts, cgroups, processes, folders, even after
the node ran a pod (bridge, veth, iptables rules by kube-proxy, sysctls the kubelet sets)."""

from __future__ import annotations

import pytest

from devtools import host_state
from tests.cluster.conftest import SLIM, images, require_root, start, stop

pytestmark = [
    pytest.mark.slow,
    pytest.mark.cluster,
    pytest.mark.waits_for_build("images/build.sh"),
]

POD = """
apiVersion: v1
kind: Pod
metadata: {name: probe}
spec:
  securityContext: {runAsNonRoot: true, runAsUser: 65532, seccompProfile: {type: RuntimeDefault}}
  containers:
  - name: probe
    image: localhost/pdpool-slim:dev
    imagePullPolicy: Never
    command:
    - python3
    - -c
    - |
      import socket, time
      socket.gethostbyname("kubernetes.default.svc.cluster.local")
      print("resolved", flush=True)
      time.sleep(3600)
    securityContext:
      allowPrivilegeEscalation: false
      readOnlyRootFilesystem: true
      capabilities: {drop: [ALL]}
    readinessProbe: {exec: {command: [python3, -c, "1"]}, periodSeconds: 1}
"""


def test_up_then_down_leaves_the_host_as_it_was():
    require_root()
    images("slim")  # the node's pod needs no more
    name = "pdpool-hoststate"
    before = host_state.snapshot()
    cluster = start(name, SLIM)
    marks = (f"pdpool-{name}", str(cluster.dir), f"cluster/{name}")
    try:
        during = host_state.snapshot()
        # The node really runs: a pod (bridge, veth, kube-proxy rules) resolving a Service.
        cluster.kubectl("apply", "-f", "-", input=POD)
        cluster.kubectl("wait", "--for=condition=Ready", "pod/probe", "--timeout=120s", timeout=150)
        logs = cluster.kubectl("logs", "probe").stdout
        assert "resolved" in logs
        # ... and it shows: its cgroups and processes are on the host while it is up.
        assert host_state.differences(before, during, marks), "the cluster left no mark while up"
    finally:
        stop(cluster)
    after = host_state.snapshot()
    assert host_state.differences(before, after, marks) == []
