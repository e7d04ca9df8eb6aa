"""The operator's writes and reads through the official kubernetes client.

Apply strategy: server-side apply (``PATCH`` with ``application/apply-patch+yaml``, field manager
``hicache-operator``, ``force=True``). The rendered object is the whole intent, so applying it is
idempotent (an unchanged object is a no-op write that does not bump resourceVersion), fields other
managers own (controllers' status, annotations added by kubectl or other tools) are left alone, and
fields we stop rendering are removed because we no longer own them. The admin Secret is the
exception: it is created once and never applied again, so the key is never rotated by a re-render.
"""

from __future__ import annotations

import json
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from hicache_operator import labels
from hicache_operator.spec import GROUP, PLURAL, VERSION

FIELD_MANAGER = "hicache-operator"
_APPLY_PATHS = {
    "StatefulSet": "/apis/apps/v1/namespaces/{namespace}/statefulsets/{name}",
    "Service": "/api/v1/namespaces/{namespace}/services/{name}",
    "ConfigMap": "/api/v1/namespaces/{namespace}/configmaps/{name}",
    "PodDisruptionBudget": "/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets/{name}",
}
_APPLY = "application/apply-patch+yaml"


def load_config() -> None:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


class Kube:
    """Thin wrapper so handlers read as steps; every method is one API call."""

    def __init__(self, api_client: client.ApiClient | None = None) -> None:
        self.api = api_client or client.ApiClient()
        self.core = client.CoreV1Api(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.policy = client.PolicyV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)

    def to_dict(self, obj: Any) -> dict:
        return self.api.sanitize_for_serialization(obj)

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply of one rendered child (created if absent); returns the live object.

        The body is sent as UTF-8 JSON text: the client's own serialisation escapes characters
        beyond U+FFFF as surrogate pairs, which the API server's YAML decoder (apply patches are
        YAML) refuses, so a model name with an emoji would be retried forever."""
        kind, name, ns = obj["kind"], obj["metadata"]["name"], obj["metadata"]["namespace"]
        if kind == "Secret":
            return self.create_secret(obj)
        method, url, headers, body, post = self.api.param_serialize(
            method="PATCH", resource_path=_APPLY_PATHS[kind], path_params={"namespace": ns, "name": name},
            query_params=[("fieldManager", FIELD_MANAGER), ("force", "true")],
            header_params={"Content-Type": _APPLY, "Accept": "application/json"},
            body=json.dumps(obj, ensure_ascii=False).encode(), auth_settings=["BearerToken"])
        resp = self.api.call_api(method, url, header_params=headers, body=body, post_params=post)
        resp.read()
        if not 200 <= resp.status < 300:
            raise ApiException(http_resp=resp)
        return json.loads(resp.data)

    def create_secret(self, obj: dict[str, Any]) -> dict[str, Any]:
        try:
            return self.to_dict(self.core.create_namespaced_secret(obj["metadata"]["namespace"], obj))
        except ApiException as exc:
            if exc.status != 409:  # 409: someone created it meanwhile; theirs stands
                raise
            return {}

    def secret_exists(self, namespace: str, name: str) -> bool:
        try:
            self.core.read_namespaced_secret(name, namespace)
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise

    def statefulset(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.to_dict(self.apps.read_namespaced_stateful_set(name, namespace))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def pods(self, namespace: str, deployment: str) -> list[dict[str, Any]]:
        sel = f"{labels.selector_string(deployment)},{labels.DEPLOYMENT}={deployment}"
        return [self.to_dict(p) for p in self.core.list_namespaced_pod(namespace, label_selector=sel).items]

    def delete_pod(self, namespace: str, name: str) -> None:
        try:
            self.core.delete_namespaced_pod(name, namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def get_deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def replace_deployment_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Write the whole status. A JSON patch, not a merge patch: a merge patch can only add or
        change keys of nested objects, so a pod record dropped from ``backendSwap.pods`` would
        live on."""
        self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, [{"op": "add", "path": "/status", "value": status}],
            _content_type="application/json-patch+json")
