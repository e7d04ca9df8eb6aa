"""The operator's writes and reads through the official kubernetes client.

Apply strategy: server-side apply (``PATCH`` with ``application/apply-patch+yaml``, field manager
``hicache-operator``, ``force=True``). The rendered object is the whole intent, so applying it is
idempotent (an unchanged object is a no-op write that does not bump resourceVersion), fields other
managers own (controllers' status, annotations added by kubectl or other tools) are left alone, and
fields we stop rendering are removed because we no longer own them. The admin Secret is the
exception: it is created once and never applied again, so the key is never rotated by a re-render.
"""

from __future__ import annotations

import base64
import json
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from hicache_operator.api import labels
from hicache_operator.io.metrics import API_POOL_WAIT_SECONDS, API_SECONDS
from hicache_operator.api.spec import GROUP, PLURAL, VERSION

FIELD_MANAGER = "hicache-operator"
_APPLY_PATHS = {
    "StatefulSet": "/apis/apps/v1/namespaces/{namespace}/statefulsets/{name}",
    "Service": "/api/v1/namespaces/{namespace}/services/{name}",
    "ConfigMap": "/api/v1/namespaces/{namespace}/configmaps/{name}",
    "PodDisruptionBudget": "/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets/{name}",
    "Deployment": "/apis/apps/v1/namespaces/{namespace}/deployments/{name}",
    "ServiceAccount": "/api/v1/namespaces/{namespace}/serviceaccounts/{name}",
    "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/roles/{name}",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings/{name}",
}
_APPLY = "application/apply-patch+yaml"


