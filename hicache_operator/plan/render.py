"""Pure builders of a HiCacheDeployment's children.

Everything here is a function of the effective spec, the sizing record and the owner, so the
same inputs always give byte-identical objects (and hashes). Children:

- StatefulSet ``<name>`` with ``updateStrategy: OnDelete``: a template change (e.g. the storage
  config after a live backend swap) never restarts a pod by itself. The operator deletes pods
  whose ``hicache.dev/restart-hash`` (everything but the storage config) is stale, within
  maxUnavailable; a pod that restarts for any reason comes up with the target config.
- Service ``<name>`` (clients): the pods in serving (label ``hicache.dev/serving=true``, Ready),
  or with the router on (``spec.router_on``) the router's pods; then headless Service
  ``<name>-serving`` selects the pods in serving. The Service selecting the pods in serving (the
  serving Service, component ``service``) is the one whose EndpointSlices swaps wait on.
- With the router on: Deployment ``<name>-router`` (sglang-router, discovering the pods in
  serving through the API server), its ServiceAccount, and a Role and RoleBinding that let it
  list and watch pods in the namespace, nothing else.
- Headless Service ``<name>-pods`` (stable pod DNS, not-ready addresses published),
  ConfigMap ``<name>-storage`` (extra config JSON), ConfigMap ``<name>-model`` (the download
  script, with modelSource.huggingFace; the extra config JSON carries the page namespace,
  ``effective_extra_config``), Secret ``<name>-admin`` (generated admin key;
  rendered only when it must be created), PodDisruptionBudget ``<name>``.
- With ``hicache.storage.mooncake.managed``: Deployment and Service ``<name>-mooncake`` running
  ``mooncake_master``; the pods' MOONCAKE_MASTER is that Service (or, with ``ha``, ``etcd://``).
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable

from hicache_operator.plan.engine import features as engine
from hicache_operator.api import flags, labels
from hicache_operator.plan.model import source as model_source
from hicache_operator.plan import overlay
from hicache_operator.fleet import gate
from hicache_operator.fleet.storage_config import StorageConfig, page_namespace as format_namespace, storage_fingerprint, with_page_namespace
from hicache_operator.api.status import SizingRecord
from hicache_operator.plan.sizing import memory_quantity
from hicache_operator.api.spec import GROUP, KIND, RUNTIME_CONTAINER, VERSION, HiCacheDeploymentSpec, ManagedMaster, resolve_max_unavailable

ADMIN_SECRET_KEY = "admin-api-key"
API_SECRET_KEY = "api-key"
CONTAINER = RUNTIME_CONTAINER
RUN_AS = 1000
# Volumes every pod gets (name -> mount path); extraVolumes and extraVolumeMounts must not clash.
SERVING_SERVICE_COMPONENT = "service"  # the serving Service's component label (the operator watches its slices)
CLIENT_ROUTER_COMPONENT = "client"  # the client Service's while it points at the router
ROUTER_CONTAINER = "router"
CLIENT_KEY_ENV = "HICACHE_CLIENT_API_KEY"  # router_gate.py reads the clients' key from it
ROUTER_METRICS_PORT = 29000
OPERATOR_VOLUMES = {"storage-config": flags.STORAGE_CONFIG_DIR, "tmp": "/tmp", "dshm": "/dev/shm"}
MASTER_CONTAINER = "master"
MASTER_COMPONENT = "mooncake-master"  # the master's app.kubernetes.io/name and component labels
MASTER_COMMAND = "mooncake_master"  # console script of the mooncake wheel (execs the bundled binary)


def security_context(spec: HiCacheDeploymentSpec | None = None) -> dict[str, Any]:
    """A container's: non-root with no capabilities (the model download's, and the engine's
    without RDMA). The engine's with ``spec.rdma``: IPC_LOCK (in effect for a root process; a
    non-root one relies on the memlock limit the node's container runtime sets), or with
    ``rdma.privileged`` privileged and root, which registers memory whatever that limit."""
    rdma = spec.rdma if spec is not None else None
    if rdma is not None and rdma.privileged:
        return {"privileged": True, "allowPrivilegeEscalation": True, "runAsNonRoot": False, "runAsUser": 0,
                "runAsGroup": 0, "capabilities": {"add": ["IPC_LOCK"]}}
    caps: dict[str, list[str]] = {"drop": ["ALL"]}
    if rdma is not None:
        caps["add"] = ["IPC_LOCK"]
    return {"allowPrivilegeEscalation": False, "capabilities": caps, "runAsNonRoot": True, "privileged": False}


def operator_volumes(spec: HiCacheDeploymentSpec) -> dict[str, str]:
    """Every volume the operator gives this spec's pods (name -> mount path)."""
    return {**OPERATOR_VOLUMES, **model_source.reserved_mounts(spec)}


