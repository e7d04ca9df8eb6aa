"""Pydantic model of HiCacheDeployment.spec; the CRD schema is generated from it (crdgen).

Types, enums, ranges and defaults live here (enums and defaults come from the flag table);
rules that relate several fields live in ``rules``/``validation`` so each has a name and a
message. CEL rules are attached to the schema nodes through ``json_schema_extra``.
"""

import math
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from hicache_operator.api import flags
from hicache_operator.api.rules import cel_rules

GROUP = "hicache.dev"
VERSION = "v1alpha1"
KIND = "HiCacheDeployment"
PLURAL = "hicachedeployments"
SINGULAR = "hicachedeployment"
SHORT_NAME = "hcd"

# Kubernetes quantities and int-or-percent values arrive as YAML ints or strings.
IntOrString = int | str
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
INT32_MAX = 2**31 - 1  # StatefulSet replicas and probe counts are int32
MAX_RANKS = 1024
RUNTIME_CONTAINER = "runtime"  # the operator's container in every pod


def _enum(key: str) -> Any:
    return Literal[flags.flag(key).choices]  # type: ignore[valid-type]


def _from_flag(key: str, **kw: Any) -> Any:
    f = flags.flag(key)
    return Field(f.default, description=f"{f.help} ({f.cli})", **kw)


def _cel(scope: str) -> dict[str, Any]:
    return {"x-kubernetes-validations": cel_rules(scope)}


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class Parallelism(_Model):
    """How each pod's engine splits the model over its GPUs: tp x pp ranks (one GPU each) per pod."""

    model_config = ConfigDict(json_schema_extra=_cel("parallelism"))
    # tp x pp GPUs go into the pod's resources as one integer quantity: keep it a sane integer.
    tp: int = _from_flag("parallelism.tp", ge=1, le=MAX_RANKS)
    dp: int = _from_flag("parallelism.dp", ge=1, le=MAX_RANKS)
    pp: int = _from_flag("parallelism.pp", ge=1, le=MAX_RANKS)


class FromNodeMemory(_Model):
    """Size each rank's host pool from the memory of the smallest eligible node (status.sizing)."""

    fraction: float = Field(0.8, gt=0, le=1, description="Share of the node's allocatable memory the pod's memory limit may take "
                                                          "(host pools and every other term of status.sizing).")
    reserve_gib: float = Field(16.0, ge=0, alias="reserveGiB",
                               description="GiB of that share kept back for the OS and daemons.")


class HostPool(_Model):
    """Host (L2) pool per rank: exactly one of ratio, sizeGBPerRank, fromNodeMemory; and the other
    terms of the pod's memory."""

    model_config = ConfigDict(json_schema_extra=_cel("hostPool"))
    # The bound keeps ratio x maxTotalTokens finite for sizing; no host has 1000x its GPU memory.
    ratio: float | None = Field(None, le=1000, description=flags.flag("hicache.hostPool.ratio").help)
    size_gb_per_rank: int | None = Field(None, ge=1, alias="sizeGBPerRank",
                                         description=flags.flag("hicache.hostPool.sizeGBPerRank").help)
    from_node_memory: FromNodeMemory | None = Field(
        None, description="Size each rank's pool from the smallest eligible node's allocatable memory.")
    overhead_gib: float = Field(8.0, ge=0, alias="overheadGiB",
                                description="Pod memory for the serving processes themselves (Python, CUDA contexts, "
                                            "buffers), beside the host pools, the Mooncake segment, /dev/shm and "
                                            "the engine's own host-memory reserve.")
    shm_gib: float = Field(2.0, gt=0, alias="shmGiB",
                           description="Size of the pod's memory-backed /dev/shm (NCCL, IPC); counted in the pod's memory.")


class Resources(_Model):
    """A container's requests and limits: Kubernetes quantities by resource name (cpu, memory, ...)."""

    requests: dict[str, IntOrString] = Field(default_factory=dict, description=(
        "What the container is guaranteed; the scheduler places the pod where it fits."))
    limits: dict[str, IntOrString] = Field(default_factory=dict, description="The most the container may use.")


HOST_PORT = r"^[^\s:;/]+:[0-9]{1,5}$"
PORT = {"ge": 1, "le": 65535}


class HttpMetadataServer(_Model):
    """The managed master's HTTP metadata server (the transfer engine's metadata, instead of P2PHANDSHAKE)."""

    port: int = Field(8080, **PORT, description="Port of the master's HTTP metadata server (it listens on every "
                                                "address of the pod).")


