"""The Gateway API Inference Extension objects for a pool's LoRA adapters (pure, no I/O).

In GIE v1 an InferencePool serves every model its model servers list (`/v1/models`: the
base model and each adapter): an adapter needs no object of its own (the alpha
InferenceModel that once declared one is retired). What GIE keeps for adapters is
`InferenceModelRewrite` (inference.networking.x-k8s.io/v1alpha2): a request's `model` is
rewritten to other served models by weight, the canary / blue-green rollout of a new
adapter version. An adapter of spec.loras with a `rollout` becomes one rule of the pool's
rewrite object:

    loras: {adapters: [{name: sql, hub: acme/sql-v2, rollout: [{adapter: sql, weight: 90},
                                                               {adapter: sql-v3, weight: 10}]},
                       {name: sql-v3, hub: acme/sql-v3}]}

renders, with spec.inferencePool enabled, rules: [{matches: [{model: {type: Exact,
value: sql}}], targets: [{modelRewrite: sql, weight: 90}, {modelRewrite: sql-v3,
weight: 10}]}]. Every target is an adapter the pool's engines serve (loras.py checks).

A GIE endpoint picker that watches these objects (llm-d's router) applies them; ours
(`pdpool epp`) and our gateway read the same rules from a file instead (no API access:
their ServiceAccount mounts no token): the pool's `<pool>-model-rewrites` ConfigMap,
mounted whole (an edit reaches the file, which they re-read) and named by
`--model-rewrites` (sidecar/routing/model_rewrite.py). It is rendered for every pool with
a rollout, so our gateway splits too when spec.inferencePool is off.
"""

from __future__ import annotations

from typing import Any

import yaml

from .children import Manifest, PoolRef, child_metadata
from .inference_pool_spec import InferencePoolSpec
from .loras import LoRASpec

REWRITE_GROUP = "inference.networking.x-k8s.io"
REWRITE_VERSION = "v1alpha2"
REWRITE_API = f"{REWRITE_GROUP}/{REWRITE_VERSION}"
REWRITE_KIND = "InferenceModelRewrite"
POOL_GROUP = "inference.networking.k8s.io"
# The rules as the routers read them (`--model-rewrites`).
REWRITES_KEY = "rewrites.yaml"
REWRITES_DIR = "/etc/pdpool/model-rewrites"
REWRITES_FILE = f"{REWRITES_DIR}/{REWRITES_KEY}"
REWRITES_VOLUME = "model-rewrites"


def rewrite_name(pool: str) -> str:
    return f"{pool}-adapters"


def rewrite_rules(loras: LoRASpec | None) -> list[dict[str, Any]]:
    """GIE's rules for the adapters with a rollout (empty when none has one)."""
    if loras is None:
        return []
    return [
        {
            "matches": [{"model": {"type": "Exact", "value": adapter.name}}],
            "targets": [{"modelRewrite": t.adapter, "weight": t.weight} for t in adapter.rollout],
        }
        for adapter in loras.adapters
        if adapter.rollout
    ]


def adapter_rewrite(ref: PoolRef, loras: LoRASpec) -> Manifest | None:
    """The pool's InferenceModelRewrite (None when no adapter has a rollout)."""
    rules = rewrite_rules(loras)
    if not rules:
        return None
    return {
        "apiVersion": REWRITE_API,
        "kind": REWRITE_KIND,
        "metadata": child_metadata(ref, rewrite_name(ref.name), "inference-pool"),
        "spec": {
            "poolRef": {"group": POOL_GROUP, "kind": "InferencePool", "name": ref.name},
            "rules": rules,
        },
    }


def adapter_children(
    ref: PoolRef, gie: InferencePoolSpec | None, loras: LoRASpec | None
) -> list[Manifest]:
    if gie is None or loras is None:
        return []
    rewrite = adapter_rewrite(ref, loras)
    return [rewrite] if rewrite is not None else []


def rewrites_config_name(pool: str) -> str:
    return f"{pool}-model-rewrites"


def rewrites_config_map(ref: PoolRef, loras: LoRASpec | None) -> Manifest | None:
    """The rules as a file for `pdpool epp` and `pdpool gateway` (None without rollouts)."""
    rules = rewrite_rules(loras)
    if not rules:
        return None
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(ref, rewrites_config_name(ref.name), "router"),
        "data": {REWRITES_KEY: yaml.safe_dump({"rules": rules}, sort_keys=False)},
    }


def rewrites_file(loras: LoRASpec | None) -> str | None:
    """Where the routers read the rules (RouterLaunch.model_rewrites_file); None: none."""
    return REWRITES_FILE if rewrite_rules(loras) else None


def rewrites_mounts(loras: LoRASpec | None) -> list[dict[str, Any]]:
    if not rewrite_rules(loras):
        return []
    return [{"name": REWRITES_VOLUME, "mountPath": REWRITES_DIR, "readOnly": True}]


def rewrites_volumes(ref: PoolRef, loras: LoRASpec | None) -> list[dict[str, Any]]:
    """Mounted whole (no subPath): an edited ConfigMap reaches the file, which is re-read."""
    if not rewrite_rules(loras):
        return []
    return [{"name": REWRITES_VOLUME, "configMap": {"name": rewrites_config_name(ref.name)}}]


def retired_rewrites_config(ref: PoolRef) -> Manifest:
    """Names only: the rules' ConfigMap, deleted when the spec no longer renders it."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": rewrites_config_name(ref.name), "namespace": ref.namespace},
    }


def retired_rewrite(ref: PoolRef) -> Manifest:
    """Names only: the pool's rewrite object, deleted when the spec no longer renders it."""
    return {
        "apiVersion": REWRITE_API,
        "kind": REWRITE_KIND,
        "metadata": {"name": rewrite_name(ref.name), "namespace": ref.namespace},
    }
