"""spec.kvOffload: a KV offload tier below every engine's pool, as pod volumes and engine
flags (pure functions, no I/O; the engine's side is engine/kv/offload/).

    kvOffload:
      backend: native | disk | shared  # host memory; an emptyDir per pod; one PVC for all
      sizeGiB: 50                # per engine (vLLM's --kv-offloading-size)
      pvc: kv-tier               # shared only: a ReadWriteMany claim every engine mounts
      fsync: false               # fsync each record (a torn one is a miss either way)

The emptyDir's sizeLimit is the tier's size plus a margin (records in flight, directory
entries), so the kubelet never evicts a pod for a tier that keeps to its bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdpool.command_lines import KVOffload

from .spec import SpecError

KV_OFFLOAD_MOUNT = "/var/lib/pdpool/kv-offload"
VOLUME = "kv-offload"
BACKENDS = ("native", "disk", "shared")
MARGIN = 1.1


@dataclass(frozen=True)
class KVOffloadSpec:
    backend: str
    size_gib: float
    pvc: str | None = None
    fsync: bool = False

    def launch(self) -> KVOffload:
        """The engines' tier, as pdpool/command_lines.py renders it: at the pod's mount."""
        path = KV_OFFLOAD_MOUNT if self.backend != "native" else None
        return KVOffload(self.size_gib, self.backend, path, self.fsync)

    @property
    def on_disk(self) -> bool:
        """A volume to mount (native keeps the tier in the engine's memory)."""
        return self.backend != "native"

    def volume(self) -> dict[str, Any]:
        if self.backend == "shared":
            return {"name": VOLUME, "persistentVolumeClaim": {"claimName": self.pvc}}
        limit = f"{int(self.size_gib * MARGIN * 1024) + 1}Mi"
        return {"name": VOLUME, "emptyDir": {"sizeLimit": limit}}

    def mount(self) -> dict[str, Any]:
        return {"name": VOLUME, "mountPath": KV_OFFLOAD_MOUNT}


def parse_kv_offload(spec: dict[str, Any]) -> KVOffloadSpec | None:
    where = "spec.kvOffload"
    k = spec.get("kvOffload")
    if k is None:
        return None
    if not isinstance(k, dict):
        raise SpecError(f"{where} must be an object")
    backend = k.get("backend", "disk")
    if backend not in BACKENDS:
        raise SpecError(f"{where}.backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    size = k.get("sizeGiB")
    if isinstance(size, bool) or not isinstance(size, (int, float)) or not 0 < size <= 1 << 20:
        raise SpecError(f"{where}.sizeGiB must be a number of GiB > 0, got {size!r}")
    pvc = k.get("pvc")
    if backend == "shared" and (not isinstance(pvc, str) or not pvc):
        raise SpecError(f"{where}.pvc is required with backend shared (a ReadWriteMany claim)")
    if backend != "shared" and pvc is not None:
        raise SpecError(f"{where}.pvc is for backend shared (disk uses an emptyDir per pod)")
    fsync = k.get("fsync", False)
    if not isinstance(fsync, bool):
        raise SpecError(f"{where}.fsync must be a boolean")
    return KVOffloadSpec(backend, float(size), pvc, fsync)
