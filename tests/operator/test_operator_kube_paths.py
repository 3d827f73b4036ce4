"""URL paths of the API calls the operator makes."""

import pytest

from pdpool.operator.builders import build_children
from pdpool.operator.children import PoolRef
from pdpool.operator.pool_secrets import kv_secret
from pdpool.operator.kube import collection_path, object_path, pool_path
from pdpool.operator.spec import parse_pool_spec


def test_every_built_child_has_an_api_path():
    spec = {"model": {"path": "/m"}, "engine": {"image": "e"}}
    paths = [
        object_path(m) for m in build_children(PoolRef("p", "ns", "u"), parse_pool_spec("p", spec))
    ]
    assert "/apis/apps/v1/namespaces/ns/deployments/p-decode" in paths
    assert "/api/v1/namespaces/ns/services/p-prefill" in paths
    assert "/api/v1/namespaces/ns/configmaps/p-router" in paths
    assert len(set(paths)) == len(paths)


def test_the_kv_secret_is_created_in_the_secrets_collection():
    secret = kv_secret(
        PoolRef("p", "ns", "u"),
        parse_pool_spec("p", {"model": {"path": "/m"}, "engine": {"image": "e"}}),
        "0" * 64,
    )
    assert collection_path(secret) == "/api/v1/namespaces/ns/secrets"


def test_unknown_kind_is_an_error():
    with pytest.raises(ValueError, match="no API path"):
        object_path(
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x", "namespace": "y"}}
        )


def test_pool_status_path():
    assert (
        pool_path("ns", "p", "status")
        == "/apis/pdpool.io/v1alpha1/namespaces/ns/pdinferencepools/p/status"
    )
