"""spec.hicache: the host pool, the storage backend (L3) with Mooncake and a managed master, and
the RDMA devices the Mooncake transfer engine may use."""

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from hicache_operator.api import flags
from hicache_operator.api.spec_fields import IntOrString, Resources, SpecModel, cel, enum_of, from_flag


class FromNodeMemory(SpecModel):
    """Size each rank's host pool from the memory of the smallest eligible node (status.sizing)."""

    fraction: float = Field(0.8, gt=0, le=1, description="Share of the node's allocatable memory the pod's memory limit may take "
                                                          "(host pools and every other term of status.sizing).")
    reserve_gib: float = Field(16.0, ge=0, alias="reserveGiB",
                               description="GiB of that share kept back for the OS and daemons.")


class HostPool(SpecModel):
    """Host (L2) pool per rank: exactly one of ratio, sizeGBPerRank, fromNodeMemory; and the other
    terms of the pod's memory."""

    model_config = ConfigDict(json_schema_extra=cel("hostPool"))
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


HOST_PORT = r"^[^\s:;/]+:[0-9]{1,5}$"
PORT = {"ge": 1, "le": 65535}


class HttpMetadataServer(SpecModel):
    """The managed master's HTTP metadata server (the transfer engine's metadata, instead of P2PHANDSHAKE)."""

    port: int = Field(8080, **PORT, description="Port of the master's HTTP metadata server (it listens on every "
                                                "address of the pod).")


class MasterHA(SpecModel):
    """Several managed masters, the leader elected through an existing etcd cluster."""

    etcd_endpoints: list[Annotated[str, Field(pattern=HOST_PORT, max_length=253)]] = Field(
        min_length=1, max_length=16, description=(
            "host:port of each member of an existing etcd cluster the masters elect their leader through; "
            "clients find the leader there too (MOONCAKE_MASTER etcd://...)."))
    replicas: int = Field(2, ge=2, le=7, description="Masters: one leader and standbys.")


class ManagedMaster(SpecModel):
    """A mooncake_master the operator runs: Deployment and Service ``<name>-mooncake``."""

    model_config = ConfigDict(json_schema_extra=cel("mooncakeManaged"))
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


class Mooncake(SpecModel):
    """The Mooncake store (backend mooncake): its master and the transfer engine's settings; each
    field goes to the pods' env and storage extra config."""

    model_config = ConfigDict(json_schema_extra=cel("mooncake"))
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


class Storage(SpecModel):
    """The L3 storage tier the fleet shares; a change is swapped live, pod by pod (each drained,
    detached and attached again)."""

    backend: enum_of("hicache.storage.backend") = from_flag("hicache.storage.backend")
    prefetch_policy: enum_of("hicache.storage.prefetchPolicy") = from_flag("hicache.storage.prefetchPolicy")
    extra_config: dict[str, Any] = Field(default_factory=dict,
                                         description=flags.flag("hicache.storage.extraConfig").help)
    mooncake: Mooncake | None = None


class HiCache(SpecModel):
    """SGLang's hierarchical KV cache: the GPU (L1) pool, the host (L2) pool and the L3 storage."""

    model_config = ConfigDict(json_schema_extra=cel("hicache"))
    host_pool: HostPool = Field(default_factory=lambda: HostPool(ratio=flags.flag("hicache.hostPool.ratio").default),
                                description="Host (L2) pool size: exactly one of ratio, sizeGBPerRank, fromNodeMemory.")
    write_policy: enum_of("hicache.writePolicy") = from_flag("hicache.writePolicy")
    allow_write_back: bool = Field(False, description="Opt in to write_back despite its known crash under load.")
    io_backend: enum_of("hicache.ioBackend") = from_flag("hicache.ioBackend")
    mem_layout: enum_of("hicache.memLayout") = from_flag("hicache.memLayout")
    storage: Storage = Field(default_factory=Storage)


class Rdma(SpecModel):
    """RDMA devices for the pods (the Mooncake transfer engine with protocol rdma)."""

    model_config = ConfigDict(json_schema_extra=cel("rdma"))
    resource: str = Field(min_length=1, max_length=253, description=(
        "Extended resource of the RDMA device plugin, e.g. rdma/hca_shared_devices_a (requested and limited)."))
    count: int = Field(1, ge=1, le=64, description="Devices per pod.")
    privileged: bool = Field(False, description=(
        "Run the runtime container privileged as root, so it can lock (register) memory whatever the node's "
        "memlock limit; off: the container gets IPC_LOCK and the node's container runtime must give containers an "
        "unlimited memlock limit."))
