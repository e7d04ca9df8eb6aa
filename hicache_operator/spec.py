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

from hicache_operator import flags
from hicache_operator.rules import cel_rules

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
    model_config = ConfigDict(json_schema_extra=_cel("parallelism"))
    # tp x pp GPUs go into the pod's resources as one integer quantity: keep it a sane integer.
    tp: int = _from_flag("parallelism.tp", ge=1, le=MAX_RANKS)
    dp: int = _from_flag("parallelism.dp", ge=1, le=MAX_RANKS)
    pp: int = _from_flag("parallelism.pp", ge=1, le=MAX_RANKS)


class FromNodeMemory(_Model):
    fraction: float = Field(0.8, gt=0, le=1, description="Share of the node's allocatable memory the pod's memory limit may take "
                                                          "(host pools and every other term of status.sizing).")
    reserve_gib: float = Field(16.0, ge=0, alias="reserveGiB",
                               description="GiB of that share kept back for the OS and daemons.")


class HostPool(_Model):
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
    requests: dict[str, IntOrString] = Field(default_factory=dict)
    limits: dict[str, IntOrString] = Field(default_factory=dict)


HOST_PORT = r"^[^\s:;/]+:[0-9]{1,5}$"
PORT = {"ge": 1, "le": 65535}


class HttpMetadataServer(_Model):
    port: int = Field(8080, **PORT, description="Port of the master's HTTP metadata server (it listens on every "
                                                "address of the pod).")


class MasterHA(_Model):
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
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)


class Mooncake(_Model):
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
    local_buffer_size: IntOrString | None = None
    device_name: str | None = Field(None, description="RDMA device(s); empty discovers them.")


class Storage(_Model):
    backend: _enum("hicache.storage.backend") = _from_flag("hicache.storage.backend")
    prefetch_policy: _enum("hicache.storage.prefetchPolicy") = _from_flag("hicache.storage.prefetchPolicy")
    extra_config: dict[str, Any] = Field(default_factory=dict,
                                         description=flags.flag("hicache.storage.extraConfig").help)
    mooncake: Mooncake | None = None


class HiCache(_Model):
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
    model_config = ConfigDict(json_schema_extra=_cel("rollout"))
    max_unavailable: IntOrString = Field(1, description="Pods out of serving at once (a count >= 1, or a percentage "
                                                        "of replicas rounded down, at least 1), for restarts and "
                                                        "backend swaps; the PodDisruptionBudget gets the same count.")
    drain_timeout_seconds: int = Field(300, ge=1, le=INT32_MAX, description="How long a pod may take to finish in-flight requests.")


class Rdma(_Model):
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

    num_layers: int = Field(ge=1)
    num_kv_heads: int = Field(1, ge=1)
    head_dim: int = Field(1, ge=1)
    dtype_bytes: int = Field(2, ge=1)
    mla: bool = False
    kv_lora_rank: int = Field(0, ge=0)
    qk_rope_head_dim: int = Field(0, ge=0)


class SecretKeyRef(_Model):
    # The API server's own syntax for a Secret name and a data key, so a typo is refused at apply.
    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)
    key: str = Field("admin-api-key", min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")


class ApiKeySecretRef(SecretKeyRef):
    key: str = Field("api-key", min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")


class HiCacheDeploymentSpec(_Model):
    model_config = ConfigDict(json_schema_extra=_cel("spec"))
    engine: Literal[flags.ENGINES] = Field("bundled", description="bundled cache runtime or sglang.launch_server.")  # type: ignore[valid-type]
    # The API server refuses an image with leading or trailing whitespace.
    image: str = Field(min_length=1, max_length=512, pattern=r"^\S(.*\S)?$")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    engine_version: str | None = Field(
        None, pattern=r"^\d+\.\d+\.\d+(\.post\d+)?$",
        description="SGLang release the image runs (e.g. 0.5.23), for the engine's feature checks; unset: read "
                    "from the image tag (lmsysorg/sglang:v0.5.23-cu129 -> 0.5.23).")
    model: str = _from_flag("model", min_length=1, max_length=512)
    model_shape: ModelShape | None = None
    replicas: int = Field(1, ge=0, le=INT32_MAX)
    parallelism: Parallelism = Field(default_factory=Parallelism)
    page_size: int = _from_flag("pageSize", ge=1)
    max_total_tokens: int | None = _from_flag("maxTotalTokens", ge=1)
    enable_cache_report: bool = _from_flag("enableCacheReport")
    hicache: HiCache = Field(default_factory=HiCache)
    rollout: Rollout = Field(default_factory=Rollout)
    resources: Resources = Field(default_factory=Resources)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    affinity: dict[str, Any] | None = None
    rdma: Rdma | None = Field(None, description="RDMA devices for the Mooncake transfer engine (protocol rdma).")
    host_network: bool = Field(False, description="Pods use the node's network; MOONCAKE_LOCAL_HOSTNAME becomes the host IP.")
    extra_volumes: list[dict[str, Any]] = Field(default_factory=list)
    extra_volume_mounts: list[dict[str, Any]] = Field(default_factory=list)
    admin_key_secret_ref: SecretKeyRef | None = Field(
        None, description="Secret holding the admin API key; unset: the operator generates one.")
    api_key_secret_ref: ApiKeySecretRef | None = Field(
        None, description="Secret holding the clients' API key (--api-key). engine sglang always has one (unset: "
                          "the operator generates <name>-api), since without it SGLang serves /server_info, admin "
                          "key included, to anyone; engine bundled uses it when set.")

    @property
    def ranks_per_pod(self) -> int:
        """GPUs (and host pools) per pod; one pod per node, so also ranks per node."""
        return self.parallelism.tp * self.parallelism.pp

    def dump(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, mode="json")
