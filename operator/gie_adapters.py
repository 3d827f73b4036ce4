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
weight: 10}]}]. The rewrite is applied by a GIE endpoint picker that reads these objects
(llm-d's router); every target is an adapter the pool's engines serve (loras.py checks).
"""

from __future__ import annotations

from .children import Manifest, PoolRef, child_metadata
from .inference_pool_spec import InferencePoolSpec
from .loras import LoRASpec

REWRITE_GROUP = "inference.networking.x-k8s.io"
REWRITE_VERSION = "v1alpha2"
REWRITE_API = f"{REWRITE_GROUP}/{REWRITE_VERSION}"
REWRITE_KIND = "InferenceModelRewrite"
POOL_GROUP = "inference.networking.k8s.io"


def rewrite_name(pool: str) -> str:
    return f"{pool}-adapters"


def adapter_rewrite(ref: PoolRef, loras: LoRASpec) -> Manifest | None:
    """The pool's InferenceModelRewrite (None when no adapter has a rollout)."""
    rules = [
        {
            "matches": [{"model": {"type": "Exact", "value": adapter.name}}],
            "targets": [{"modelRewrite": t.adapter, "weight": t.weight} for t in adapter.rollout],
        }
        for adapter in loras.adapters
        if adapter.rollout
    ]
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


def retired_rewrite(ref: PoolRef) -> Manifest:
    """Names only: the pool's rewrite object, deleted when the spec no longer renders it."""
    return {
        "apiVersion": REWRITE_API,
        "kind": REWRITE_KIND,
        "metadata": {"name": rewrite_name(ref.name), "namespace": ref.namespace},
    }
