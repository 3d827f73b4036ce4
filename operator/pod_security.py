"""What every pod of a pool runs under: the `restricted` Pod Security Standard by default,
a read-only root filesystem with its writable places (/tmp and one cache folder), and
`spec.security` merged over the defaults key by key."""

from __future__ import annotations

import json
from typing import Any

from .spec import PoolSpec

# Every child pod meets the `restricted` Pod Security Standard by default: non-root (the
# images' uid 65532), no privilege escalation, no capabilities, the runtime's seccomp
# profile, a read-only root filesystem and no API token. `spec.security` merges over these
# key by key (an override that breaks the profile is the user's choice; a namespace that
# enforces `restricted` then refuses the pods).
POD_SECURITY_CONTEXT: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": 65532,
    "runAsGroup": 65532,
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY_CONTEXT: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
# The writable places of a read-only root filesystem: /tmp, and one cache folder that
# every library the engines load is pointed at (Hugging Face, torch, Triton, vLLM, ...).
TMP_MOUNT, CACHE_MOUNT = "/tmp", "/cache"
CACHE_ENV = {
    "HOME": "/tmp",  # libraries that write under ~ (~/.config, ~/.nv, ...)
    "XDG_CACHE_HOME": CACHE_MOUNT,
    "HF_HOME": f"{CACHE_MOUNT}/huggingface",
    "TORCH_HOME": f"{CACHE_MOUNT}/torch",
    "TORCHINDUCTOR_CACHE_DIR": f"{CACHE_MOUNT}/torchinductor",
    "TRITON_CACHE_DIR": f"{CACHE_MOUNT}/triton",
    "CUDA_CACHE_PATH": f"{CACHE_MOUNT}/nv",
    "NUMBA_CACHE_DIR": f"{CACHE_MOUNT}/numba",
    "VLLM_CACHE_ROOT": f"{CACHE_MOUNT}/vllm",
    "VLLM_CONFIG_ROOT": f"{CACHE_MOUNT}/vllm-config",
    "FLASHINFER_WORKSPACE_BASE": CACHE_MOUNT,
}


def _merged(defaults: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(json.dumps(defaults))  # deep copy
    out.update(json.loads(json.dumps(override)))
    return out


def pod_security_context(pool: PoolSpec) -> dict[str, Any]:
    return _merged(POD_SECURITY_CONTEXT, pool.security.pod_security_context)


def container_security_context(pool: PoolSpec) -> dict[str, Any]:
    return _merged(CONTAINER_SECURITY_CONTEXT, pool.security.container_security_context)


def cache_env() -> list[dict[str, Any]]:
    return [{"name": k, "value": v} for k, v in CACHE_ENV.items()]


def empty_dir(name: str, size_limit: str | None = None, memory: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    if memory:
        spec["medium"] = "Memory"
    if size_limit:
        spec["sizeLimit"] = size_limit
    return {"name": name, "emptyDir": spec}
