"""Pydantic model of HiCacheDeployment.spec; the CRD schema is generated from it (crdgen).

Types, enums, ranges and defaults live here (enums and defaults come from the flag table);
rules that relate several fields live in ``rules``/``validation`` so each has a name and a
message. CEL rules are attached to the schema nodes through ``json_schema_extra``.
"""

import math
import re
from typing import Any, Literal

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


class Mooncake(_Model):
    master_address: str | None = Field(None, min_length=1, description="host:port of mooncake_master (MOONCAKE_MASTER).")
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


class Resources(_Model):
    requests: dict[str, IntOrString] = Field(default_factory=dict)
    limits: dict[str, IntOrString] = Field(default_factory=dict)


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


class Placement(_Model):
    policy: Literal["pack", "spread"] = Field(
        "pack", description="pack: as many pods per node as its GPUs hold (nvidia.com/gpu // (tp x pp)), each "
                            "with its share of the node's memory; spread: at most one pod per node (required pod "
                            "anti-affinity on kubernetes.io/hostname).")


class EnvVar(_Model):
    """A container env var (Kubernetes' EnvVar), added to the runtime container."""

    name: str = Field(min_length=1, max_length=1024)
    value: str | None = None
    value_from: dict[str, Any] | None = Field(None, description="configMapKeyRef, secretKeyRef, fieldRef or "
                                                                "resourceFieldRef, as in a pod.")


class PodTemplateMetadata(_Model):
    model_config = ConfigDict(json_schema_extra=_cel("podTemplateMetadata"))
    labels: dict[str, str] = Field(default_factory=dict, max_length=64)
    annotations: dict[str, str] = Field(default_factory=dict, max_length=64)


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


ROUTER_IMAGE = "hicache-router:0.1.0"  # the Dockerfile's router target: sglang-router's wheel
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
    host_network: bool = Field(False, description="Pods use the node's network; MOONCAKE_LOCAL_HOSTNAME becomes the host IP.")
    extra_volumes: list[dict[str, Any]] = Field(default_factory=list)
    extra_volume_mounts: list[dict[str, Any]] = Field(default_factory=list)
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
        None, description="Secret holding the clients' API key (--api-key). engine sglang always has one (unset: "
                          "the operator generates <name>-api), since without it SGLang serves /server_info, admin "
                          "key included, to anyone; engine bundled uses it when set.")

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
