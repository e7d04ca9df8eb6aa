"""A managed Mooncake master (``hicache.storage.mooncake.managed``): its Deployment and Service, and
how the pods find it."""

from __future__ import annotations

from typing import Any

from hicache_operator.api import labels
from hicache_operator.api.spec import HiCacheDeploymentSpec
from hicache_operator.api.spec_hicache import ManagedMaster
from hicache_operator.fleet.names import names
from hicache_operator.plan.render.common import Owner, container_security, field_env, pod_security, resources_of, stamp

MASTER_CONTAINER = "master"
MASTER_COMPONENT = "mooncake-master"  # the master's app.kubernetes.io/name and component labels
MASTER_COMMAND = "mooncake_master"  # console script of the mooncake wheel (execs the bundled binary)


def managed_master(spec: HiCacheDeploymentSpec) -> ManagedMaster | None:
    mooncake = spec.hicache.storage.mooncake
    return mooncake.managed if mooncake is not None else None


def mooncake_master_address(managed: ManagedMaster, name: str, namespace: str) -> str:
    """What the pods' MOONCAKE_MASTER names: the master's Service, or with HA the etcd cluster
    through which clients find the elected leader."""
    if managed.ha is not None:
        return "etcd://" + ";".join(managed.ha.etcd_endpoints)
    return f"{names(name).mooncake_master}.{namespace}.svc:{managed.rpc_port}"


def mooncake_metadata_url(managed: ManagedMaster, name: str, namespace: str) -> str:
    assert managed.http_metadata_server is not None
    return f"http://{names(name).mooncake_master}.{namespace}.svc:{managed.http_metadata_server.port}/metadata"


def mooncake_cluster_id(owner: Owner) -> str:
    """The HA masters' election scope in etcd (--cluster_id; clients: MC_STORE_CLUSTER_ID), one per fleet."""
    return f"{owner.namespace}.{owner.name}"


def master_labels(name: str) -> dict[str, str]:
    return {labels.NAME: MASTER_COMPONENT, labels.INSTANCE: name, labels.MANAGED_BY: labels.MANAGER}


def _master_meta(owner: Owner, name: str) -> dict[str, Any]:
    return {"name": name, "namespace": owner.namespace,
            "labels": {**master_labels(owner.name), labels.DEPLOYMENT: owner.name, labels.COMPONENT: MASTER_COMPONENT},
            "ownerReferences": [owner.reference()]}


def master_args(managed: ManagedMaster, owner: Owner) -> list[str]:
    """mooncake_master's flags: every port explicit (its HTTP servers otherwise take 8080 and 9003),
    bound to the pod's address (with HA the address it advertises in etcd), log to stderr."""
    args = ["--rpc_address=$(POD_IP)", f"--rpc_port={managed.rpc_port}",
            "--metrics_host=$(POD_IP)", f"--metrics_port={managed.metrics_port}",
            f"--default_kv_lease_ttl={managed.kv_lease_ttl_ms}", f"--client_ttl={managed.client_ttl_seconds}",
            f"--eviction_high_watermark_ratio={managed.eviction_high_watermark_ratio}",
            f"--eviction_ratio={managed.eviction_ratio}"]
    http = managed.http_metadata_server
    args += ["--enable_http_metadata_server=true", f"--http_metadata_server_port={http.port}"] if http else \
        ["--enable_http_metadata_server=false"]
    if managed.ha is not None:
        args += ["--enable_ha=true", f"--etcd_endpoints={';'.join(managed.ha.etcd_endpoints)}",
                 f"--cluster_id={mooncake_cluster_id(owner)}"]
    return args + ["--logtostderr=true"]


def master_ports(managed: ManagedMaster) -> list[tuple[str, int]]:
    """(name, port) the master listens on; a standby of an HA pair serves no RPC."""
    ports = [("rpc", managed.rpc_port), ("metrics", managed.metrics_port)]
    if managed.http_metadata_server is not None:
        ports.append(("http-metadata", managed.http_metadata_server.port))
    return ports


def mooncake_master_deployment(spec: HiCacheDeploymentSpec, managed: ManagedMaster, owner: Owner, *,
                               process_backed: bool) -> dict[str, Any]:
    """The master's Deployment: one replica (Recreate: two masters behind one Service would split
    the store), or with HA a leader and standbys rolled one at a time."""
    health = {"httpGet": {"path": "/health", "port": "metrics"}}
    container: dict[str, Any] = {
        "name": MASTER_CONTAINER,
        "image": managed.image or spec.image,
        "command": [MASTER_COMMAND],
        "args": master_args(managed, owner),
        "env": [field_env("POD_IP", "status.podIP")],
        "ports": [{"name": n, "containerPort": port, "protocol": "TCP"} for n, port in master_ports(managed)],
        "resources": resources_of(managed.resources),
        "readinessProbe": {**health, "periodSeconds": 5, "timeoutSeconds": 2, "failureThreshold": 2},
        "livenessProbe": {**health, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6},
        "securityContext": container_security(read_only_root=True),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "securityContext": pod_security(),
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {}}],
    }
    if managed.node_selector:
        pod_spec["nodeSelector"] = dict(managed.node_selector)
    if managed.tolerations:
        pod_spec["tolerations"] = list(managed.tolerations)
    strategy = {"type": "Recreate"} if managed.ha is None else \
        {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}}
    return stamp({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _master_meta(owner, names(owner.name).mooncake_master),
        "spec": {
            "replicas": managed.ha.replicas if managed.ha is not None else 1,
            "strategy": strategy,
            "selector": {"matchLabels": master_labels(owner.name)},
            "template": {"metadata": {"labels": {**master_labels(owner.name), labels.COMPONENT: MASTER_COMPONENT},
                                      "annotations": {labels.PROCESS_BACKED: "true"} if process_backed else {}},
                         "spec": pod_spec},
        },
    })


def mooncake_master_service(managed: ManagedMaster, owner: Owner) -> dict[str, Any]:
    """The master's Service: RPC for the pods (not with HA: clients find the leader through etcd),
    metrics, and the HTTP metadata server when it runs."""
    ports = [(n, port) for n, port in master_ports(managed) if n != "rpc" or managed.ha is None]
    return stamp({
        "apiVersion": "v1", "kind": "Service",
        "metadata": _master_meta(owner, names(owner.name).mooncake_master),
        "spec": {"type": "ClusterIP", "selector": master_labels(owner.name),
                 "ports": [{"name": n, "port": port, "targetPort": n, "protocol": "TCP"} for n, port in ports]},
    })