class MasterHA(_Model):
    """Several managed masters, the leader elected through an existing etcd cluster."""

    etcd_endpoints: list[Annotated[str, Field(pattern=HOST_PORT, max_length=253)]] = Field(
        min_length=1, max_length=16, description=(
            "host:port of each member of an existing etcd cluster the masters elect their leader through; "
            "clients find the leader there too (MOONCAKE_MASTER etcd://...)."))
    replicas: int = Field(2, ge=2, le=7, description="Masters: one leader and standbys.")


class ManagedMaster(_Model):
    """A mooncake_master the operator runs: Deployment and Service ``<name>-mooncake``."""

    model_config = ConfigDict(json_schema_extra=_cel("mooncakeManaged"))
    image: str | None = Field(None, min_length=1, max_length=512, pattern=r"^\S(.*\S)?$", description=(
        "Image with the mooncake_master command on its PATH; unset: spec.image (the runtime image carries the "
        "mooncake wheel, SGLang's images mooncake-transfer-engine)."))
    rpc_port: int = Field(50051, **PORT, description="The master's RPC port (clients' MOONCAKE_MASTER).")
    metrics_port: int = Field(9003, **PORT, description="Prometheus metrics and the /health probe.")
    kv_lease_ttl_ms: int = Field(10000, ge=1, alias="kvLeaseTTLMs", description=(
        "How long an object stays unevictable after a read or write (--default_kv_lease_ttl, ms)."))
    client_ttl_seconds: int = Field(10, ge=1, alias="clientTTLSeconds", description=(
        "Seconds a client's segment stays mounted after its last heartbeat (--client_ttl)."))
    eviction_high_watermark_ratio: float = Field(0.9, gt=0, le=1, description=(
        "Share of the mounted segments in use at which eviction starts (--eviction_high_watermark_ratio)."))
    eviction_ratio: float = Field(0.05, gt=0, le=1, description=(
        "Share of objects evicted at a time when full (--eviction_ratio)."))
    http_metadata_server: HttpMetadataServer | None = Field(None, description=(
        "Run the master's HTTP metadata server (off: clients use P2PHANDSHAKE); the pods' metadataServer "
        "then defaults to it."))
    ha: MasterHA | None = Field(None, description="High availability: several masters, leader elected through etcd.")
    resources: Resources = Field(
        default_factory=lambda: Resources(requests={"cpu": "1", "memory": "1Gi"}, limits={"memory": "4Gi"}),
        description="The master container's resources (it holds object metadata; the memory is lent by the pods).")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels the master's pods require.")
    tolerations: list[dict[str, Any]] = Field(default_factory=list, description=(
        "Kubernetes tolerations of the master's pods."))


class Mooncake(_Model):
    """The Mooncake store (backend mooncake): its master and the transfer engine's settings; each
    field goes to the pods' env and storage extra config."""

    model_config = ConfigDict(json_schema_extra=_cel("mooncake"))
    master_address: str | None = Field(None, min_length=1, description="host:port of an existing mooncake_master "
                                                                       "(MOONCAKE_MASTER).")
    managed: ManagedMaster | None = Field(None, description="Have the operator run the master (instead of "
                                                            "masterAddress).")
    # No schema defaults here: a default would read as "set" and clash with extraConfig; the
    # effective defaults (tcp, P2PHANDSHAKE) are filled in by validation.normalise.
    protocol: Literal[flags.MOONCAKE_PROTOCOLS] | None = Field(None, description="tcp (default) or rdma.")  # type: ignore[valid-type]
    metadata_server: str | None = Field(None, description="P2PHANDSHAKE (default) or an http metadata URL.")
    global_segment_size: IntOrString | None = Field(None, description="Bytes or e.g. '4gb' this pod lends to the store.")
    local_buffer_size: IntOrString | None = Field(None, description=(
        "Bytes or e.g. '16mb' of each rank's transfer buffer (local_buffer_size); unset: the engine's default."))
    device_name: str | None = Field(None, description="RDMA device(s); empty discovers them.")


class Storage(_Model):
    """The L3 storage tier the fleet shares; a change is swapped live, pod by pod (each drained,
    detached and attached again)."""

    backend: _enum("hicache.storage.backend") = _from_flag("hicache.storage.backend")
    prefetch_policy: _enum("hicache.storage.prefetchPolicy") = _from_flag("hicache.storage.prefetchPolicy")
    extra_config: dict[str, Any] = Field(default_factory=dict,
                                         description=flags.flag("hicache.storage.extraConfig").help)
    mooncake: Mooncake | None = None