@dataclass(frozen=True)
class Owner:
    name: str
    namespace: str
    uid: str

    def reference(self) -> dict[str, Any]:
        return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": self.name, "uid": self.uid,
                "controller": True, "blockOwnerDeletion": True}


def names(name: str) -> dict[str, str]:
    return {"statefulset": name, "service": name, "headless": f"{name}-pods", "configmap": f"{name}-storage",
            "secret": f"{name}-admin", "apiSecret": f"{name}-api", "internalSecret": f"{name}-internal",
            "pdb": name, "router": f"{name}-router",
            "serving": f"{name}-serving", "mooncakeMaster": f"{name}-mooncake"}


def serving_service_name(name: str, router_on: bool) -> str:
    """The Service that selects the pods in serving: the client Service itself, or ``<name>-serving``
    while the client Service points at the router."""
    return names(name)["serving" if router_on else "service"]



def managed_master(spec: HiCacheDeploymentSpec) -> ManagedMaster | None:
    mooncake = spec.hicache.storage.mooncake
    return mooncake.managed if mooncake is not None else None


def mooncake_master_address(managed: ManagedMaster, name: str, namespace: str) -> str:
    """What the pods' MOONCAKE_MASTER names: the master's Service, or with HA the etcd cluster
    through which clients find the elected leader."""
    if managed.ha is not None:
        return "etcd://" + ";".join(managed.ha.etcd_endpoints)
    return f"{names(name)['mooncakeMaster']}.{namespace}.svc:{managed.rpc_port}"


def mooncake_metadata_url(managed: ManagedMaster, name: str, namespace: str) -> str:
    assert managed.http_metadata_server is not None
    return f"http://{names(name)['mooncakeMaster']}.{namespace}.svc:{managed.http_metadata_server.port}/metadata"


def mooncake_cluster_id(owner: "Owner") -> str:
    """The HA masters' election scope in etcd (--cluster_id; clients: MC_STORE_CLUSTER_ID), one per fleet."""
    return f"{owner.namespace}.{owner.name}"


