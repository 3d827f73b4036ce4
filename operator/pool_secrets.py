"""The pool's secrets as the pods see them: the KV-signing key and the pool's own TLS.

The KV-signing Secret is made once by the handlers (its value is random; `kv_secret` takes
it as an argument so that this stays pure) and mounted into every pdpool engine. Under
`spec.tls` the engines and sidecars serve HTTPS with the pool's certificate, and clients
inside the pool verify against the pool's CA: the helpers here give each container its
mounts, volumes and flags for that.
"""

from __future__ import annotations

from typing import Any

from .children import Manifest, PoolRef, child_metadata
from .names import (
    KV_SECRET_KEY,
    POOL_TLS_DIR,
    TENANTS_DIR,
    TENANTS_KEY,
    kv_secret_name,
)
from .spec import PoolSpec, SecretKeyRef

# --- KV-signing Secret ---------------------------------------------------------------------

# Secret files are owned by root (group fsGroup when set) and the images run as uid 65532:
# 0400 would be unreadable by the engine. The volume is mounted into the engine container
# alone, whose processes all run as one uid, so read-only for all is the tightest mode
# that works without imposing an fsGroup (which would chown the model PVC).
KV_SECRET_MODE = 0o444


def kv_secret_ref(ref: PoolRef, pool: PoolSpec) -> SecretKeyRef | None:
    """The Secret and key pdpool engines read their KV-signing key from (the user's, or the
    one the operator creates); None for vLLM engines, which do not sign."""
    if pool.engine.kind != "pdpool":
        return None
    return pool.engine.kv_secret_ref or SecretKeyRef(kv_secret_name(ref.name), KV_SECRET_KEY)


def kv_secret(ref: PoolRef, pool: PoolSpec, value: str) -> Manifest | None:
    """The Secret to create when absent (`value`: fresh random bytes, from the caller), or
    None when the engines need none or the spec names the user's own."""
    if pool.engine.kind != "pdpool" or pool.engine.kv_secret_ref is not None:
        return None
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": child_metadata(ref, kv_secret_name(ref.name), "engine"),
        "stringData": {KV_SECRET_KEY: value},
    }


def kv_secret_volume(secret: SecretKeyRef) -> dict[str, Any]:
    return {
        "name": "kv-secret",
        "secret": {
            "secretName": secret.name,
            "defaultMode": KV_SECRET_MODE,
            "items": [{"key": secret.key, "path": KV_SECRET_KEY}],
        },
    }


# --- TLS inside the pool (spec.tls) -----------------------------------------------------------
# Engines and sidecars serve HTTPS with the pool's certificate; sidecars and the gateway
# verify their upstreams against the pool's CA. Peers are reached at pod IPs, which no
# certificate names in advance, so the chain is what is checked (--tls-any-name): the CA
# must be dedicated to the pool (a cert-manager Issuer of its own).


def http_name(pool: PoolSpec) -> str:
    return "https" if pool.tls_secret else "http"


def probe_scheme(pool: PoolSpec) -> str | None:
    return "HTTPS" if pool.tls_secret else None


def pool_tls_mounts(pool: PoolSpec) -> list[dict[str, Any]]:
    if not pool.tls_secret:
        return []
    return [{"name": "pool-tls", "mountPath": POOL_TLS_DIR, "readOnly": True}]


def pool_tls_volumes(pool: PoolSpec) -> list[dict[str, Any]]:
    if not pool.tls_secret:
        return []
    return [
        {
            "name": "pool-tls",
            "secret": {"secretName": pool.tls_secret, "defaultMode": KV_SECRET_MODE},
        }
    ]


def tenants_mounts(pool: PoolSpec) -> list[dict[str, Any]]:
    if pool.gateway.tenants_secret is None:
        return []
    return [{"name": "tenants", "mountPath": TENANTS_DIR, "readOnly": True}]


def tenants_volumes(pool: PoolSpec) -> list[dict[str, Any]]:
    """Mounted whole (no subPath), so a changed Secret reaches the file, which is re-read."""
    ref = pool.gateway.tenants_secret
    if ref is None:
        return []
    return [
        {
            "name": "tenants",
            "secret": {
                "secretName": ref.name,
                "defaultMode": KV_SECRET_MODE,
                "items": [{"key": ref.key, "path": TENANTS_KEY}],
            },
        }
    ]