class HiCache(_Model):
    """SGLang's hierarchical KV cache: the GPU (L1) pool, the host (L2) pool and the L3 storage."""

    model_config = ConfigDict(json_schema_extra=_cel("hicache"))
    host_pool: HostPool = Field(default_factory=lambda: HostPool(ratio=flags.flag("hicache.hostPool.ratio").default),
                                description="Host (L2) pool size: exactly one of ratio, sizeGBPerRank, fromNodeMemory.")
    write_policy: _enum("hicache.writePolicy") = _from_flag("hicache.writePolicy")
    allow_write_back: bool = Field(False, description="Opt in to write_back despite its known crash under load.")
    io_backend: _enum("hicache.ioBackend") = _from_flag("hicache.ioBackend")
    mem_layout: _enum("hicache.memLayout") = _from_flag("hicache.memLayout")
    storage: Storage = Field(default_factory=Storage)


_PERCENT = re.compile(r"^\s*(\d{1,3})%\s*$")


def resolve_max_unavailable(value: int | str, replicas: int) -> int:
    """Pods allowed out of serving at once, the one reading of ``rollout.maxUnavailable`` used by
    validation, restarts, backend swaps and the PodDisruptionBudget: a count >= 1, or a
    percentage (1% to 100%) of replicas rounded down and never below 1, so every accepted value
    lets a rollout progress. Raises ValueError for 0, "0%" and anything else (rule max-unavailable)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"rollout.maxUnavailable {value!r} must be an integer or a percentage like '25%'")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"rollout.maxUnavailable must be at least 1, not {value} (0 would never let a pod out)")
        return value
    m = _PERCENT.match(value)
    if not m or not 1 <= int(m.group(1)) <= 100:
        raise ValueError(f"rollout.maxUnavailable {value!r} is not a count >= 1 or a percentage from 1% to 100%")
    return max(1, math.floor(replicas * int(m.group(1)) / 100))


class Rollout(_Model):
    """How pods are restarted and backends swapped: a few pods at a time, each drained first."""

    model_config = ConfigDict(json_schema_extra=_cel("rollout"))
    max_unavailable: IntOrString = Field(1, description="Pods out of serving at once (a count >= 1, or a percentage "
                                                        "of replicas rounded down, at least 1), for restarts and "
                                                        "backend swaps; the PodDisruptionBudget gets the same count.")
    drain_timeout_seconds: int = Field(300, ge=1, le=INT32_MAX, description="How long a pod may take to finish in-flight requests.")


class Rdma(_Model):
    """RDMA devices for the pods (the Mooncake transfer engine with protocol rdma)."""

    model_config = ConfigDict(json_schema_extra=_cel("rdma"))
    resource: str = Field(min_length=1, max_length=253, description=(
        "Extended resource of the RDMA device plugin, e.g. rdma/hca_shared_devices_a (requested and limited)."))
    count: int = Field(1, ge=1, le=64, description="Devices per pod.")
    privileged: bool = Field(False, description=(
        "Run the runtime container privileged as root, so it can lock (register) memory whatever the node's "
        "memlock limit; off: the container gets IPC_LOCK and the node's container runtime must give containers an "
        "unlimited memlock limit."))


class ModelShape(_Model):
    """KV geometry of the model, for bytes per token; overrides the built-in table."""

    num_layers: int = Field(ge=1, description="Transformer layers (config.json num_hidden_layers), split over pp.")
    num_kv_heads: int = Field(1, ge=1, description="KV heads (num_key_value_heads), split over tp.")
    head_dim: int = Field(1, ge=1, description="Dimension of one head.")
    dtype_bytes: int = Field(2, ge=1, description="Bytes of one KV element (2 for bfloat16 and float16).")
    mla: bool = Field(False, description="Multi-head latent attention (DeepSeek): a token's KV per layer is "
                                         "kvLoraRank + qkRopeHeadDim elements, not split over tp.")
    kv_lora_rank: int = Field(0, ge=0, description="With mla: the compressed KV's rank (kv_lora_rank).")
    qk_rope_head_dim: int = Field(0, ge=0, description="With mla: the rotary part of each key (qk_rope_head_dim).")


class SecretKeyRef(_Model):
    """One key of a Secret in the fleet's namespace."""

    # The API server's own syntax for a Secret name and a data key, so a typo is refused at apply.
    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN, description="The Secret's name.")
    key: str = Field("admin-api-key", min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$",
                     description="The key in the Secret's data.")


