"""kopf handlers: thin glue between events and the pure builders/status functions.

- pool created / spec changed / operator resumed -> create the pool's KV-signing Secret if
  it is absent (never rotated), server-side apply every child, then publish status
  (observedGeneration, conditions);
- a child Deployment changed -> recompute the owning pool's status;
- a spec the operator cannot honour -> Ready=False with the reason, a Warning Event, and
  no retry loop (the next spec change is handled normally);
- an autoscaled pool (`autoscaling.mode: planner`) -> a timer runs the planner
  (autoscaler.py) every intervalSeconds.
Deletion needs no handler: children carry owner references and the garbage collector
removes them (so no finalizer can block a delete while the operator is down).
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from .autoscaler import DEFAULT_METRICS_URL, Autoscaler
from .builders import build_children, retired_children
from .pool_secrets import kv_secret
from .children import PoolRef
from .inference_pool import GIE_GROUP, GIE_VERSION, inference_pool_parents
from .kube import Cluster
from .names import DECODE, GATEWAY, GROUP, LABEL_POOL, PLURAL, PREFILL, VERSION
from .spec import PoolSpec, SpecError, parse_pool_spec
from .status import RoleState, carried_spec_error, compute_status, now_iso, status_changed

log = logging.getLogger("pdpool.operator")
_state: dict[str, Cluster | None] = {"cluster": None}
_autoscaler: dict[str, Autoscaler] = {}
_settings = {"metrics_url": DEFAULT_METRICS_URL}
AUTOSCALE_TICK_S = 2.0  # how often the timer looks; each pool acts on its own interval
_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()


def cluster() -> Cluster:
    current = _state["cluster"]
    if current is None:
        current = _state["cluster"] = Cluster.from_environment()
    return current


def configure_autoscaler(metrics_url_template: str) -> None:
    """Where the planner reads each pod's metrics ({scheme}, {ip}, {port}, {pod},
    {namespace}); set by `pdpool operator --metrics-url-template` before kopf starts."""
    _settings["metrics_url"] = metrics_url_template


def autoscaler() -> Autoscaler:
    if "current" not in _autoscaler:
        _autoscaler["current"] = Autoscaler(cluster(), _settings["metrics_url"])
    return _autoscaler["current"]


def _namespaced(namespace: str | None) -> str:
    """kopf types `namespace` optional (cluster-scoped kinds have none); pools and their
    Deployments are namespaced."""
    if namespace is None:
        raise kopf.PermanentError("a namespaced object came without a namespace")
    return namespace


def _pool_lock(namespace: str, name: str) -> threading.Lock:
    # Reconcile and child events run in worker threads: one status writer per pool.
    with _locks_guard:
        return _locks.setdefault((namespace, name), threading.Lock())


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Handler progress lives in annotations so `.status` keeps the schema of the CRD.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING  # only warnings become Events, not every success
    # The CRD is installed before the operator (Helm crds/): no need to watch CRDs, which
    # keeps apiextensions out of the RBAC rules.
    settings.scanning.disabled = True
    settings.watching.server_timeout = 300
    settings.execution.max_workers = 8
    cluster()


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def reconcile(
    name: str,
    namespace: str | None,
    uid: str,
    spec: kopf.Spec,
    meta: kopf.Meta,
    body: kopf.Body,
    **_: Any,
) -> None:
    namespace = _namespaced(namespace)
    generation = meta.get("generation", 0)
    try:
        pool = parse_pool_spec(name, dict(spec))
    except SpecError as exc:
        _fail(body, namespace, name, generation, "InvalidSpec", str(exc))
        return
    ref = PoolRef(name, namespace, uid)
    applying: dict[str, Any] = {"kind": "Secret", "apiVersion": "v1"}
    try:
        ensure_kv_secret(ref, pool)
        autoscaler().hold_bounds(ref, pool, only_existing=True)
        for manifest in build_children(ref, pool):
            applying = manifest
            cluster().apply(manifest)
        autoscaler().hold_bounds(ref, pool, only_existing=False)
        remove_retired_children(ref, pool)
    except ApiException as exc:
        if exc.status == 404:  # the API server does not serve that kind: its CRD is missing
            kind = f"{applying['kind']} ({applying['apiVersion']})"
            message = f"the API server does not serve {kind}: install its CRDs"
            _fail(body, namespace, name, generation, "ApplyFailed", message)
            return
        if refused_by_api_server(exc.status, _api_message(exc)):
            _fail(body, namespace, name, generation, "ApplyFailed", _api_message(exc))
            return
        raise kopf.TemporaryError(
            f"applying children failed: {_api_message(exc)}", delay=5
        ) from exc
    refresh_status(namespace, name, observed_generation=generation)


def remove_retired_children(ref: PoolRef, pool: PoolSpec) -> None:
    """Deletes the pool's HPAs or ScaledObjects its autoscaling mode no longer renders, and
    its adapters' InferenceModelRewrite once no adapter has a rollout. Without the RBAC to
    read or delete them (an older chart) it says so and goes on."""
    for manifest in retired_children(ref, pool):
        try:
            if cluster().delete_owned(manifest, ref.uid):
                log.info(
                    "pool %s/%s: deleted %s %s (the spec no longer renders it)",
                    ref.namespace,
                    ref.name,
                    manifest["kind"],
                    manifest["metadata"]["name"],
                )
        except ApiException as exc:
            if exc.status != 403:
                raise
            log.warning(
                "pool %s/%s: cannot check for a retired %s: %s",
                ref.namespace,
                ref.name,
                manifest["kind"],
                _api_message(exc),
            )


def ensure_kv_secret(ref: PoolRef, pool: PoolSpec) -> None:
    """Create `<pool>-kv-secret` (32 random bytes, hex) when the engines need it and it is
    absent. An existing one is never read or replaced: running engines hold its value, and a
    new value would make every handoff between old and new pods fail."""
    manifest = kv_secret(ref, pool, secrets.token_hex(32))
    if manifest is not None and cluster().create_if_absent(manifest):
        log.info(
            "pool %s/%s: created Secret %s", ref.namespace, ref.name, manifest["metadata"]["name"]
        )


def _autoscaled(spec: kopf.Spec, **_: Any) -> bool:
    scaling = spec.get("autoscaling") or {}
    return bool(scaling) and scaling.get("enabled", True) is not False


@kopf.timer(GROUP, VERSION, PLURAL, interval=AUTOSCALE_TICK_S, when=_autoscaled)
def autoscale(name: str, namespace: str | None, uid: str, spec: kopf.Spec, **_: Any) -> None:
    namespace = _namespaced(namespace)
    try:
        pool = parse_pool_spec(name, dict(spec))
    except SpecError:
        return  # reconcile reports it
    try:
        autoscaler().tick(PoolRef(name, namespace, uid), pool)
    except ApiException as exc:
        log.warning("autoscaling %s/%s: %s", namespace, name, _api_message(exc))


@kopf.on.event("apps", "v1", "deployments", labels={LABEL_POOL: kopf.PRESENT})
def child_changed(namespace: str | None, labels: kopf.Labels, type: str | None, **_: Any) -> None:
    if type is None:  # the initial listing: resume handlers publish status anyway
        return
    namespace = _namespaced(namespace)
    try:
        refresh_status(namespace, labels[LABEL_POOL])
    except ApiException as exc:
        log.warning(
            "status refresh of %s/%s failed: %s", namespace, labels[LABEL_POOL], _api_message(exc)
        )


def refresh_status(
    namespace: str,
    name: str,
    observed_generation: int | None = None,
    spec_error: tuple[str, str] | None = None,
) -> None:
    """Recompute the pool's status from its children and patch it if anything changed."""
    with _pool_lock(namespace, name):
        body = cluster().get_pool(namespace, name)
        if body is None:
            return  # deleted meanwhile
        meta, current = body["metadata"], body.get("status") or {}
        generation = meta.get("generation", 0)
        if spec_error is None and observed_generation is None:
            spec_error = carried_spec_error(current, generation)
        roles: dict[str, RoleState | None] = {PREFILL: None, DECODE: None, GATEWAY: None}
        for deployment in cluster().list_deployments(namespace, f"{LABEL_POOL}={name}"):
            owners = deployment["metadata"].get("ownerReferences") or []
            role = deployment["metadata"].get("labels", {}).get("pdpool.io/role")
            if role in roles and any(o.get("uid") == meta["uid"] for o in owners):
                roles[role] = RoleState.from_deployment(deployment)
        port = ((body.get("spec") or {}).get("gateway") or {}).get("port", 8080)
        status = compute_status(
            pool=name,
            namespace=namespace,
            generation=generation,
            gateway_port=port,
            roles=roles,
            spec_error=spec_error,
            old_conditions=current.get("conditions"),
            now=now_iso(),
        )
        if observed_generation is not None:
            status["observedGeneration"] = observed_generation
        gie = ((body.get("spec") or {}).get("inferencePool")) or {}
        if gie.get("enabled") is True:
            status["inferencePool"] = _inference_pool_status(namespace, name)
        # merge_conditions kept the old transition times, so an unchanged state compares equal.
        if status_changed(current, status):
            cluster().patch_pool_status(namespace, name, status)