def plain_json(call: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """A client call's response as plain JSON: building the client's typed models (and converting
    them back) costs more CPU than the request itself, which a fleet-sized operator feels."""
    return json.loads(call(*args, _preload_content=False, **kwargs).data)


def load_config(connections: int = 10) -> None:
    """In-cluster or kubeconfig credentials, with room for ``connections`` concurrent requests
    (the client's default pool is 5 per CPU; a worker beyond it would open and drop a TLS
    connection per request)."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    cfg = client.Configuration.get_default_copy()
    cfg.connection_pool_maxsize = max(cfg.connection_pool_maxsize or 0, connections)
    client.Configuration.set_default(cfg)


class ChildRefused(Exception):
    """The API server refused a rendered child as invalid (400/422). Retrying cannot help; only
    a spec change can, so the reconcile reports it as ConfigValid=False with the server's words."""

    def __init__(self, kind: str, name: str, message: str) -> None:
        super().__init__(f"the API server refused {kind} {name} rendered from this spec: {message}")
        self.kind, self.name = kind, name


def _status_message(data: bytes) -> str:
    try:
        return str(json.loads(data).get("message") or "")[:500]
    except (ValueError, AttributeError):
        return data[:500].decode(errors="replace")


class Kube:
    """Thin wrapper so handlers read as steps; every method is at most one API call.

    Some reads are remembered, because at fleet scale every pod event would repeat them: that an
    admin Secret exists and the key in it (for ``memo_seconds``, so a deleted or rotated one is
    noticed within that period), and the restart hash of the pod template of each StatefulSet we applied (we are its only
    writer; after a restart of the operator it is read once)."""

    def __init__(self, api_client: client.ApiClient | None = None, *, memo_seconds: float = 0.0,
                 parallel_calls: int = 8) -> None:
        self.api = api_client or client.ApiClient()
        self._pool = ThreadPoolExecutor(max_workers=parallel_calls, thread_name_prefix="hicache-api")
        self.memo_seconds = memo_seconds
        self._secrets_seen: dict[tuple[str, str], float] = {}
        self._template_hashes: dict[tuple[str, str], str | None] = {}
        self._secret_keys: dict[tuple[str, str, str], tuple[float, str | None]] = {}
        self._claims: dict[tuple[str, str], tuple[float, list[str] | None]] = {}
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
        YAML) refuses, so a model name with an emoji would be retried forever. The few characters
        that decoder refuses or folds when raw are escaped instead (a fuzzed spec found them)."""
        kind, name, ns = obj["kind"], obj["metadata"]["name"], obj["metadata"]["namespace"]
        if kind == "Secret":
            return self.create_secret(obj)
        method, url, headers, body, post = self.api.param_serialize(
            method="PATCH", resource_path=_APPLY_PATHS[kind], path_params={"namespace": ns, "name": name},
            query_params=[("fieldManager", FIELD_MANAGER), ("force", "true")],
            header_params={"Content-Type": _APPLY, "Accept": "application/json"},
            body=_yaml_safe_json(obj).encode(), auth_settings=["BearerToken"])
        with API_SECONDS.labels("apply", _metric_kind(obj)).time():
            resp = self.api.call_api(method, url, header_params=headers, body=body, post_params=post)
            resp.read()
        if resp.status in (400, 422):
            raise ChildRefused(kind, name, _status_message(resp.data))
        if not 200 <= resp.status < 300:
            raise ApiException(http_resp=resp)
        live = json.loads(resp.data)
        if kind == "StatefulSet":
            self._template_hashes[(ns, name)] = _template_hash(live)
        return live

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        """Delete one child the operator no longer renders (what it owns goes with it); False when
        it was gone already."""
        method, url, headers, body, post = self.api.param_serialize(
            method="DELETE", resource_path=_APPLY_PATHS[kind], path_params={"namespace": namespace, "name": name},
            header_params={"Content-Type": "application/json", "Accept": "application/json"},
            body={"propagationPolicy": "Background"}, auth_settings=["BearerToken"])
        with API_SECONDS.labels("delete", kind).time():
            resp = self.api.call_api(method, url, header_params=headers, body=body, post_params=post)
            resp.read()
        if resp.status == 404:
            return False
        if not 200 <= resp.status < 300:
            raise ApiException(http_resp=resp)
        return True

    def concurrently(self, *calls: Callable[[], Any]) -> list[Any]:
        """Run independent API calls at once and return their results in order; the first
        failure is raised after all have finished. Why: a new deployment's children are six
        independent writes, and waiting for each in turn made one reconcile six round trips long
        on a busy API server (where a fleet's creation queues behind it)."""
        futures = [self.submit(call) for call in calls]
        wait(futures)
        return [f.result() for f in futures]

    def submit(self, call: Callable[[], Any]) -> Future:
        """Start one call on the same pool, to be joined later (work that overlaps the applies)."""
        queued = time.monotonic()

        def timed() -> Any:
            API_POOL_WAIT_SECONDS.observe(time.monotonic() - queued)
            return call()
        return self._pool.submit(timed)

    def create_secret(self, obj: dict[str, Any]) -> dict[str, Any]:
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        try:
            with API_SECONDS.labels("create", "Secret").time():
                created = plain_json(self.core.create_namespaced_secret, key[0], obj)
        except ApiException as exc:
            if exc.status != 409:  # 409: someone created it meanwhile; theirs stands
                raise
            created = {}
        self._secrets_seen[key] = time.monotonic()
        return created

    def ensure_secret(self, obj: dict[str, Any]) -> bool:
        """Create the Secret unless it exists (theirs stands); True when this call created it."""
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        return not self._seen_recently(key) and bool(self.create_secret(obj))

    def secret_exists(self, namespace: str, name: str) -> bool:
        if self._seen_recently((namespace, name)):
            return True
        try:
            self.core.read_namespaced_secret(name, namespace, _preload_content=False)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        self._secrets_seen[(namespace, name)] = time.monotonic()
        return True

    def secret_key(self, namespace: str, secret: str, field: str) -> str | None:
        """An API key in a Secret (the admin key, the clients' key; None: no Secret or no such
        key), remembered for ``memo_seconds``: every swap step needs it."""
        memo = self._secret_keys.get((namespace, secret, field))
        if memo is not None and time.monotonic() - memo[0] < self.memo_seconds:
            return memo[1]
        try:
            data = plain_json(self.core.read_namespaced_secret, secret, namespace).get("data") or {}
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        value = base64.b64decode(data[field]).decode() if data.get(field) else None
        self._secret_keys[(namespace, secret, field)] = (time.monotonic(), value)
        return value

    def claim_access_modes(self, namespace: str, name: str) -> list[str] | None:
        """A PersistentVolumeClaim's access modes (its volume's once bound; None: no such claim),
        remembered for ``memo_seconds``: every pod event of a fleet would read it again."""
        memo = self._claims.get((namespace, name))
        if memo is not None and time.monotonic() - memo[0] < self.memo_seconds:
            return memo[1]
        try:
            with API_SECONDS.labels("get", "PersistentVolumeClaim").time():
                claim = plain_json(self.core.read_namespaced_persistent_volume_claim, name, namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
            modes = None
        else:
            modes = list((claim.get("status") or {}).get("accessModes") or
                         (claim.get("spec") or {}).get("accessModes") or [])
        self._claims[(namespace, name)] = (time.monotonic(), modes)
        return modes

    def _seen_recently(self, key: tuple[str, str]) -> bool:
        seen = self._secrets_seen.get(key)
        return seen is not None and time.monotonic() - seen < self.memo_seconds

    def template_hash(self, namespace: str, name: str) -> str | None:
        """The restart hash of the StatefulSet's pod template (None: no StatefulSet yet)."""
        key = (namespace, name)
        if key not in self._template_hashes:
            try:
                self._template_hashes[key] = _template_hash(
                    plain_json(self.apps.read_namespaced_stateful_set, name, namespace))
            except ApiException as exc:
                if exc.status != 404:
                    raise
                return None
        return self._template_hashes[key]

    def forget(self, namespace: str, name: str) -> None:
        """The deployment is gone: drop what was remembered for its children."""
        self._template_hashes.pop((namespace, name), None)

    def pods(self, namespace: str, deployment: str) -> list[dict[str, Any]]:
        sel = f"{labels.selector_string(deployment)},{labels.DEPLOYMENT}={deployment}"
        with API_SECONDS.labels("list", "Pod").time():
            return plain_json(self.core.list_namespaced_pod, namespace, label_selector=sel).get("items") or []

    def touch_service(self, namespace: str, name: str, stamp: str) -> None:
        """Set the Service's ``labels.ENDPOINTS_RESYNC`` annotation (its own field manager: the
        children's apply leaves it alone). An update of the Service is what makes the EndpointSlice
        controller sync it at once (see ``endpoint_lag``); gone meanwhile is fine."""
        body = {"metadata": {"annotations": {labels.ENDPOINTS_RESYNC: stamp}}}
        try:
            with API_SECONDS.labels("patch", "Service/endpoints-resync").time():
                self.core.patch_namespaced_service(name, namespace, body, field_manager=f"{FIELD_MANAGER}-endpoints",
                                                   _preload_content=False)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def get_deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return plain_json(self.custom.get_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def replace_deployment_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        """Write the whole status; returns the object as stored. A JSON patch, not a merge patch:
        a merge patch can only add or change keys of nested objects, so a pod record dropped from
        ``backendSwap.pods`` would live on."""
        with API_SECONDS.labels("patch", "HiCacheDeployment/status").time():
            return plain_json(self.custom.patch_namespaced_custom_object_status, GROUP, VERSION, namespace, PLURAL,
                              name, [{"op": "add", "path": "/status", "value": status}],
                              _content_type="application/json-patch+json")


# Refused by YAML's reader (DEL, C1 controls, U+FFFE/F), or read as line breaks and folded to
# spaces inside a quoted string (NEL, U+2028, U+2029).
_YAML_UNSAFE = re.compile("[\x7f-\x9f\u2028\u2029\ufffe\uffff]")


def _yaml_safe_json(obj: Any) -> str:
    """JSON text that the API server's YAML decoder reads back unchanged: raw UTF-8, except the
    characters above as escapes (outside strings JSON is ASCII, so only string contents change)."""
    return _YAML_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(obj, ensure_ascii=False))


def _metric_kind(obj: dict[str, Any]) -> str:
    """A child's kind for the API latency metric; a headless Service apart (no IP to allocate)."""
    if obj["kind"] == "Service":
        return "Service/headless" if (obj.get("spec") or {}).get("clusterIP") == "None" else "Service/ClusterIP"
    return obj["kind"]


def _template_hash(sts: dict[str, Any]) -> str | None:
    return ((((sts.get("spec") or {}).get("template") or {}).get("metadata") or {}).get(
        "annotations") or {}).get(labels.RESTART_HASH)