class ApiKeySecretRef(SecretKeyRef):
    """One key of a Secret in the fleet's namespace."""

    key: str = Field("api-key", min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$",
                     description="The key in the Secret's data.")


class Placement(_Model):
    """How many of the fleet's pods a node may hold (sizing assumes the same)."""

    policy: Literal["pack", "spread"] = Field(
        "pack", description="pack: as many pods per node as its GPUs hold (nvidia.com/gpu // (tp x pp)), each "
                            "with its share of the node's memory; spread: at most one pod per node (required pod "
                            "anti-affinity on kubernetes.io/hostname).")


class EnvVar(_Model):
    """A container env var (Kubernetes' EnvVar), added to the runtime container."""

    name: str = Field(min_length=1, max_length=1024, description="The variable's name.")
    value: str | None = Field(None, description="Its value (or valueFrom).")
    value_from: dict[str, Any] | None = Field(None, description="configMapKeyRef, secretKeyRef, fieldRef or "
                                                                "resourceFieldRef, as in a pod.")


class PodTemplateMetadata(_Model):
    """Labels and annotations added to the pods; the operator's own keys are refused."""

    model_config = ConfigDict(json_schema_extra=_cel("podTemplateMetadata"))
    labels: dict[str, str] = Field(default_factory=dict, max_length=64, description="Labels added to the pods.")
    annotations: dict[str, str] = Field(default_factory=dict, max_length=64,
                                        description="Annotations added to the pods.")


class PodTemplate(_Model):
    """Merged onto the pod template the operator renders, as a strategic merge patch: maps merge,
    containers/volumes/env/... merge by name (ports by containerPort, volumeMounts by mountPath), other
    lists replace. What the operator renders for its own purposes cannot be changed."""

    metadata: PodTemplateMetadata = Field(default_factory=PodTemplateMetadata)
    spec: dict[str, Any] = Field(default_factory=dict, description="A PodSpec fragment: sidecars (containers), "
                                 "initContainers, volumes, securityContext, priorityClassName, schedulerName, "
                                 "runtimeClassName, imagePullSecrets, ...")

    def dump(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, mode="json")
# A relative path inside a volume: segments that start with a letter, digit or '_' (no '..', no
# leading '/'); "" is the volume's root. An absolute path: the same segments after a '/'.
RELATIVE_PATH = r"^([A-Za-z0-9_][-._A-Za-z0-9]*(/[A-Za-z0-9_][-._A-Za-z0-9]*)*)?$"
ABSOLUTE_PATH = r"^(/[A-Za-z0-9_][-._A-Za-z0-9]*)+$"
# Files a Hugging Face download skips unless ignorePatterns says otherwise: other frameworks'
# weights and Meta's consolidated originals, none of which either engine loads.
DEFAULT_IGNORE_PATTERNS = ["original/*", "*.pth", "*.gguf", "*.onnx", "*.h5", "*.msgpack"]


class ModelClaim(_Model):
    """A directory on a PersistentVolumeClaim in the fleet's namespace."""

    claim_name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN,
                            description="The PersistentVolumeClaim (ReadWriteMany, or ReadOnlyMany for pvc, when "
                                        "replicas > 1: one pod runs per node).")
    path: str = Field("", max_length=1024, pattern=RELATIVE_PATH,
                      description="Directory inside the claim, relative to its root (empty: the root).")


class HfTokenSecretRef(SecretKeyRef):
    """One key of a Secret in the fleet's namespace."""

    key: str = Field("token", min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$",
                     description="The key in the Secret's data.")


class HuggingFaceSource(_Model):
    """spec.model (a Hub repo id), downloaded once by huggingface_hub in the pods' model-download init container into a claim the fleet shares; the engine reads it offline from there."""

    revision: str = Field("main", min_length=1, max_length=255, pattern=r"^[A-Za-z0-9_][-._/A-Za-z0-9]*$",
                          description="Branch, tag or commit. A branch is resolved at the first download and "
                                      "kept: pin a commit for fleets that must not drift.")
    token_secret_ref: HfTokenSecretRef | None = Field(
        None, description="Secret holding a Hub token (gated or private repos); given to the download as "
                          "HF_TOKEN from the Secret, never on a command line or in status.")
    endpoint: str | None = Field(None, max_length=512, pattern=r"^https?://\S+$",
                                 description="Hub endpoint (HF_ENDPOINT), e.g. an in-house mirror; unset: "
                                             "huggingface.co.")
    cache: ModelClaim = Field(description="Where the download lands, as <path>/<org>--<name>/<revision>: "
                                          "fleets and restarts that find it complete download nothing.")
    allow_patterns: list[str] | None = Field(None, description="Only files matching one of these globs; unset: "
                                                               "every file.")
    ignore_patterns: list[str] = Field(default_factory=lambda: list(DEFAULT_IGNORE_PATTERNS),
                                       description="Files matching these globs are skipped (default: "
                                                   + ", ".join(DEFAULT_IGNORE_PATTERNS) + ").")