def master_labels(name: str) -> dict[str, str]:
    return {labels.NAME: MASTER_COMPONENT, labels.INSTANCE: name, labels.MANAGED_BY: labels.MANAGER}


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def _extra_arg(spec: HiCacheDeploymentSpec, flag: str) -> str | None:
    """The value ``spec.extraArgs`` gives ``flag`` (``--flag v`` or ``--flag=v``; the last one wins)."""
    value = None
    extra = list(spec.extra_args)
    for i, arg in enumerate(extra):
        if arg == flag and i + 1 < len(extra):
            value = extra[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
    return value


def kv_dtype(spec: HiCacheDeploymentSpec) -> str:
    """The KV dtype as the command states it: ``--kv-cache-dtype``, else ``--dtype``, else ``auto``
    (the checkpoint's, which the model name already pins)."""
    kv = _extra_arg(spec, "--kv-cache-dtype")
    if kv and kv != "auto":
        return kv
    return _extra_arg(spec, "--dtype") or "auto"


def page_namespace(spec: HiCacheDeploymentSpec) -> str:
    """The L3 namespace of this fleet's page format (``storage_config.page_namespace``)."""
    par = spec.parallelism
    return format_namespace(spec.hicache.mem_layout, kv_dtype(spec), spec.page_size, par.tp, par.pp,
                            par.dp if spec.engine == "sglang" else 1)


def effective_extra_config(spec: HiCacheDeploymentSpec) -> dict[str, Any]:
    """``hicache.storage.extraConfig`` as both engines get it: with the page namespace applied, so pods
    of another layout, dtype, page size or split never read these pages."""
    st = spec.hicache.storage
    return with_page_namespace(st.backend, st.extra_config, page_namespace(spec))


def storage_config(spec: HiCacheDeploymentSpec) -> StorageConfig:
    """The live-swappable part of the config: what an attach carries and a swap converges to."""
    st = spec.hicache.storage
    return StorageConfig(backend=st.backend, prefetch_policy=st.prefetch_policy,
                         extra_config=effective_extra_config(spec), write_policy=spec.hicache.write_policy)


def storage_hash(spec: HiCacheDeploymentSpec) -> str:
    """The pods' storage annotation and the swap's target: ``storage_fingerprint`` of the config."""
    return storage_fingerprint(storage_config(spec))


def host_pool_flag(spec: HiCacheDeploymentSpec, sizing: SizingRecord | None) -> tuple[str, Any]:
    pool = spec.hicache.host_pool
    if pool.from_node_memory is not None:
        if sizing is None or not sizing.hicache_size_gb:
            raise ValueError("hostPool.fromNodeMemory needs a sizing record (nodes were not known)")
        return "sizeGBPerRank", sizing.hicache_size_gb
    if pool.size_gb_per_rank is not None:
        return "sizeGBPerRank", pool.size_gb_per_rank
    return "ratio", pool.ratio


def host_pool_text(spec: HiCacheDeploymentSpec, sizing: SizingRecord | None) -> str:
    mode, value = host_pool_flag(spec, sizing)
    if mode == "ratio":
        return f"ratio {value}"
    suffix = " (node)" if spec.hicache.host_pool.from_node_memory is not None else ""
    return f"{value}GB/rank{suffix}"


def uses_api_key(spec: HiCacheDeploymentSpec) -> bool:
    """SGLang serves /server_info (resolved args, admin key included) to anyone unless --api-key is
    set, so its pods always get one; the bundled runtime redacts keys and takes one when given."""
    return spec.engine == "sglang" or spec.api_key_secret_ref is not None


def secret_ref(spec: HiCacheDeploymentSpec, owner_name: str, which: str) -> tuple[str, str]:
    """(Secret name, data key) of the admin key (``which`` "admin"), the clients' key ("api") or the
    fleet's internal key ("internal", always generated)."""
    if which == "internal":
        return names(owner_name)["internalSecret"], API_SECRET_KEY
    ref = spec.admin_key_secret_ref if which == "admin" else spec.api_key_secret_ref
    if ref is not None:
        return ref.name, ref.key
    return (names(owner_name)["secret"], ADMIN_SECRET_KEY) if which == "admin" else \
        (names(owner_name)["apiSecret"], API_SECRET_KEY)


def pods_key(spec: HiCacheDeploymentSpec) -> str:
    """Which key the pods take as --api-key. Behind the router, the fleet's internal key, which only
    the router and the operator hold: SGLang gives its admin key (in /server_info) to any holder of
    its api key, so clients never get the pods' key. Without the router, clients reach the pods
    directly, with the pods' key: the clients' own (a warning says what that exposes)."""
    return "internal" if spec.router_on else "api"


def args(spec: HiCacheDeploymentSpec, sizing: SizingRecord | None, *, include_storage: bool = True) -> list[str]:
    """The engine's arguments: the operator's, then ``spec.extraArgs`` as written (``$(VAR)`` expands)."""
    dumped = spec.dump()
    dumped["hicache"]["storage"]["extraConfig"] = effective_extra_config(spec)
    return flags.render_args(dumped, spec.engine, host_pool=host_pool_flag(spec, sizing),
                             include_storage=include_storage, api_key=uses_api_key(spec),
                             legacy_dp_attention=engine.lacks(spec, "attn_dp_size_flag"),
                             model_path=model_source.model_path(spec),
                             served_name=model_source.served_name(spec)) + list(spec.extra_args)


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def mooncake_env(spec: HiCacheDeploymentSpec, owner: Owner) -> list[dict[str, Any]]:
    """MOONCAKE_* settings as env; from the effective extra config when mooncake is the backend."""
    st = spec.hicache.storage
    if st.backend != "mooncake" and st.mooncake is None:
        return []
    settings = st.mooncake.model_dump(by_alias=True) if st.mooncake else {}
    env = []
    for fld, key, var in flags.MOONCAKE_SETTINGS:
        value = st.extra_config.get(key) if st.backend == "mooncake" else settings.get(fld)
        if value is None and fld in ("protocol", "metadataServer"):
            value = {"protocol": "tcp", "metadataServer": "P2PHANDSHAKE"}[fld]
        if var and value is not None:
            env.append({"name": var, "value": str(value)})
    managed = managed_master(spec)
    if managed is not None and managed.ha is not None:
        env.append({"name": "MC_STORE_CLUSTER_ID", "value": mooncake_cluster_id(owner)})
    return env


def operator_env(spec: HiCacheDeploymentSpec, owner: Owner, include_storage: bool = True) -> list[dict[str, Any]]:
    """The env vars the operator sets (``spec.env`` comes after them and may not repeat a name)."""
    secret_name, secret_key = secret_ref(spec, owner.name, "admin")
    env = [
        _field_env("POD_IP", "status.podIP"),
        _field_env("POD_NAME", "metadata.name"),
        # Each pod's own address: never a hostname shared through a config (sglang#23457).
        _field_env("MOONCAKE_LOCAL_HOSTNAME", "status.hostIP" if spec.host_network else "status.podIP"),
        {"name": flags.ADMIN_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": secret_name, "key": secret_key}}},
        {"name": "HOME", "value": "/tmp"},
        *model_source.engine_env(spec),
    ]
    if engine.version(spec):
        # the release the flags were rendered for (the local test cluster's SGLang stand-in checks them with it)
        env.append({"name": "HICACHE_ENGINE_VERSION", "value": engine.version(spec)})
    if uses_api_key(spec):
        env.append(_secret_env(flags.API_KEY_ENV, *secret_ref(spec, owner.name, pods_key(spec))))
    if include_storage:
        env += mooncake_env(spec, owner)
    return env


def _env(spec: HiCacheDeploymentSpec, owner: Owner, include_storage: bool) -> list[dict[str, Any]]:
    return operator_env(spec, owner, include_storage) + [e.model_dump(by_alias=True, exclude_none=True)
                                                         for e in spec.env]


def resources(spec: HiCacheDeploymentSpec, sizing: SizingRecord | None, *,
              include_storage: bool = True) -> dict[str, Any]:
    """Requests and limits; without ``include_storage`` (the restart hash) the Mooncake segment is
    left out of the memory, so a live swap to or from Mooncake restarts no pod. A pod running
    through such a swap keeps its limit until it restarts; the segment then comes out of its
    margin (SGLang's: r - 1 pools and the 10 GiB reserve)."""
    gpus = str(spec.ranks_per_pod)
    requests = {k: str(v) for k, v in spec.resources.requests.items()}
    limits = {k: str(v) for k, v in spec.resources.limits.items()}
    memory = sizing.pod_memory if sizing is not None else None
    if memory and not include_storage and sizing.storage_bytes and sizing.pod_memory_bytes:
        memory = memory_quantity(sizing.pod_memory_bytes - sizing.storage_bytes)
    if memory:
        requests.setdefault("memory", memory)
        # A user's larger request raises the limit with it (a request above its limit is refused).
        limits.setdefault("memory", requests["memory"])
    requests["nvidia.com/gpu"] = gpus
    limits["nvidia.com/gpu"] = gpus
    if spec.rdma is not None:  # an extended resource: request = limit
        requests[spec.rdma.resource] = limits[spec.rdma.resource] = str(spec.rdma.count)
    return {"requests": requests, "limits": limits}


HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"


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
            "env": _env(spec, owner, include_storage),
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
        "securityContext": security_context(spec),
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
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "terminationGracePeriodSeconds": spec.rollout.drain_timeout_seconds + 30,
        "affinity": _affinity(spec, owner.name),
        "containers": [container],
        "volumes": [
            {"name": "storage-config", "configMap": {"name": names(owner.name)["configmap"]}},
            {"name": "tmp", "emptyDir": {}},
            # memory-backed: counted in the pod's memory (status.sizing shmBytes), so bounded
            {"name": "dshm", "emptyDir": {"medium": "Memory",
                                          "sizeLimit": f"{int(spec.hicache.host_pool.shm_gib * 1024)}Mi"}},
            *model_source.volumes(spec, owner.name),
            *spec.extra_volumes,
        ],
    }
    downloads = model_source.init_containers(spec, owner.name, pod_ip_env=_field_env("POD_IP", "status.podIP"),
                                             security_context=security_context())
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


def _meta(owner: Owner, name: str, component: str) -> dict[str, Any]:
    return {"name": name, "namespace": owner.namespace,
            "labels": {**labels.selector_labels(owner.name), labels.DEPLOYMENT: owner.name,
                       labels.COMPONENT: component},
            "ownerReferences": [owner.reference()]}


def _stamp(obj: dict[str, Any]) -> dict[str, Any]:
    obj["metadata"].setdefault("annotations", {})[labels.RENDERED_HASH] = digest(obj)
    return obj


def statefulset(spec: HiCacheDeploymentSpec, owner: Owner, template: dict[str, Any]) -> dict[str, Any]:
    n = names(owner.name)
    return _stamp({
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": _meta(owner, n["statefulset"], "server"),
        "spec": {
            "replicas": spec.replicas,
            "serviceName": n["headless"],
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "OnDelete"},
            "selector": {"matchLabels": labels.selector_labels(owner.name)},
            "template": template,
        },
    })


