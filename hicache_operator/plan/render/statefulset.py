"""The fleet's pods: the operator's pod template and the StatefulSet that runs it.

``updateStrategy: OnDelete``: a template change (e.g. the storage config after a live backend
swap) never restarts a pod by itself. The operator deletes pods whose ``hicache.dev/restart-hash``
(everything but the storage config) is stale, within maxUnavailable; a pod that restarts for any
reason comes up with the target config.
"""

from __future__ import annotations

import json
from typing import Any

from hicache_operator.api import flags, labels
from hicache_operator.api.spec import RUNTIME_CONTAINER, HiCacheDeploymentSpec
from hicache_operator.api.status import SizingRecord
from hicache_operator.fleet import gate
from hicache_operator.fleet.names import names
from hicache_operator.plan.model import source as model_source
from hicache_operator.plan.render.common import Owner, container_security, field_env, meta, pod_security, stamp
from hicache_operator.plan.render.runtime import args, env, resources

CONTAINER = RUNTIME_CONTAINER
# Volumes every pod gets (name -> mount path); extraVolumes and extraVolumeMounts must not clash.
OPERATOR_VOLUMES = {"storage-config": flags.STORAGE_CONFIG_DIR, "tmp": "/tmp", "dshm": "/dev/shm"}
HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"


def operator_volumes(spec: HiCacheDeploymentSpec) -> dict[str, str]:
    """Every volume the operator gives this spec's pods (name -> mount path)."""
    return {**OPERATOR_VOLUMES, **model_source.reserved_mounts(spec)}


def _affinity(spec: HiCacheDeploymentSpec, name: str) -> dict[str, Any]:
    """The user's affinity plus the placement sizing assumes: spread, at most one pod of the fleet
    per node (required); pack, pods of the fleet preferred together (the GPU and memory requests
    bound how many a node takes)."""
    affinity = json.loads(json.dumps(spec.affinity or {}))
    term = {"labelSelector": {"matchLabels": labels.selector_labels(name)}, "topologyKey": HOSTNAME_TOPOLOGY}
    if spec.placement.policy == "spread":
        affinity.setdefault("podAntiAffinity", {}).setdefault(
            "requiredDuringSchedulingIgnoredDuringExecution", []).append(term)
    else:
        affinity.setdefault("podAffinity", {}).setdefault(
            "preferredDuringSchedulingIgnoredDuringExecution", []).append({"weight": 100, "podAffinityTerm": term})
    return affinity


def storage_owned(spec: HiCacheDeploymentSpec, sizing: SizingRecord | None, owner: Owner, *,
                  include_storage: bool = True) -> dict[str, Any]:
    """The runtime container's fields that hold storage settings (the L3 flags, the Mooncake env,
    the Mooncake segment's memory); without ``include_storage`` as the restart hash reads them."""
    return {"args": args(spec, sizing, include_storage=include_storage),
            "env": env(spec, owner, include_storage),
            "resources": resources(spec, sizing, include_storage=include_storage)}


def without_storage(base: dict[str, Any], spec: HiCacheDeploymentSpec, sizing: SizingRecord | None,
                    owner: Owner) -> dict[str, Any]:
    """``base`` (an ``operator_template``) with its runtime container's storage-owned fields as they
    are without storage: the restart hash's input before the overlay. ``base`` is not changed."""
    first, *rest = base["spec"]["containers"]
    container = {**first, **storage_owned(spec, sizing, owner, include_storage=False)}
    return {**base, "spec": {**base["spec"], "containers": [container, *rest]}}


def operator_template(spec: HiCacheDeploymentSpec, sizing: SizingRecord | None, owner: Owner, *,
                      process_backed: bool = False) -> dict[str, Any]:
    """The pod template as the operator renders it, before ``spec.podTemplate``."""
    http = {"port": "http"}
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": spec.image,
        "command": flags.command(spec.engine),
        **storage_owned(spec, sizing, owner),
        "ports": [{"name": "http", "containerPort": flags.RUNTIME_PORT, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {**http, "path": "/health"}, "periodSeconds": 5, "timeoutSeconds": 2,
                           "failureThreshold": 2},
        "startupProbe": {"httpGet": {**http, "path": "/health"}, "periodSeconds": model_source.STARTUP_PROBE_PERIOD,
                         "timeoutSeconds": 5, "failureThreshold": model_source.startup_failure_threshold(spec)},
        "livenessProbe": {"httpGet": {**http, "path": "/health"}, "periodSeconds": 15, "timeoutSeconds": 5,
                          "failureThreshold": 4},
        "securityContext": container_security(rdma=spec.rdma),
        # a runtime that cannot start (a bad checkpoint) ends its log with one line saying why;
        # the kubelet keeps that tail as lastState.terminated.message, and status shows it
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [
            {"name": "storage-config", "mountPath": OPERATOR_VOLUMES["storage-config"], "readOnly": True},
            {"name": "tmp", "mountPath": OPERATOR_VOLUMES["tmp"]},
            {"name": "dshm", "mountPath": OPERATOR_VOLUMES["dshm"]},
            *model_source.mounts(spec),
            *spec.extra_volume_mounts,
        ],
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    annotations = {}
    if process_backed:
        annotations[labels.PROCESS_BACKED] = "true"
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "securityContext": pod_security(fs_group=True),
        "terminationGracePeriodSeconds": spec.rollout.drain_timeout_seconds + 30,
        "affinity": _affinity(spec, owner.name),
        "containers": [container],
        "volumes": [
            {"name": "storage-config", "configMap": {"name": names(owner.name).configmap}},
            {"name": "tmp", "emptyDir": {}},
            # memory-backed: counted in the pod's memory (status.sizing shmBytes), so bounded
            {"name": "dshm", "emptyDir": {"medium": "Memory",
                                          "sizeLimit": f"{int(spec.hicache.host_pool.shm_gib * 1024)}Mi"}},
            *model_source.volumes(spec, owner.name),
            *spec.extra_volumes,
        ],
    }
    downloads = model_source.init_containers(spec, owner.name, pod_ip_env=field_env("POD_IP", "status.podIP"),
                                             security_context=container_security())
    if downloads:
        pod_spec["initContainers"] = downloads
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = list(spec.tolerations)
    if spec.env_from:
        container["envFrom"] = list(spec.env_from)
    if spec.host_network:
        pod_spec.update(hostNetwork=True, dnsPolicy="ClusterFirstWithHostNet")
    return {"metadata": {"labels": {**labels.selector_labels(owner.name), labels.DEPLOYMENT: owner.name,
                                    **gate.template_labels()},
                         "annotations": annotations},
            "spec": pod_spec}


def statefulset(spec: HiCacheDeploymentSpec, owner: Owner, template: dict[str, Any]) -> dict[str, Any]:
    n = names(owner.name)
    return stamp({
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": meta(owner, n.statefulset, "server"),
        "spec": {
            "replicas": spec.replicas,
            "serviceName": n.headless,
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "OnDelete"},
            "selector": {"matchLabels": labels.selector_labels(owner.name)},
            "template": template,
        },
    })
