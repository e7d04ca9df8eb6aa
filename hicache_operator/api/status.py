"""HiCacheDeployment.status as the API shows it: the models the CRD's status schema is generated from.

``hicache_operator.plan.status`` computes a status of this shape from one observation.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from hicache_operator.api.conditions import SWAP_FAILED, SWAP_IN_PROGRESS, Condition

SWAP_CONDITIONS = (SWAP_IN_PROGRESS, SWAP_FAILED)
REFUSED_REASON = "RefusedByAPIServer"
ROUTER_READY = "RouterReady"
OWN_CONDITIONS = ("ConfigValid", "Ready", "Progressing", "Degraded", ROUTER_READY, *SWAP_CONDITIONS)


class SizingRecord(BaseModel):
    """How the host pools and the pod's memory were sized, every term in bytes (``status.sizing``)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True)

    inputs_hash: str = Field(description="Hash of the spec fields sizing reads; the record is reused while it holds.")
    mode: Literal["fromNodeMemory", "sizeGBPerRank", "ratio"] = Field(description="Which hostPool field sized the pools.")
    placement: Literal["pack", "spread"] = Field(description="spec.placement.policy.")
    ranks_per_pod: int = Field(description="Ranks (GPUs) of one pod, each with its own host pool.")
    pods_per_node_by_gpus: int | None = Field(None, description="Pods the sizing node may hold by its GPUs and the "
                                              "placement: nvidia.com/gpu // ranksPerPod with pack, 1 with spread "
                                              "or hostNetwork.")
    pods_per_node_by_memory: int | None = Field(None, description="Pods the sizing node's allocatable memory holds at "
                                                "podMemoryBytes each (the scheduler's memory bound).")
    pods_per_node: int | None = Field(None, description="Pods the sizing node may hold: the smaller bound.")
    ranks_per_node: int | None = Field(None, description="podsPerNode x ranksPerPod.")
    placement_formula: str | None = Field(None, description="podsPerNode, bound by bound.")
    overhead_bytes: int = Field(description="hostPool.overheadGiB: the processes themselves.")
    shm_bytes: int = Field(description="hostPool.shmGiB: the memory-backed /dev/shm.")
    mooncake_segment_bytes: int | None = Field(None, description="The Mooncake global segment the pod lends.")
    sidecar_bytes: int | None = Field(None, description="Memory requests of the containers podTemplate adds.")
    mooncake_local_buffer_bytes: int | None = Field(
        None, description="The ranks' Mooncake transfer buffers (local_buffer_size each; SGLang: 16 MiB).")
    engine_reserve_bytes: int = Field(description="What SGLang's host headroom check keeps free (0 without it).")
    page_cache_bytes: int | None = Field(None, description="The checkpoint's page cache, which the headroom check of "
                                         "SGLang 0.5.21 counts as used when the ranks allocate (later releases count "
                                         "it as free).")
    admission_slack_bytes: int | None = Field(None, description="Room the headroom check leaves beyond every other "
                                              "term: 1 GiB per rank, for processes holding more than overheadGiB.")
    pool_multiplier: int = Field(description="Pools the limit must hold: 2r-1 with SGLang's check, else r.")
    page_size: int = Field(description="Tokens per page (spec.pageSize): pools hold whole pages.")
    bytes_per_token: int | None = Field(None, description="KV bytes per token per rank; unset for a model of unknown shape.")
    eligible_nodes: int | None = Field(None, description="Nodes the pods may land on; unset when the nodes were not read.")
    sizing_node: str | None = Field(None, description="The eligible node with the least memory per pod it may hold "
                                                      "(allocatable, or fromNodeMemory's share, / podsPerNodeByGpus): "
                                                      "the pools are sized for it.")
    node_allocatable_bytes: int | None = Field(None, description="The sizing node's allocatable memory.")
    ineligible: str | None = Field(None, description="Why no node is eligible, node by node.")
    fraction: float | None = Field(None, description="fromNodeMemory.fraction: the share of the node's allocatable "
                                   "memory the fleet's pods on it may take.")
    reserve_bytes: int | None = Field(None, description="fromNodeMemory.reserveGiB: kept out of that share.")
    budget_per_rank_bytes: int | None = Field(None, description="What one rank's pool may take: the pod's share less "
                                              "the other terms, over poolMultiplier.")
    budget_formula: str | None = Field(None, description="budgetPerRankBytes, term by term, down to --hicache-size.")
    hicache_size_gb: int | None = Field(None, alias="hicacheSizeGB", description="--hicache-size per rank (GB).")
    ratio: float | None = Field(None, description="hostPool.ratio: host pool tokens per device pool token.")
    host_pool_pages_per_rank: int | None = Field(None, description="Pages of one rank's host pool (SGLang: what "
                                                 "--hicache-size buys, plus one).")
    host_pool_tokens_per_rank: int | None = Field(None, description="hostPoolPagesPerRank x pageSize.")
    host_pool_bytes_per_rank: int | None = Field(None, description="hostPoolTokensPerRank x bytesPerToken: what each "
                                                 "rank allocates.")
    pod_memory_bytes: int | None = Field(None, description="The runtime container's memory request and limit (the "
                                                           "pod's, with sidecarBytes beside it).")
    pod_memory: str | None = Field(None, description="podMemoryBytes as a quantity (whole MiB).")
    formula: str | None = Field(None, description="podMemoryBytes, term by term.")
    engine_headroom_check: str | None = Field(None, description="SGLang's headroom check for the last rank.")
    engine_headroom_spare_bytes: int | None = Field(None, description="What that check leaves the last rank beyond "
                                                    "its pool: admissionSlackBytes / ranksPerPod, plus the limit's "
                                                    "rounding to whole MiB.")
    note: str | None = Field(None, description="Why the pools could not be sized here.")

    @property
    def storage_bytes(self) -> int:
        """The terms the Mooncake backend adds, which a live swap changes (left out of the restart hash)."""
        return (self.mooncake_segment_bytes or 0) + (self.mooncake_local_buffer_bytes or 0)

    def dump(self) -> dict[str, Any]:
        """The camelCase dict status carries."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")

    @classmethod
    def read(cls, raw: Any) -> "SizingRecord | None":
        """A record from a status; None when absent or unreadable (sizing then runs afresh)."""
        try:
            return cls.model_validate(raw) if isinstance(raw, dict) else None
        except ValidationError:
            return None


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class RuleNote(_Model):
    """A rule applied to the spec: a normalisation made or a warning raised."""

    rule: str = Field(description="The rule's name (docs/validation-rules.md).")
    message: str = Field(description="What the rule did or found, and what to change.")


class EffectiveConfig(_Model):
    """What the pods run: the spec after normalisation, the rendered command, and the rules applied."""

    engine: str = Field(description="spec.engine.")
    model: str = Field(description="spec.model.")
    hicache: dict[str, Any] = Field(description="spec.hicache after normalisation.")
    command: list[str] = Field(description="The runtime container's command.")
    args: list[str] = Field(description="The engine's arguments rendered from the spec.")
    restart_hash: str = Field(description="Hash of the pod template without the storage config; a change restarts pods.")
    storage_hash: str = Field(description="Fingerprint of the storage config; a change is swapped live.")
    normalisations: list[RuleNote] = Field(default_factory=list, description="What validation changed in the spec.")
    warnings: list[RuleNote] = Field(default_factory=list, description="What validation found worth a look.")

    def dump(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, mode="json")


class MooncakeMasterStatus(_Model):
    """The managed Mooncake master (spec.hicache.storage.mooncake.managed)."""

    deployment: str = Field(description="Its Deployment and Service.")
    address: str | None = Field(None, description="What the pods' MOONCAKE_MASTER names.")
    replicas: int = Field(description="Masters wanted (one, or the HA leader and standbys).")
    ready_replicas: int = Field(description="Masters whose /health answers (readiness probe).")
    ready: bool = Field(description="At least one master is ready.")


class HiCacheDeploymentStatus(_Model):
    """The fleet as the operator last observed it: every field and condition derived from one observation."""

    observed_generation: int | None = Field(None, description="The metadata.generation this status describes.")
    replicas: int | None = Field(None, description="Pods that exist (not terminating).")
    ready_replicas: int | None = Field(None, description="Pods that are Ready and in serving (not taken out by a swap or restart).")
    ready: str | None = Field(None, description="readyReplicas/spec.replicas, for the READY column.")
    updated_replicas: int | None = Field(
        None, description="Pods (not terminating) created from the current pod template; the others are restarted, "
                          "drained first, within rollout.maxUnavailable.")
    selector: str | None = Field(None, description="Pod label selector (scale subresource).")
    conditions: list[Condition] = Field(default_factory=list, description=(
        f"The fleet's conditions: {', '.join(OWN_CONDITIONS)}."))
    effective_config: EffectiveConfig | None = Field(
        None, description="The configuration after normalisation, the rendered arguments, and every rule applied.")
    sizing: SizingRecord | None = Field(None, description="Host pool sizing: every term of the pods' memory, and "
                                                          "the engine's host headroom check for the last rank.")
    host_pool: str | None = Field(None, description="Host pool per rank, for the HOST-POOL column.")
    current_backend: str | None = Field(
        None, description="L3 backend the running pods run: the target when all do, else the one most of the "
                          "others run; unset while no pod runs.")
    target_backend: str | None = Field(None, description="L3 backend the spec asks for.")
    swap_progress: str | None = Field(
        None, description="Running pods on the target storage config / spec.replicas.")
    router_ready: str | None = Field(
        None, description="Ready router pods / spec.router.replicas, for the ROUTER column; unset without the router.")
    backend_swap: dict[str, Any] | None = Field(None, description="Backend swap state, owned by the rollout module.")
    mooncake_master: MooncakeMasterStatus | None = Field(
        None, description="The managed Mooncake master's readiness; unset without one.")
