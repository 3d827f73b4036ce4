"""`pdpool operator render -f POOL.yaml`: the objects the operator would create, offline.

The same pure builders the handlers use, with no cluster: useful to review a spec or diff
two versions. The KV-signing Secret shows a placeholder value (the operator generates the
real one in the cluster, once); the placeholder is too short for an engine to accept, so a
rendered Secret applied by hand can never become a known pool key.
"""

from __future__ import annotations

from typing import Any

from .builders import build_children
from .pool_secrets import kv_secret
from .children import Manifest, PoolRef
from .names import API_VERSION, KIND
from .spec import SpecError, parse_pool_spec

SECRET_PLACEHOLDER = "<generated>"
UID_PLACEHOLDER = "<pool-uid>"


def render_pools(docs: list[Any], namespace: str = "default") -> list[Manifest]:
    """PDInferencePool documents -> every object the operator makes for them, in order."""
    out: list[Manifest] = []
    for doc in docs:
        if not doc:
            continue
        if (
            not isinstance(doc, dict)
            or doc.get("kind") != KIND
            or doc.get("apiVersion") != API_VERSION
        ):
            raise SpecError(
                f"not a {API_VERSION} {KIND}: {doc.get('kind') if isinstance(doc, dict) else doc!r}"
            )
        meta = doc.get("metadata") or {}
        name = meta.get("name")
        if not name:
            raise SpecError("metadata.name is required")
        ref = PoolRef(name, meta.get("namespace") or namespace, meta.get("uid") or UID_PLACEHOLDER)
        pool = parse_pool_spec(name, doc.get("spec"))
        secret = kv_secret(ref, pool, SECRET_PLACEHOLDER)
        out += ([secret] if secret else []) + build_children(ref, pool)
    return out