class HostPathSource(_Model):
    """A checkpoint directory on the nodes themselves (read-only)."""

    path: str = Field(max_length=1024, pattern=ABSOLUTE_PATH,
                      description="The checkpoint directory on every node the pods may run on.")


class ImageSource(_Model):
    """A checkpoint inside an OCI image, mounted as a Kubernetes image volume (read-only)."""

    reference: str = Field(min_length=1, max_length=512, pattern=r"^\S+$",
                           description="OCI image or artifact holding the checkpoint (a Kubernetes image "
                                       "volume: the ImageVolume feature, on by default from 1.35).")
    path: str = Field("", max_length=1024, pattern=RELATIVE_PATH,
                      description="The checkpoint directory inside the image (empty: its root).")
    pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        None, description="The image volume's pull policy; unset: Kubernetes' default.")


class ModelSource(_Model):
    """Where the checkpoint comes from; exactly one. The engine gets it as a local --model-path and serves it as spec.model (--served-model-name)."""

    model_config = ConfigDict(json_schema_extra=_cel("modelSource"))
    hugging_face: HuggingFaceSource | None = None
    pvc: ModelClaim | None = Field(None, description="A checkpoint directory on a PersistentVolumeClaim (read-only).")
    host_path: HostPathSource | None = None
    image: ImageSource | None = None


ROUTER_IMAGE = "ghcr.io/hicache-dev/hicache-router:0.1.0"  # the Dockerfile's router target: sglang-router's wheel
ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")


class Router(_Model):
    """SGLang's router (sglang-router) in front of the fleet: a Deployment that finds the pods in
    serving through the API server and routes each request to one of them."""

    enabled: bool | None = Field(None, description="Run the router; unset: on when replicas > 1. On, the client "
                                                   "Service <name> points at the router and <name>-serving at "
                                                   "the pods in serving.")
    image: str = Field(ROUTER_IMAGE, min_length=1, max_length=512, pattern=r"^\S(.*\S)?$",
                       description="An image with sglang-router 0.3.2 (python -m sglang_router.launch_router).")
    replicas: int = Field(1, ge=1, le=64, description="Router pods; each routes on its own view of what every pod "
                                                      "holds.")
    policy: Literal[ROUTER_POLICIES] = Field(  # type: ignore[valid-type]
        "cache_aware", description="cache_aware: to the pod holding the longest prefix of the request, unless "
                                   "the load is imbalanced; round_robin, power_of_two (the less loaded of two), "
                                   "random.")
    resources: Resources = Field(
        default_factory=lambda: Resources(requests={"cpu": "500m", "memory": "512Mi"}, limits={"memory": "2Gi"}),
        description="The router container's requests and limits (default: 500m CPU and 512Mi requested, 2Gi "
                    "memory limit).")