@kopf.on.event(GIE_GROUP, GIE_VERSION, "inferencepools", labels={LABEL_POOL: kopf.PRESENT})
def inference_pool_changed(
    namespace: str | None, labels: kopf.Labels, type: str | None, **_: Any
) -> None:
    """A Gateway accepted (or refused) the pool's InferencePool: shown in the pool's status."""
    if type is None:
        return
    namespace = _namespaced(namespace)
    try:
        refresh_status(namespace, labels[LABEL_POOL])
    except ApiException as exc:
        log.warning("status refresh of %s/%s failed: %s", namespace, labels[LABEL_POOL], exc)


def _inference_pool_status(namespace: str, name: str) -> dict[str, Any]:
    """The InferencePool's name and its parents' conditions (none until a Gateway takes it)."""
    try:
        live = cluster().get(
            {
                "apiVersion": f"{GIE_GROUP}/{GIE_VERSION}",
                "kind": "InferencePool",
                "metadata": {"namespace": namespace, "name": name},
            }
        )
    except ApiException as exc:
        log.debug("reading InferencePool %s/%s: %s", namespace, name, exc)
        live = None
    return {"name": name, "parents": inference_pool_parents(live)}


def _fail(
    body: kopf.Body, namespace: str, name: str, generation: int, reason: str, message: str
) -> None:
    log.warning("pool %s/%s: %s: %s", namespace, name, reason, message)
    kopf.warn(body, reason=reason, message=message)
    refresh_status(namespace, name, observed_generation=generation, spec_error=(reason, message))


def refused_by_api_server(status: int, message: str) -> bool:
    """The child itself is invalid (retrying cannot help), as opposed to a transient error.

    Server-side apply answers 500 when a field cannot even be converted to its type.
    """
    return status in (400, 422) or (status == 500 and "unable to convert" in message)


def _api_message(exc: ApiException) -> str:
    try:
        return str(json.loads(exc.body or "").get("message") or exc.reason)
    except (TypeError, ValueError, AttributeError):
        return f"{exc.status} {exc.reason}"
