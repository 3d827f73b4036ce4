"""What every child object of a pool shares: the pool's identity and the metadata that
makes the pool its controlling owner (deleting the pool lets the garbage collector remove
them all)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .names import API_VERSION, KIND, labels

Manifest = dict[str, Any]


@dataclass(frozen=True)
class PoolRef:
    """The identity of the pool that owns the children."""

    name: str
    namespace: str
    uid: str


def owner_reference(ref: PoolRef) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": ref.name,
        "uid": ref.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def child_metadata(ref: PoolRef, name: str, role: str, **extra_labels: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": ref.namespace,
        "labels": {**labels(ref.name, role), **extra_labels},
        "ownerReferences": [owner_reference(ref)],
    }