def _http_port() -> list[dict[str, Any]]:
    return [{"name": "http", "port": flags.RUNTIME_PORT, "targetPort": "http", "protocol": "TCP"}]


def service(owner: Owner, router_on: bool = False) -> dict[str, Any]:
    """The client Service: the pods in serving, or the router's pods (same name, same port)."""
    if router_on:
        return _stamp({
            "apiVersion": "v1", "kind": "Service",
            "metadata": _meta(owner, names(owner.name)["service"], CLIENT_ROUTER_COMPONENT),
            "spec": {"type": "ClusterIP", "selector": labels.router_selector_labels(owner.name),
                     "ports": _http_port()},
        })
    return _stamp({
        "apiVersion": "v1", "kind": "Service",
        "metadata": _meta(owner, names(owner.name)["service"], SERVING_SERVICE_COMPONENT),
        "spec": {"type": "ClusterIP", "selector": {**labels.selector_labels(owner.name), **gate.selector()},
                 "ports": _http_port()},
    })


def serving_service(owner: Owner) -> dict[str, Any]:
    """With the router on, the pods in serving (headless: the router reaches pods by their IPs; this
    Service's EndpointSlices are what swaps wait on, and its DNS name reaches the pods directly)."""
    return _stamp({
        "apiVersion": "v1", "kind": "Service",
        "metadata": _meta(owner, names(owner.name)["serving"], SERVING_SERVICE_COMPONENT),
        "spec": {"clusterIP": "None", "selector": {**labels.selector_labels(owner.name), **gate.selector()},
                 "ports": _http_port()},
    })


