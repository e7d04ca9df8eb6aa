"""Pydantic model of HiCacheDeployment.spec; the CRD schema is generated from it (crdgen).

Types, enums, ranges and defaults live here (enums and defaults come from the flag table);
rules that relate several fields live in ``rules``/``validation`` so each has a name and a
message. CEL rules are attached to the schema nodes through ``json_schema_extra``. The top-level
spec is here; spec.hicache is ``spec_hicache``'s, the model's shape and source ``spec_model``'s,
and the field vocabulary they share ``spec_fields``'.
"""

import math
import re
from typing import Any, Literal

from pydantic import ConfigDict, Field

from hicache_operator.api import flags
from hicache_operator.api.spec_fields import INT32_MAX, MAX_RANKS, IntOrString, Resources, SecretKeyRef, SpecModel, cel, from_flag
from hicache_operator.api.spec_hicache import HiCache, Rdma
from hicache_operator.api.spec_model import ModelShape, ModelSource

GROUP = "hicache.dev"
VERSION = "v1alpha1"
KIND = "HiCacheDeployment"
PLURAL = "hicachedeployments"
SINGULAR = "hicachedeployment"
SHORT_NAME = "hcd"
RUNTIME_CONTAINER = "runtime"  # the operator's container in every pod


class Parallelism(SpecModel):
    """How each pod's engine splits the model over its GPUs: tp x pp ranks (one GPU each) per pod."""

    model_config = ConfigDict(json_schema_extra=cel("parallelism"))
    # tp x pp GPUs go into the pod's resources as one integer quantity: keep it a sane integer.
    tp: int = from_flag("parallelism.tp", ge=1, le=MAX_RANKS)
    dp: int = from_flag("parallelism.dp", ge=1, le=MAX_RANKS)
    pp: int = from_flag("parallelism.pp", ge=1, le=MAX_RANKS)


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


class Rollout(SpecModel):
    """How pods are restarted and backends swapped: a few pods at a time, each drained first."""

    model_config = ConfigDict(json_schema_extra=cel("rollout"))
    max_unavailable: IntOrString = Field(1, description="Pods out of serving at once (a count >= 1, or a percentage "
                                                        "of replicas rounded down, at least 1), for restarts and "
                                                        "backend swaps; the PodDisruptionBudget gets the same count.")
    drain_timeout_seconds: int = Field(300, ge=1, le=INT32_MAX, description="How long a pod may take to finish in-flight requests.")


class ApiKeySecretRef(SecretKeyRef):
    """One key of a Secret in the fleet's namespace."""

    key: str = Field("api-key", min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$",
                     description="The key in the Secret's data.")


class Placement(SpecModel):
    """How many of the fleet's pods a node may hold (sizing assumes the same)."""

    policy: Literal["pack", "spread"] = Field(
        "pack", description="pack: as many pods per node as its GPUs hold (nvidia.com/gpu // (tp x pp)), each "
                            "with its share of the node's memory; spread: at most one pod per node (required pod "
                            "anti-affinity on kubernetes.io/hostname).")


class EnvVar(SpecModel):
    """A container env var (Kubernetes' EnvVar), added to the runtime container."""

    name: str = Field(min_length=1, max_length=1024, description="The variable's name.")
    value: str | None = Field(None, description="Its value (or valueFrom).")
    value_from: dict[str, Any] | None = Field(None, description="configMapKeyRef, secretKeyRef, fieldRef or "
                                                                "resourceFieldRef, as in a pod.")


class PodTemplateMetadata(SpecModel):
    """Labels and annotations added to the pods; the operator's own keys are refused."""

    model_config = ConfigDict(json_schema_extra=cel("podTemplateMetadata"))
    labels: dict[str, str] = Field(default_factory=dict, max_length=64, description="Labels added to the pods.")
    annotations: dict[str, str] = Field(default_factory=dict, max_length=64,
                                        description="Annotations added to the pods.")


class PodTemplate(SpecModel):
    """Merged onto the pod template the operator renders, as a strategic merge patch: maps merge,
    containers/volumes/env/... merge by name (ports by containerPort, volumeMounts by mountPath), other
    lists replace. What the operator renders for its own purposes cannot be changed."""

    metadata: PodTemplateMetadata = Field(default_factory=PodTemplateMetadata)
    spec: dict[str, Any] = Field(default_factory=dict, description="A PodSpec fragment: sidecars (containers), "
                                 "initContainers, volumes, securityContext, priorityClassName, schedulerName, "
                                 "runtimeClassName, imagePullSecrets, ...")

    def dump(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, mode="json")


ROUTER_IMAGE = "ghcr.io/hicache-dev/hicache-router:0.1.0"  # the Dockerfile's router target: sglang-router's wheel
ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")


class Router(SpecModel):
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


class HiCacheDeploymentSpec(SpecModel):
    """The fleet: what the pods serve, with which engine, how many on which nodes, and how their
    KV cache is tiered (GPU, host DRAM, L3 storage)."""

    model_config = ConfigDict(json_schema_extra=cel("spec"))
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
    model: str = from_flag("model", min_length=1, max_length=512)
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
    page_size: int = from_flag("pageSize", ge=1)
    max_total_tokens: int | None = from_flag("maxTotalTokens", ge=1)
    enable_cache_report: bool = from_flag("enableCacheReport")
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