class HiCacheDeploymentSpec(_Model):
    """The fleet: what the pods serve, with which engine, how many on which nodes, and how their
    KV cache is tiered (GPU, host DRAM, L3 storage)."""

    model_config = ConfigDict(json_schema_extra=_cel("spec"))
    engine: Literal[flags.ENGINES] = Field("bundled", description="bundled cache runtime or sglang.launch_server.")  # type: ignore[valid-type]
    # The API server refuses an image with leading or trailing whitespace.
    image: str = Field(min_length=1, max_length=512, pattern=r"^\S(.*\S)?$", description=(
        "Image of the pods' runtime container: the bundled cache runtime (engine bundled) or an SGLang image."))
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        None, description="Pull policy of every container the operator renders; unset: Kubernetes' default.")
    engine_version: str | None = Field(
        None, pattern=r"^\d+\.\d+\.\d+(\.post\d+)?$",
        description="SGLang release the image runs (e.g. 0.5.23), for the engine's feature checks; unset: read "
                    "from the image tag (lmsysorg/sglang:v0.5.23-cu129 -> 0.5.23).")
    model: str = _from_flag("model", min_length=1, max_length=512)
    model_source: ModelSource | None = Field(
        None, description="Where the checkpoint comes from (Hugging Face download, PVC, hostPath or image "
                          "volume); spec.model then names it. Unset: model is a path in the pod or a hub id "
                          "the engine resolves itself.")
    model_shape: ModelShape | None = None
    startup_timeout_seconds: int | None = Field(
        None, ge=60, le=7 * 24 * 3600,
        description="How long the engine may take from its container's start to /health answering (loading "
                    "weights, allocating pools): the startup probe's budget. Unset: 600, or 1800 when engine "
                    "sglang downloads a Hub id itself. Downloads by modelSource run before it, without a "
                    "deadline.")
    replicas: int = Field(1, ge=0, le=INT32_MAX, description="Pods of the fleet (also set through the scale "
                                                             "subresource: kubectl scale hcd).")
    parallelism: Parallelism = Field(default_factory=Parallelism)
    page_size: int = _from_flag("pageSize", ge=1)
    max_total_tokens: int | None = _from_flag("maxTotalTokens", ge=1)
    enable_cache_report: bool = _from_flag("enableCacheReport")
    hicache: HiCache = Field(default_factory=HiCache)
    rollout: Rollout = Field(default_factory=Rollout)
    resources: Resources = Field(default_factory=Resources, description=(
        "The runtime container's requests and limits. nvidia.com/gpu is always tp x pp; memory, unless given, "
        "is the sized pod memory (status.sizing.podMemory), request and limit alike."))
    node_selector: dict[str, str] = Field(default_factory=dict, description=(
        "Node labels the pods require; sizing reads only the nodes that match."))
    tolerations: list[dict[str, Any]] = Field(default_factory=list, description=(
        "Kubernetes tolerations of the pods; a node with a NoSchedule or NoExecute taint they do not tolerate "
        "is not eligible for sizing."))
    affinity: dict[str, Any] | None = Field(None, description=(
        "A Kubernetes Affinity for the pods; placement's pod (anti-)affinity is added to it, and its required "
        "node affinity limits the nodes sizing reads."))
    rdma: Rdma | None = Field(None, description="RDMA devices for the Mooncake transfer engine (protocol rdma).")
    host_network: bool = Field(False, description="Pods use the node's network; MOONCAKE_LOCAL_HOSTNAME becomes the host IP.")
    extra_volumes: list[dict[str, Any]] = Field(default_factory=list, description=(
        "Kubernetes volumes added to the pods."))
    extra_volume_mounts: list[dict[str, Any]] = Field(default_factory=list, description=(
        "Kubernetes volume mounts added to the runtime container."))
    placement: Placement = Field(default_factory=Placement)
    env: list[EnvVar] = Field(default_factory=list, description="Env vars added to the runtime container; the "
                                                                "ones the operator sets cannot be overridden.")
    env_from: list[dict[str, Any]] = Field(default_factory=list, description="configMapRef / secretRef sources of "
                                           "the runtime container's env (env vars set explicitly win).")
    extra_args: list[str] = Field(default_factory=list, description="Arguments appended to the engine's command "
                                  "line; a flag the operator renders from a spec field is refused naming the field.")
    router: Router = Field(default_factory=Router, description="SGLang's router in front of the pods.")
    pod_template: PodTemplate = Field(default_factory=PodTemplate,
                                      description="Labels, annotations and PodSpec fields merged onto the pods.")
    admin_key_secret_ref: SecretKeyRef | None = Field(
        None, description="Secret holding the admin API key; unset: the operator generates one.")
    api_key_secret_ref: ApiKeySecretRef | None = Field(
        None, description="Secret holding the clients' API key. engine sglang always has one (unset: the operator "
                          "generates <name>-api), since SGLang serves /server_info, admin key included, to anyone "
                          "without --api-key; engine bundled uses it when set. With the router on it opens the "
                          "router's client gate only, and the pods take the fleet's internal key (<name>-internal); "
                          "without the router it is the pods' --api-key.")

    @property
    def router_on(self) -> bool:
        """Whether the router runs: ``router.enabled``, unset meaning more than one replica."""
        return self.router.enabled if self.router.enabled is not None else self.replicas > 1

    @property
    def ranks_per_pod(self) -> int:
        """GPUs (and host pools) per pod."""
        return self.parallelism.tp * self.parallelism.pp

    def dump(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, mode="json")
