"""The few Kubernetes API calls the operator makes, over the official Python client.

Requests go through `ApiClient.call_api` with explicit content types: server-side apply
(`application/apply-patch+yaml`) for children, JSON merge patch for the pool's status.
"""
from __future__ import annotations

import json
from typing import Any

from .names import FIELD_MANAGER, GROUP, PLURAL, VERSION

# (apiVersion, kind) -> (URL prefix, plural) for every kind the builders produce.
KINDS = {
    ("v1", "ConfigMap"): ("/api/v1", "configmaps"),
    ("v1", "Service"): ("/api/v1", "services"),
    ("apps/v1", "Deployment"): ("/apis/apps/v1", "deployments"),
}


def object_path(manifest: dict[str, Any]) -> str:
    """The URL path of a namespaced object described by `manifest`."""
    key = (manifest["apiVersion"], manifest["kind"])
    if key not in KINDS:
        raise ValueError(f"no API path known for {key}")
    prefix, plural = KINDS[key]
    meta = manifest["metadata"]
    return f"{prefix}/namespaces/{meta['namespace']}/{plural}/{meta['name']}"


def pool_path(namespace: str, name: str, subresource: str = "") -> str:
    path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}"
    return f"{path}/{subresource}" if subresource else path


class Cluster:
    def __init__(self, api_client):
        self.api = api_client

    @classmethod
    def from_environment(cls) -> "Cluster":
        """In-cluster service account, or the kubeconfig ($KUBECONFIG) outside a cluster."""
        from kubernetes import client, config
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        return cls(client.ApiClient())

    def _call(self, method: str, path: str, body: Any = None, content_type: str | None = None,
              query: list[tuple[str, str]] | None = None) -> dict[str, Any]:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        response = self.api.call_api(
            path, method, query_params=query or [], header_params=headers,
            body=json.dumps(body) if body is not None else None,
            auth_settings=["BearerToken"], _preload_content=False, _return_http_data_only=True)
        return json.loads(response.data or b"{}")

    def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply one child; `force` takes over fields someone else changed."""
        return self._call("PATCH", object_path(manifest), manifest,
                          "application/apply-patch+yaml",
                          [("fieldManager", FIELD_MANAGER), ("force", "true")])

    def get_pool(self, namespace: str, name: str) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException
        try:
            return self._call("GET", pool_path(namespace, name))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def patch_pool_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self._call("PATCH", pool_path(namespace, name, "status"), {"status": status},
                   "application/merge-patch+json")

    def list_deployments(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        found = self._call("GET", f"/apis/apps/v1/namespaces/{namespace}/deployments",
                           query=[("labelSelector", label_selector)])
        return found.get("items", [])