def _secret_env(name: str, secret: str, key: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def router_args(spec: HiCacheDeploymentSpec, owner: Owner) -> list[str]:
    """sglang-router's command line: Kubernetes discovery of the pods in serving (the client
    Service's selector) in the fleet's namespace, at their runtime port; its own port is
    ``ROUTER_API_PORT``, behind the client gate."""
    selector = {**labels.selector_labels(owner.name), **gate.selector()}
    args = ["--host", "$(POD_IP)", "--port", str(flags.ROUTER_API_PORT), "--policy", spec.router.policy,
            "--service-discovery", "--selector", *(f"{k}={v}" for k, v in selector.items()),
            "--service-discovery-port", str(flags.RUNTIME_PORT), "--service-discovery-namespace", owner.namespace,
            "--prometheus-host", "$(POD_IP)", "--prometheus-port", str(ROUTER_METRICS_PORT),
            "--shutdown-grace-period-secs", str(spec.rollout.drain_timeout_seconds)]
    if uses_api_key(spec):  # the pods' key: the router gives it to the pods it discovers, and wants it
        args += ["--api-key", f"$({flags.API_KEY_ENV})"]
    return args


def gate_args() -> list[str]:
    """The client gate (hicache_operator/router_gate.py): the clients' port, in front of the router's."""
    return ["--host", "$(POD_IP)", "--port", str(flags.RUNTIME_PORT),
            "--upstream", f"http://$(POD_IP):{flags.ROUTER_API_PORT}"]


def router_pod_labels(owner: Owner) -> dict[str, str]:
    return {**labels.router_selector_labels(owner.name), labels.COMPONENT: "router", labels.ROUTER: owner.name}


def router_deployment(spec: HiCacheDeploymentSpec, owner: Owner, *, process_backed: bool = False) -> dict[str, Any]:
    n = names(owner.name)
    env = [_field_env("POD_IP", "status.podIP")]
    if uses_api_key(spec):
        env += [_secret_env(flags.API_KEY_ENV, *secret_ref(spec, owner.name, "internal")),
                _secret_env(CLIENT_KEY_ENV, *secret_ref(spec, owner.name, "api"))]
    # the client gate (router_gate.py) runs the router as its child: clients reach the gate's port,
    # inference paths only, with their own key; the router's port is the operator's
    container = {
        "name": ROUTER_CONTAINER,
        "image": spec.router.image,
        "command": ["python", "-m", "hicache_operator.router_gate"],
        "args": [*gate_args(), "--shutdown-grace-period-secs", str(spec.rollout.drain_timeout_seconds), "--",
                 "python", "-m", "sglang_router.launch_router", *router_args(spec, owner)],
        "ports": [{"name": "http", "containerPort": flags.RUNTIME_PORT, "protocol": "TCP"},
                  {"name": "router", "containerPort": flags.ROUTER_API_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": ROUTER_METRICS_PORT, "protocol": "TCP"}],
        "env": env,
        "resources": {"requests": {k: str(v) for k, v in spec.router.resources.requests.items()},
                      "limits": {k: str(v) for k, v in spec.router.resources.limits.items()}},
        # ready once it routes to at least one healthy pod (asked through the gate)
        "readinessProbe": {"httpGet": {"port": "http", "path": "/readiness"}, "periodSeconds": 5,
                           "timeoutSeconds": 2, "failureThreshold": 2},
        "livenessProbe": {"httpGet": {"port": "router", "path": "/liveness"}, "periodSeconds": 15,
                          "timeoutSeconds": 5, "failureThreshold": 4},
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                            "runAsNonRoot": True, "privileged": False, "readOnlyRootFilesystem": True},
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    template = {
        "metadata": {"labels": router_pod_labels(owner),
                     "annotations": {labels.PROCESS_BACKED: "true"} if process_backed else {}},
        "spec": {
            "serviceAccountName": n["router"],
            "automountServiceAccountToken": True,  # its discovery lists and watches pods
            "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "terminationGracePeriodSeconds": spec.rollout.drain_timeout_seconds + 30,
            "containers": [container],
        },
    }
    return _stamp({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _meta(owner, n["router"], "router"),
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": labels.router_selector_labels(owner.name)},
            # a new router pod serves before an old one leaves
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "revisionHistoryLimit": 3,
            "template": template,
        },
    })


ROUTER_RBAC_RULES = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]


def router_rbac(owner: Owner) -> list[dict[str, Any]]:
    """The router's ServiceAccount, and a Role (pods: list, watch, in this namespace) bound to it."""
    name = names(owner.name)["router"]
    return [
        _stamp({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(owner, name, "router")}),
        _stamp({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(owner, name, "router"),
                "rules": ROUTER_RBAC_RULES}),
        _stamp({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                "metadata": _meta(owner, name, "router"),
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
                "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}]}),
    ]


def router_children(owner: Owner) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of what only a fleet with the router has: removed when it is turned off."""
    n = names(owner.name)
    return [("apps/v1", "Deployment", n["router"]), ("v1", "Service", n["serving"]),
            ("rbac.authorization.k8s.io/v1", "RoleBinding", n["router"]),
            ("rbac.authorization.k8s.io/v1", "Role", n["router"]), ("v1", "ServiceAccount", n["router"])]


def headless_service(owner: Owner) -> dict[str, Any]:
    return _stamp({
        "apiVersion": "v1", "kind": "Service",
        "metadata": _meta(owner, names(owner.name)["headless"], "pods"),
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": labels.selector_labels(owner.name),
                 "ports": [{"name": "http", "port": flags.RUNTIME_PORT, "targetPort": "http", "protocol": "TCP"}]},
    })


def configmap(spec: HiCacheDeploymentSpec, owner: Owner) -> dict[str, Any]:
    body = json.dumps(effective_extra_config(spec), sort_keys=True, indent=2)
    return _stamp({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": _meta(owner, names(owner.name)["configmap"], "storage-config"),
        "data": {flags.STORAGE_CONFIG_FILE: body},
    })


def model_configmap(spec: HiCacheDeploymentSpec, owner: Owner) -> dict[str, Any] | None:
    """ConfigMap <name>-model (the download script), with modelSource.huggingFace only."""
    if spec.model_source is None or spec.model_source.hugging_face is None:
        return None
    return _stamp({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": _meta(owner, model_source.configmap_name(owner.name), "model-download"),
        "data": model_source.configmap_data(),
    })


def generated_secrets(spec: HiCacheDeploymentSpec, owner: Owner, new_key: Callable[[], str]) -> list[dict[str, Any]]:
    """The key Secrets the operator creates (once, never applied) because the spec names none."""
    out = []
    if spec.admin_key_secret_ref is None:
        out.append(_secret(owner, names(owner.name)["secret"], "admin-key", ADMIN_SECRET_KEY, new_key()))
    if uses_api_key(spec) and spec.api_key_secret_ref is None:
        out.append(_secret(owner, names(owner.name)["apiSecret"], "api-key", API_SECRET_KEY, new_key()))
    if uses_api_key(spec) and spec.router_on:
        out.append(_secret(owner, names(owner.name)["internalSecret"], "internal-key", API_SECRET_KEY, new_key()))
    return out


def _secret(owner: Owner, name: str, component: str, field: str, key: str) -> dict[str, Any]:
    return _stamp({
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": _meta(owner, name, component),
        "data": {field: base64.b64encode(key.encode()).decode()},
    })


def pdb(spec: HiCacheDeploymentSpec, owner: Owner) -> dict[str, Any]:
    return _stamp({
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": _meta(owner, names(owner.name)["pdb"], "disruption-budget"),
        # Over the pods in serving, with the budget restarts and swaps use (a count: a PDB would
        # round a percentage up, they round down): a pod taken out of serving is not selected,
        # so it counts against the budget, and evictions wait while a swap uses it up.
        "spec": {"minAvailable": max(0, spec.replicas - resolve_max_unavailable(spec.rollout.max_unavailable,
                                                                                 spec.replicas)),
                 "selector": {"matchLabels": {**labels.selector_labels(owner.name), **gate.selector()}}},
    })


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
        "env": [_field_env("POD_IP", "status.podIP")],
        "ports": [{"name": n, "containerPort": port, "protocol": "TCP"} for n, port in master_ports(managed)],
        "resources": {"requests": {k: str(v) for k, v in managed.resources.requests.items()},
                      "limits": {k: str(v) for k, v in managed.resources.limits.items()}},
        "readinessProbe": {**health, "periodSeconds": 5, "timeoutSeconds": 2, "failureThreshold": 2},
        "livenessProbe": {**health, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6},
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                            "runAsNonRoot": True, "privileged": False, "readOnlyRootFilesystem": True},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {}}],
    }
    if managed.node_selector:
        pod_spec["nodeSelector"] = dict(managed.node_selector)
    if managed.tolerations:
        pod_spec["tolerations"] = list(managed.tolerations)
    strategy = {"type": "Recreate"} if managed.ha is None else \
        {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}}
    return _stamp({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _master_meta(owner, names(owner.name)["mooncakeMaster"]),
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
    return _stamp({
        "apiVersion": "v1", "kind": "Service",
        "metadata": _master_meta(owner, names(owner.name)["mooncakeMaster"]),
        "spec": {"type": "ClusterIP", "selector": master_labels(owner.name),
                 "ports": [{"name": n, "port": port, "targetPort": n, "protocol": "TCP"} for n, port in ports]},
    })


@dataclass(frozen=True)
class Rendered:
    """One render of a fleet: the operator's pod template built once, and everything read from it.

    When spec.podTemplate cannot be merged (an item of a keyed list without its key), ``template``
    and ``restart_hash`` are None and ``children`` is empty: ``validation.check_rendered`` reports
    that overlay as a conflict, so such a render is never applied."""

    base_template: dict[str, Any]  # the operator's pod template, before spec.podTemplate
    template: dict[str, Any] | None  # after spec.podTemplate, with the restart and storage annotations
    restart_hash: str | None  # of the template without its storage-owned fields: a live swap restarts no pod
    storage_hash: str
    args: list[str]
    command: list[str]  # the runtime container's
    children: list[dict[str, Any]]  # the applied children, in apply order, the StatefulSet last


def render(spec: HiCacheDeploymentSpec, sizing: SizingRecord | None, owner: Owner, *,
           process_backed: bool = False) -> Rendered:
    """Build the operator's pod template once, merge ``spec.podTemplate`` onto it, and render every
    applied child around it. Raises ValueError when the pod cannot be rendered (fromNodeMemory
    without a sizing record)."""
    base = operator_template(spec, sizing, owner, process_backed=process_backed)
    patch = spec.pod_template.dump()
    storage = storage_hash(spec)
    runtime = base["spec"]["containers"][0]
    try:
        restart = digest(overlay.merge(without_storage(base, spec, sizing, owner), patch))
        template = overlay.merge(base, patch)
    except overlay.OverlayError:
        return Rendered(base_template=base, template=None, restart_hash=None, storage_hash=storage,
                        args=list(runtime["args"]), command=list(runtime["command"]), children=[])
    template["metadata"]["annotations"].update({
        labels.RESTART_HASH: restart,
        labels.STORAGE_HASH: storage,
        labels.STORAGE_BACKEND: spec.hicache.storage.backend,
    })
    return Rendered(base_template=base, template=template, restart_hash=restart, storage_hash=storage,
                    args=list(runtime["args"]), command=template["spec"]["containers"][0]["command"],
                    children=_children(spec, owner, statefulset(spec, owner, template), process_backed=process_backed))


def _children(spec: HiCacheDeploymentSpec, owner: Owner, sts: dict[str, Any], *,
             process_backed: bool = False) -> list[dict[str, Any]]:
    """The applied children around the StatefulSet ``sts``, in apply order (the StatefulSet last,
    after what its pods mount).

    The key Secrets are not among them: ``generated_secrets`` renders them, and they are created,
    never applied, so an existing key cannot be rotated by a re-render. With the router on, its
    ServiceAccount, Role and RoleBinding come right after the ConfigMaps (its pods need them at start)."""
    managed = managed_master(spec)
    master = [] if managed is None else [
        mooncake_master_service(managed, owner),
        mooncake_master_deployment(spec, managed, owner, process_backed=process_backed)]
    model = model_configmap(spec, owner)
    configmaps = [configmap(spec, owner), *([model] if model else [])]
    if not spec.router_on:
        return [*configmaps, headless_service(owner), service(owner), pdb(spec, owner), *master, sts]
    return [*configmaps, *router_rbac(owner), headless_service(owner), serving_service(owner),
            service(owner, router_on=True), pdb(spec, owner), *master,
            router_deployment(spec, owner, process_backed=process_backed), sts]
