"""What every child is built from: the owner, metadata and its rendered-hash stamp, and the one
container hardening, pod hardening and resources helpers."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from hicache_operator.api import labels
from hicache_operator.api.spec import GROUP, KIND, VERSION
from hicache_operator.api.spec_fields import Resources
from hicache_operator.api.spec_hicache import Rdma

RUN_AS = 1000


@dataclass(frozen=True)
class Owner:
    name: str
    namespace: str
    uid: str

    def reference(self) -> dict[str, Any]:
        return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": self.name, "uid": self.uid,
                "controller": True, "blockOwnerDeletion": True}


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def meta(owner: Owner, name: str, component: str) -> dict[str, Any]:
    return {"name": name, "namespace": owner.namespace,
            "labels": {**labels.selector_labels(owner.name), labels.DEPLOYMENT: owner.name,
                       labels.COMPONENT: component},
            "ownerReferences": [owner.reference()]}


def stamp(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` with its rendered hash annotated (what the informers compare to skip an apply)."""
    obj["metadata"].setdefault("annotations", {})[labels.RENDERED_HASH] = digest(obj)
    return obj


def field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def secret_env(name: str, secret: str, key: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def container_security(*, rdma: Rdma | None = None, read_only_root: bool = False) -> dict[str, Any]:
    """A container's: non-root with no capabilities (``read_only_root``: on a read-only root
    filesystem). With ``rdma`` (the engine's): IPC_LOCK (in effect for a root process; a non-root
    one relies on the memlock limit the node's container runtime sets), or with ``rdma.privileged``
    privileged and root, which registers memory whatever that limit."""
    if rdma is not None and rdma.privileged:
        return {"privileged": True, "allowPrivilegeEscalation": True, "runAsNonRoot": False, "runAsUser": 0,
                "runAsGroup": 0, "capabilities": {"add": ["IPC_LOCK"]}}
    caps: dict[str, list[str]] = {"drop": ["ALL"]}
    if rdma is not None:
        caps["add"] = ["IPC_LOCK"]
    out: dict[str, Any] = {"allowPrivilegeEscalation": False, "capabilities": caps, "runAsNonRoot": True,
                           "privileged": False}
    if read_only_root:
        out["readOnlyRootFilesystem"] = True
    return out


def pod_security(*, fs_group: bool = False) -> dict[str, Any]:
    """A pod's: non-root as ``RUN_AS``, the runtime's default seccomp profile (``fs_group``: volumes
    owned by that group too)."""
    out: dict[str, Any] = {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS}
    if fs_group:
        out["fsGroup"] = RUN_AS
    return {**out, "seccompProfile": {"type": "RuntimeDefault"}}


def resources_of(given: Resources) -> dict[str, dict[str, str]]:
    """A spec's requests and limits as a container states them (every quantity a string)."""
    return {"requests": {k: str(v) for k, v in given.requests.items()},
            "limits": {k: str(v) for k, v in given.limits.items()}}
